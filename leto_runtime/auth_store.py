"""`AuthStore`: a `torch.distributed.Store` whose values carry the job's MAC
(`leto_runtime.control_auth`).

Role: Leto's processes reach the job's TCPStores through it wherever a value another process
wrote is acted on: the trainers' worker-store client (`promotion.worker_store`: go keys and the
keys a generation's process group is formed through), the agents' worker-store clients (go and
HOF keys), and the rendezvous stores the agents build (`leto_run.rendezvous`: torch's rendezvous
state, the rank assignment, the worker store's port).  torch calls it from C++ (process-group
formation, the rendezvous), so each method below is the Python side of a `c10d::Store` one.

Calling contract: `get`, `multi_get` and `compare_set` return payloads that verified; one that
does not calls `on_forged(key, reason)` (best effort, its errors are swallowed) and raises
`ForgedControlKey`, which passes through torch's C++ unchanged (the caller sees that type).
`compare_set(key, "", v)` means "set if absent", as for a TCPStore.  `check`, `wait`, `add`,
`delete_key` and `num_keys` are the inner store's (existence and counters are not
authenticated); `append` is refused.  Timeouts are the inner store's.  Keep a Python reference
to an AuthStore for as long as torch uses it (a PrefixStore over it, a process group formed
through it): torch's C++ side does not keep the Python object alive, and a call into a
collected one fails ("Not implemented").
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from leto_runtime.control_auth import (KEY_BYTES, ForgedControlKey, as_bytes, sign_value,
                                       verify_value)


class AuthStore(dist.Store):
    """See the module docstring.  `inner`: the store the signed values live in."""

    def __init__(self, inner: dist.Store, key: bytes, on_forged=None):
        super().__init__()
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"AuthStore needs a {KEY_BYTES}-byte key")
        self.inner, self._key, self._on_forged = inner, bytes(key), on_forged

    def __repr__(self) -> str:           # never the key
        return f"AuthStore({self.inner!r})"

    def _open(self, key: str, value) -> bytes:
        try:
            return verify_value(self._key, key, value)
        except ForgedControlKey as e:
            if self._on_forged is not None:
                try:
                    self._on_forged(key, e.reason)
                except Exception:       # the report is best effort; the refusal is not
                    pass
            raise

    def set(self, key: str, value) -> None:
        self.inner.set(key, sign_value(self._key, key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(key))

    def compare_set(self, key: str, expected, desired) -> bytes:
        exp = as_bytes(expected)
        exp_signed = sign_value(self._key, key, exp) if exp else b""
        out = self.inner.compare_set(key, exp_signed, sign_value(self._key, key, desired))
        return self._open(key, out)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get(keys))]

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, [sign_value(self._key, k, v) for k, v in zip(keys, values)])

    def append(self, key: str, value) -> None:
        raise NotImplementedError(f"append({key!r}) on an authenticated store: an appended "
                                  "value cannot carry one MAC")

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout

    def has_extended_api(self) -> bool:
        return False                 # callers use the plain operations above
