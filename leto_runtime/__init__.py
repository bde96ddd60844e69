"""leto_runtime: what runs inside trainers started by `leto-run`.

Import it from ``train.py``.  Today's public surface:

- `heartbeat(step)` — one call per training step: hang detection with stack dumps, live step
  in the status view, and step-triggered failure injection;
- `done()` — the loop finished (what follows is not a hang);
- `Context.from_env()` — the job's identity (rank, world size, role, generation...).

`leto_runtime` never imports `leto_run`: the contract between them is `leto_runtime.contract`.
"""
from leto_runtime.context import Context, ContractError
from leto_runtime.heartbeat import done, heartbeat

__all__ = ["Context", "ContractError", "heartbeat", "done"]
