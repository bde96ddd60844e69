"""Resilient Memory Pool client: retained state that survives the trainer (DESIGN.md §5).

    from leto_runtime.rmp import RmpClient, recover
    c = RmpClient()                                   # LETO_SM_SOCKET (Context.sm_socket)
    w = c.retain("model.params", nbytes, dtype="float32", shape=[n])   # first: create; later: attach
    t = w.tensor()                                    # zero-copy torch view
    loc, rep = recover(c)                             # after a failure: localize, remap, rebuild

Modules: `protocol` (wire format, typed errors), `client`, `mapping` (VA ranges on GPU/host),
`tensors` (views and their liveness), `reconstruct` (two-tier parity repair).
"""
from leto_runtime.rmp.client import FRESH_FILL, LocalizeReport, Marks, RetainedState, RmpClient
from leto_runtime.rmp.protocol import RmpError
from leto_runtime.rmp.reconstruct import (NotRemapped, ReconstructReport, Unrecoverable, protect,
                                          reconstruct, recover)

__all__ = ["RmpClient", "RetainedState", "Marks", "LocalizeReport", "FRESH_FILL", "RmpError",
           "reconstruct", "recover", "protect", "ReconstructReport", "Unrecoverable", "NotRemapped"]
