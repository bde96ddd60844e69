"""Authentication of the control values Leto processes act on: HMAC-SHA256 with the job's key.

Why: the job's stores are TCPStores, which any process that reaches their port may read and
write (another user of the node, over loopback).  Every value a Leto process writes there for
another Leto process to act on -- the go key that promotes a shadow, a HOF declaration, the keys
a generation's process group is formed through, the rank assignment and the worker store's
address in the rendezvous store, torch's rendezvous state -- carries a MAC over the key's name
and the value; readers verify it in constant time and never act on a value that does not verify.
Binding the name means a value cannot be replayed under another key (another rank, generation
or shadow epoch).  Nothing here is secret but the key: values are authenticated, not encrypted.

The key: 32 bytes, the agent's.  A single-node job draws a fresh one; agents of several nodes
derive it from a secret they share (`derive_job_key`, bound to the job's rendezvous id).  Workers
get it through the environment contract (`contract.LETO_JOB_KEY`, hex), never through a store.

API (pure functions; `leto_runtime.auth_store.AuthStore` applies them to a store, and this
module imports nothing heavy, so `Context.from_env` may use it):
    sign_value(key, name, payload) -> bytes       the stored form: tag | MAC | payload
    verify_value(key, name, value) -> payload     or raise ForgedControlKey
    mac_words(key, name, words) / verify_words    the same for a list of int64 (the agreement)
    derive_job_key(secret, job_id), key_from_hex(text), key_to_hex(key)

Not authenticated (see the docs' "Trust"): key existence (`check`, `wait`: a forged key wakes a
waiter, which then finds it does not verify), `add` counters and `delete_key` (a writer can
delay or stop the job, never make it act on a forged value).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

KEY_BYTES = 32
MAC_BYTES = 32
_TAG = b"\x00LC1"                  # a signed value; the NUL keeps it apart from any text value
_DOMAIN = b"leto-control/1\x00"
_KDF_DOMAIN = b"leto-job-key/1\x00"
_WORDS_DOMAIN = b"leto-words/1\x00"


class ForgedControlKey(Exception):
    """A value under `key` did not verify with the job's key: someone without it wrote it.

    Not a RuntimeError on purpose: torch's rendezvous turns those into "connection failed"."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"forged control value under {key!r}: {reason}")


def _mac(key: bytes, domain: bytes, name: str, payload: bytes) -> bytes:
    n = name.encode()
    # The name's length goes first, so no (name, payload) pair reads as another one.
    return hmac.new(key, domain + struct.pack(">I", len(n)) + n + payload, hashlib.sha256).digest()


def as_bytes(v) -> bytes:
    """A store value as bytes (torch passes bytes or str; C++ callers a list of ints)."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, list):
        return bytes(v)
    raise TypeError(f"a store value is bytes or str, not {type(v).__name__}")


def sign_value(key: bytes, name: str, payload: bytes | str) -> bytes:
    """The stored form of `payload` under key `name`: tag, MAC(name, payload), payload."""
    p = as_bytes(payload)
    return _TAG + _mac(key, _DOMAIN, name, p) + p


def verify_value(key: bytes, name: str, value: bytes | str) -> bytes:
    """The payload of a stored value, if its MAC verifies for `name`; else ForgedControlKey."""
    v = as_bytes(value)
    if len(v) < len(_TAG) + MAC_BYTES or not v.startswith(_TAG):
        raise ForgedControlKey(name, f"not signed ({len(v)} bytes without Leto's tag)")
    mac, payload = v[len(_TAG):len(_TAG) + MAC_BYTES], v[len(_TAG) + MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, _DOMAIN, name, payload)):
        raise ForgedControlKey(name, "its MAC does not verify with the job's key")
    return payload


def mac_words(key: bytes, name: str, words) -> list[int]:
    """MAC of a list of int64 under `name`, as four int64 (to travel in an int64 tensor)."""
    data = struct.pack(f">{len(words)}q", *[int(w) for w in words])
    return list(struct.unpack(">4q", _mac(key, _WORDS_DOMAIN, name, data)))


def verify_words(key: bytes, name: str, words, mac) -> None:
    want = struct.pack(">4q", *mac_words(key, name, words))
    got = struct.pack(">4q", *[int(m) for m in mac])
    if not hmac.compare_digest(want, got):
        raise ForgedControlKey(name, "its MAC does not verify with the job's key")


def derive_job_key(secret: bytes, job_id: str) -> bytes:
    """The key of job `job_id` from a secret the agents of every node share: another job id
    (another job of the same user) gets another key."""
    if len(secret) < KEY_BYTES:
        raise ValueError(f"the shared secret has {len(secret)} bytes; at least {KEY_BYTES} "
                         "are needed")
    return hmac.new(secret, _KDF_DOMAIN + job_id.encode(), hashlib.sha256).digest()


def key_to_hex(key: bytes) -> str:
    return bytes(key).hex()


def key_from_hex(text: str) -> bytes:
    """The key from its contract form; ValueError (naming the variable's rule) otherwise."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the job key must be {2 * KEY_BYTES} hex digits "
                         f"({KEY_BYTES} bytes), got {len(text.strip())} characters")
    return key
