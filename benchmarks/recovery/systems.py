"""The systems compared, and the command line that launches each one.

Role: one place that says what "leto in place", "torchrun + DCP" etc. mean, so every system
gets the same training options (model, batch, seed) from the same code.  Pure functions: no
processes here (launch.py starts them).

  reference            torchrun, train.py --mode ref: no fault tolerance, no failures; sizes
                       the run and calibrates the checkpoint cost
  leto-inplace         leto-run (in-place mode), train.py --mode leto: shadows, retained state
  torchrun-dcp-async   torchrun --max-restarts N, train.py --mode dcp --ckpt async
  torchrun-dcp-sync    torchrun --max-restarts N, train.py --mode dcp --ckpt sync
  leto-restart-dcp     leto-run --recovery restart --max-restarts N, the same DCP script (async)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from benchmarks.launch_overhead import launcher_cmd
from benchmarks.recovery.presets import Preset

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
LETO, TORCHRUN = "leto-run", "torchrun"


@dataclass(frozen=True)
class System:
    name: str
    launcher: str              # LETO | TORCHRUN
    mode: str                  # train.py --mode
    ckpt: str | None = None    # sync | async (dcp mode)
    recovery: str | None = None   # leto-run --recovery
    label: str = ""


REFERENCE = System("reference", TORCHRUN, "ref", label="fault-free reference (torchrun, no FT)")
LETO_INPLACE = System("leto-inplace", LETO, "leto", recovery="inplace",
                      label="leto-run in place")
TORCHRUN_ASYNC = System("torchrun-dcp-async", TORCHRUN, "dcp", ckpt="async",
                        label="torchrun + DCP async")
TORCHRUN_SYNC = System("torchrun-dcp-sync", TORCHRUN, "dcp", ckpt="sync",
                       label="torchrun + DCP sync")
LETO_RESTART = System("leto-restart-dcp", LETO, "dcp", ckpt="async", recovery="restart",
                      label="leto-run restart + DCP async")

# Order of the runs: the comparison that matters most first, so a run cut short by its time
# budget still has it.
FAULTED = (LETO_INPLACE, TORCHRUN_ASYNC, TORCHRUN_SYNC, LETO_RESTART)
BY_NAME = {s.name: s for s in (REFERENCE, *FAULTED)}


def train_args(preset: Preset, out: str) -> list[str]:
    """train.py options every system shares."""
    return ["--out", out, "--model", preset.model, *preset.model_args,
            "--batch-size", str(preset.batch_size), "--seed", "0"]


def argv(system: System, preset: Preset, run_dir: str, *, steps: int | None = None,
         interval: int | None = None, calibrate: bool = False) -> list[str]:
    """The launcher command line of `system` with its logs, step files and checkpoints under
    `run_dir` (unique per run: the harness also finds leftover processes by it)."""
    out = os.path.join(run_dir, "steps")
    ckpt_dir = os.path.join(run_dir, "ckpt")
    common = ["--standalone", "--nproc-per-node", str(preset.nproc),
              "--log-dir", os.path.join(run_dir, "logs")]
    restarts = preset.kills + 1 if system.mode == "dcp" else 0
    if system.launcher == LETO:
        cmd = launcher_cmd(LETO) + common + [
            "--no-status", "--events", os.path.join(run_dir, "events.jsonl"),
            "--recovery", system.recovery, "--max-restarts", str(restarts),
            "--tee", "3", *preset.leto_args]
    else:
        cmd = launcher_cmd(TORCHRUN) + common + ["--max-restarts", str(restarts), "--tee", "3"]
    cmd += [TRAIN, "--mode", system.mode, *train_args(preset, out)]
    if system.mode == "ref":
        cmd += ["--train-seconds", f"{preset.train_seconds:g}"]
        if calibrate:
            cmd += ["--calibrate", "--ckpt-dir", ckpt_dir]
    else:
        if not steps:
            raise ValueError(f"{system.name}: needs the step count from the reference run")
        cmd += ["--steps", str(steps)]
    if system.mode == "dcp":
        if not interval or interval < 1:
            raise ValueError(f"{system.name}: needs a checkpoint interval >= 1, got {interval}")
        cmd += ["--ckpt", system.ckpt, "--ckpt-every", str(interval), "--ckpt-dir", ckpt_dir]
    return cmd


def launcher_env(system: System, base: dict[str, str]) -> dict[str, str]:
    """`base` plus what `system`'s launcher needs to restart at all.

    torchrun (torch >= 2.4) hands its workers the rendezvous' TCPStore, shared across restart
    rounds with no per-attempt prefix, so a restarted group reads the dead workers' addresses
    from stale keys: gloo fails with "Connection refused", NCCL would read a stale unique id
    (pytorch issue #135712; it made 2 of 3 torchrun restarts fail here).  torch's own opt-out,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, gives every round a fresh store hosted by rank 0: the
    fix a torchrun user would apply.  leto-run gives every round a fresh store already."""
    env = dict(base)
    if system.launcher == TORCHRUN:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def environment(preset: Preset) -> dict[str, str]:
    """The launchers' environment: ours minus anything that would change their options behind
    our back (PET_*, LETO_*, TORCHELASTIC_*; the kernel build cache LETO_EXT_* stays), the
    repository on PYTHONPATH (train.py imports leto_runtime and examples/), unbuffered output."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("PET_", "LETO_", "TORCHELASTIC_")) or k.startswith("LETO_EXT_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in
                                                  env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    if preset.nproc > 1:
        # What both launchers would set (with a warning) for several ranks on one node.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
