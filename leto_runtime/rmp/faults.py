"""Fire an `--inject pages:...` spec at a slot's state manager.

Used by the agent (time-triggered specs; it is the state manager's parent, always allowed) and
by the runtime in the trainer (step-triggered specs; a registered trainer pid).

    report = fire_pages_spec(keeper.sm_socket, spec.to_json()["params"])
    events.emit("inject_pages", gen, rank=..., **report)      # what was destroyed, how emulated

Raises the typed
`leto_runtime.wire.protocol` errors (BadArgument for a group or page range that does not exist,
Disconnected if the state manager is gone); every call has `timeout`.
"""
from __future__ import annotations

from leto_runtime.wire.host_pages import PAGE_KEYS


def fire_pages_spec(sm_socket: str, params: dict, timeout: float = 10.0) -> dict:
    from leto_runtime.rmp.client import RmpClient   # lazy: the agent imports this module at start
    c = RmpClient(sm_socket, timeout=timeout, connect_timeout=timeout)
    try:
        rep = c.inject_pages(**{k: params[k] for k in PAGE_KEYS if k in params})
    finally:
        c.close(unmap=False)
    return {"pages": rep["pages"], "emulation": rep["emulation"], "tier": rep["tier"],
            "part": rep["part"]}
