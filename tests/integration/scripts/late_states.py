"""examples/gpt_inplace.py, where the actives of generation 0 make their retained states only
after every shadow of generation 1 has made its optimizer -- and so tried to pre-attach and
found nothing: the order a fast shadow has beside a large model's initialization.  The actives
then start training only once every such shadow has pre-attached (so that the injected kill
finds them attached: the test is about their attach, not about a race with the kill).

The shadows say so by files in $LATE_DIR; an active waits for one per rank (at most 120 s
each time, then goes on: the test then fails on what it checks, not on a hang).  Arguments
are gpt_inplace.py's."""
import os
import runpy
import sys
import time
from pathlib import Path

from leto_runtime import binding
from leto_runtime.job import Job

ROOT = Path(__file__).resolve().parents[3]
LATE = Path(os.environ["LATE_DIR"])


def wait_for(late_dir, pattern, n, monotonic, sleep):
    end = monotonic() + 120
    while len(list(late_dir.glob(pattern))) < n and monotonic() < end:
        sleep(0.05)


def late(adamw, preattach, late_dir, monotonic, sleep):
    # closures: a survivor demoted in process runs the script again after runpy has cleared
    # this module's globals
    def wrapped_adamw(self, *args, **kw):
        if self.role == "shadow" and self.ctx.generation == 1:
            opt = adamw(self, *args, **kw)
            (late_dir / f"shadow_{self.rank}").touch()
            return opt
        if self.role == "active" and self.ctx.generation == 0:
            wait_for(late_dir, "shadow_*", self.world_size, monotonic, sleep)
            opt = adamw(self, *args, **kw)
            wait_for(late_dir, "attached_*", self.world_size, monotonic, sleep)
            return opt
        return adamw(self, *args, **kw)

    def wrapped_preattach(job):
        preattach(job)
        if job.role == "shadow" and job.ctx.generation == 1 and job.ss is not None:
            (late_dir / f"attached_{job.rank}").touch()
    return wrapped_adamw, wrapped_preattach


Job.adamw, binding.preattach = late(Job.adamw, binding.preattach, LATE, time.monotonic,
                                    time.sleep)
sys.argv = [str(ROOT / "examples" / "gpt_inplace.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
