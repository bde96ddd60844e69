"""The restart demo (README: `leto-run --config configs/restart_demo.yaml`) leaves nothing in the
temp dir but the job's logs.

Why: its script (examples/toy_train.py) used to checkpoint into a fixed /tmp/leto_toy_ckpt that
nothing removed (and that a second run, or another user, would share).  It now checkpoints into
a directory of the run in the temp dir and removes it once training is done; Leto removes its
own run directory.  What stays is the log directory, as under torchrun (`--log-dir` defaults to
a temp dir): the recovery report points into it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, run

LOG_FILES = {"stdout.log", "stderr.log", "error.json", "events.jsonl"}
OLD_CKPT = Path("/tmp/leto_toy_ckpt")      # where the script used to leave its checkpoints


def _leto_run() -> list[str]:
    """The console script the README runs, from this interpreter's environment."""
    exe = Path(sys.executable).with_name("leto-run")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "leto_run"]


@pytest.mark.slow
@pytest.mark.alone          # the demo's own hang timeout and step pacing
def test_restart_demo_leaves_only_its_logs(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    old_existed = OLD_CKPT.exists()
    # torch's compile cache (DDP creates torchinductor_<user> in the temp dir) is torch's, shared
    # by every torch program of the user: kept out of the directory under test.
    env = base_env(TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    r = run(_leto_run() + ["--config", "configs/restart_demo.yaml", "--no-status"], env,
            timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # The checkpoint was written and used: the restarted group resumed from it.
    assert "resumed from the checkpoint of step 20" in out, out[-3000:]

    left = sorted(p.name for p in tmp.iterdir())
    assert len(left) == 1 and left[0].startswith("torchelastic_"), left
    files = [p for p in (tmp / left[0]).rglob("*") if p.is_file()]
    assert files and {p.name for p in files} <= LOG_FILES, sorted(map(str, files))
    if not old_existed:
        assert not OLD_CKPT.exists()
