"""Breaks the launcher's log files under it, then fails once; the restarted attempt succeeds.

usage: sabotage_logs.py MODE
  full       on attempt 0, rank 0 creates the next attempt's log files as symlinks to /dev/full
             (every write to them fails with ENOSPC, for root and for everyone else)
  root-file  on attempt 0, rank 0 replaces the whole log root with a regular file (no log
             directory of a later attempt can be created)

Every attempt prints `out attempt=A rank=R` to stdout and `err attempt=A rank=R` to stderr.
On attempt 0, rank 0 exits 3 after the sabotage (its peers wait to be stopped); on attempt 1
every rank writes $OUT_DIR/done_<rank> and exits 0.  The log root is found from
TORCHELASTIC_ERROR_FILE (<root>/attempt_<k>/<local_rank>/error.json).
"""
import os
import shutil
import sys
import time

mode = sys.argv[1]
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out_dir = os.environ["OUT_DIR"]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])))

print(f"out attempt={attempt} rank={rank}", flush=True)
print(f"err attempt={attempt} rank={rank}", file=sys.stderr, flush=True)
if attempt > 0:
    open(os.path.join(out_dir, f"done_{rank}"), "w").close()
    sys.exit(0)
if rank != 0:
    time.sleep(120)          # stopped by the launcher when rank 0 fails
    sys.exit(0)
if mode == "full":
    for lr in range(int(os.environ["LOCAL_WORLD_SIZE"])):
        d = os.path.join(root, "attempt_1", str(lr))
        os.makedirs(d)
        for name in ("stdout.log", "stderr.log"):
            os.symlink("/dev/full", os.path.join(d, name))
elif mode == "root-file":
    # The launcher may add a file under the root while it is removed (a peer's log line):
    # remove again until the root is a file of ours.
    for _ in range(100):
        shutil.rmtree(root, ignore_errors=True)
        try:
            with open(root, "x") as f:
                f.write("not a directory any more\n")
            break
        except (FileExistsError, IsADirectoryError):
            time.sleep(0.05)
    else:
        raise SystemExit(f"could not replace the log root {root} with a file")
else:
    raise SystemExit(f"unknown mode {mode!r}")
open(os.path.join(out_dir, "sabotaged"), "w").close()
sys.exit(3)
