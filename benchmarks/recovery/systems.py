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
  leto-ckpt            leto-run in place + --checkpoint-dir/--checkpoint-every K (its own
                       checkpoint fallback for FFs), train.py --mode leto --opt torch; for
                       mixed HOF/FF schedules (mixed.py: what an FF is for each system)
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
    checkpoint: bool = False   # leto-run's own checkpoints + fallback (FFs as page losses)


REFERENCE = System("reference", TORCHRUN, "ref", label="fault-free reference (torchrun, no FT)")
LETO_INPLACE = System("leto-inplace", LETO, "leto", recovery="inplace",
                      label="leto-run in place")
TORCHRUN_ASYNC = System("torchrun-dcp-async", TORCHRUN, "dcp", ckpt="async",
                        label="torchrun + DCP async")
TORCHRUN_SYNC = System("torchrun-dcp-sync", TORCHRUN, "dcp", ckpt="sync",
                       label="torchrun + DCP sync")
LETO_RESTART = System("leto-restart-dcp", LETO, "dcp", ckpt="async", recovery="restart",
                      label="leto-run restart + DCP async")

LETO_CKPT = System("leto-ckpt", LETO, "leto", recovery="inplace", checkpoint=True,
                   label="leto-run in place + checkpoint fallback")

# Order of the runs: the comparison that matters most first, so a run cut short by its time
# budget still has it.  HOF-only schedules (the default) and mixed ones (--mixed).
FAULTED = (LETO_INPLACE, TORCHRUN_ASYNC, TORCHRUN_SYNC, LETO_RESTART)
MIXED_DEFAULT = (LETO_CKPT, TORCHRUN_ASYNC)
ALL_FAULTED = (*FAULTED, LETO_CKPT)
BY_NAME = {s.name: s for s in (REFERENCE, *ALL_FAULTED)}


def schedule_problem(system: System, kinds: list[str]) -> str | None:
    """Why `system` cannot run a schedule of these failure kinds, or None."""
    if system.checkpoint and "ff" not in kinds:
        return (f"{system.name} checkpoints for FFs only (Young's interval at the FF-only MTBF): "
                "it needs a schedule with FFs (--mixed)")
    if system.launcher == LETO and system.recovery == "inplace" and not system.checkpoint \
            and "ff" in kinds:
        return (f"{system.name} has no checkpoint to fall back to, so an FF would end its job: "
                "use leto-ckpt for mixed schedules")
    return None


def train_args(preset: Preset, out: str) -> list[str]:
    """train.py options every system shares."""
    return ["--out", out, "--model", preset.model, *preset.model_args,
            "--batch-size", str(preset.batch_size), "--seed", "0"]


def argv(system: System, preset: Preset, run_dir: str, *, steps: int | None = None,
         interval: int | None = None, calibrate: bool = False,
         injects: tuple = ()) -> list[str]:
    """The launcher command line of `system` with its logs, step files and checkpoints under
    `run_dir` (unique per run: the harness also finds leftover processes by it).  `injects`:
    leto-run `--inject` specs (leto-ckpt's FFs, mixed.ff_specs)."""
    out = os.path.join(run_dir, "steps")
    ckpt_dir = os.path.join(run_dir, "ckpt")
    common = ["--standalone", "--nproc-per-node", str(preset.nproc),
              "--log-dir", os.path.join(run_dir, "logs")]
    restarts = preset.kills + 1 if system.mode == "dcp" else 0
    if system.launcher == LETO:
        cmd = launcher_cmd(LETO) + common + [
            "--no-status", "--events", os.path.join(run_dir, "events.jsonl"),
            "--recovery", system.recovery, "--max-restarts", str(restarts),
            "--tee", "3", *preset.leto_args, *_checkpoint_args(system, ckpt_dir, interval, injects)]
    else:
        cmd = launcher_cmd(TORCHRUN) + common + ["--max-restarts", str(restarts), "--tee", "3"]
    cmd += [TRAIN, "--mode", system.mode, *train_args(preset, out)]
    if system.checkpoint:
        cmd += ["--opt", "torch"]        # job.adamw has no torch.optim state to checkpoint
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


def _checkpoint_args(system: System, ckpt_dir: str, interval: int | None,
                     injects: tuple) -> list[str]:
    """leto-ckpt's checkpoint options and its FFs' injections (nothing for other systems)."""
    if not system.checkpoint:
        if injects:
            raise ValueError(f"{system.name}: injections are leto-ckpt's FFs only")
        return []
    if not interval or interval < 1:
        raise ValueError(f"{system.name}: needs a checkpoint interval >= 1, got {interval}")
    # Every FF of the schedule falls back once: leto-run's default of 3 must not end the job.
    out = ["--checkpoint-dir", ckpt_dir, "--checkpoint-every", str(interval),
           "--max-fallbacks", str(max(3, len(injects)))]
    for spec in injects:
        out += ["--inject", spec]
    return out


def launcher_env(system: System, base: dict[str, str], leto_env: tuple = ()) -> dict[str, str]:
    """`base` plus what `system`'s launcher needs to restart at all, and for leto-run the
    runtime knobs the run asked for (`leto_env`: (NAME, VALUE) pairs, `--leto-env`).

    torchrun (torch >= 2.4) hands its workers the rendezvous' TCPStore, shared across restart
    rounds with no per-attempt prefix, so a restarted group reads the dead workers' addresses
    from stale keys: gloo fails with "Connection refused", NCCL would read a stale unique id
    (pytorch issue #135712; it made 2 of 3 torchrun restarts fail here).  torch's own opt-out,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, gives every round a fresh store hosted by rank 0: the
    fix a torchrun user would apply.  leto-run gives every round a fresh store already."""
    env = dict(base)
    if system.launcher == TORCHRUN:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if system.launcher == LETO:
        env.update(dict(leto_env))
    return env


def leto_knob(spec: str) -> tuple[str, str]:
    """`NAME=VALUE` of `--leto-env` as a pair, NAME a knob of the runtime's env contract
    (leto_runtime.wire.settings.KNOBS: the harness strips every other LETO_* variable, so a
    knob set in its own environment would be silently dropped); ValueError names the problem."""
    from leto_runtime.wire import settings
    name, sep, value = spec.partition("=")
    known = sorted(env for env, _, _ in settings.KNOBS.values() if env.startswith("LETO_"))
    if not sep or not name:
        raise ValueError(f"--leto-env {spec!r}: want NAME=VALUE, e.g. LETO_WARMUP_MIB=4096")
    if name not in known:
        raise ValueError(f"--leto-env {spec!r}: {name} is not a runtime knob; one of "
                         f"{', '.join(known)}")
    return name, value


def environment(preset: Preset) -> dict[str, str]:
    """The launchers' environment: ours minus anything that would change their options behind
    our back (PET_*, LETO_*, TORCHELASTIC_*; the kernel build cache LETO_EXT_* stays: a runtime
    knob is set with `--leto-env`, which the report records), the
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
