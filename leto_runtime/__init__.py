"""leto_runtime: what runs inside trainers started by `leto-run`.

Import it from ``train.py``.  Public surface:

- `init()` -> `Job`: in-place recovery for a training script (module `job`; README "Runtime
  API"): retained parameters, RMU-backed AdamW (`AdamWConfig`), the step loop;
- `heartbeat(step)` — one call per training step: hang detection with stack dumps, live step
  in the status view, and step-triggered failure injection;
- `done()` — the loop finished (what follows is not a hang);
- `Context.from_env()` — the job's identity (rank, world size, role, generation...).

`leto_runtime` never imports `leto_run`: the contract between them is `leto_runtime.wire.contract`.
"""
from leto_runtime.context import Context, ContractError
from leto_runtime.beats import done, heartbeat
from leto_runtime import exit_notice as _exit_notice

_exit_notice.arm()      # under leto-run: an abrupt death is seen as its exit begins

__all__ = ["Context", "ContractError", "heartbeat", "done", "init", "Job", "AdamWConfig"]


def __getattr__(name: str):
    # Lazy: scripts that only heartbeat must not pay for torch.distributed and the RMU.
    if name in ("init", "Job"):
        from leto_runtime import job
        return getattr(job, name)
    if name == "AdamWConfig":
        from leto_runtime.rmu.adamw import AdamWConfig
        return AdamWConfig
    raise AttributeError(f"module 'leto_runtime' has no attribute {name!r}")
