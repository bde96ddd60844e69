"""Resilient Memory Pool client: retained state that survives the trainer (docs/MEMORY.md).

    from leto_runtime.rmp import RmpClient, recover
    c = RmpClient()                                   # LETO_SM_SOCKET (Context.sm_socket)
    w = c.retain("model.params", nbytes, dtype="float32", shape=[n])   # first: create; later: attach
    t = w.tensor()                                    # zero-copy torch view
    c.refresh()                                       # a shadow that attached while it waited:
                                                      # catch up at promotion (changed pages only)
    loc, rep = recover(c)                             # after a failure: localize, remap, rebuild

Modules: `protocol` (wire format, typed errors), `client`, `mapping` (VA ranges on GPU/host),
`tensors` (views and their liveness), `reconstruct` (two-tier parity repair).
"""
import importlib

# Lazy (PEP 562): `from leto_runtime.wire import protocol` -- what the launcher's fd keeper needs --
# must not pay for the client, mapping and reconstruction modules at every `leto-run` start.
_EXPORTS = {
    "RmpClient": "client", "RetainedState": "retained", "Marks": "retained",
    "LocalizeReport": "retained", "FRESH_FILL": "client", "RmpError": "protocol",
    "RefreshReport": "retained",
    "reconstruct": "reconstruct", "recover": "reconstruct", "protect": "reconstruct",
    "ReconstructReport": "reconstruct", "Unrecoverable": "reconstruct",
    "NotRemapped": "reconstruct",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'leto_runtime.rmp' has no attribute {name!r}")
    return getattr(importlib.import_module(f"leto_runtime.rmp.{mod}"), name)
