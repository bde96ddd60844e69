"""Parsers of option values given as text, shared by the config (`leto_run.config`, which
re-exports them) and the loader.  Syntax only: ranges and cross-checks are the config's.

Contract: each function returns the parsed value or raises ValueError with the problem.
"""
from __future__ import annotations

import re

from leto_run import limits as L
from leto_run.inject import signal_name, signal_number

_STD_HELP = "0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank like 0:1,1:2"


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """`"2"` -> (2, 2); `"1:4"` -> (1, 4).  Syntax only; ranges are checked by LaunchConfig."""
    m = re.fullmatch(r"\s*(-?[0-9]+)\s*(?::\s*(-?[0-9]+)\s*)?", str(nnodes))
    if not m:
        raise ValueError(f"nnodes {nnodes!r} is not N or MIN:MAX")
    lo = L.small_int(m[1])
    return lo, L.small_int(m[2]) if m[2] is not None else lo


def parse_std(spec: str) -> int | dict[int, int]:
    """torchrun's `--redirects`/`--tee` value: `"3"` -> 3; `"0:1,1:2"` -> {0: 1, 1: 2}."""
    s = str(spec).strip()
    if re.fullmatch(r"[0-3]", s):
        return int(s)
    if re.fullmatch(r"[0-9]+:[0-3](,[0-9]+:[0-3])*", s):
        out: dict[int, int] = {}
        for item in s.split(","):
            r, v = item.split(":")
            rank = L.small_int(r)
            if rank >= L.MAX_NPROC_PER_NODE:
                raise ValueError(f"local rank {r} is above {L.MAX_NPROC_PER_NODE - 1}")
            if rank in out:
                raise ValueError(f"local rank {r} appears twice in {spec!r}")
            out[rank] = int(v)
        return out
    raise ValueError(f"{spec!r} is not a stream selector")


def parse_rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` -> (("k", "v"), ("k2", "v2")), as torchrun's `_parse_rendezvous_config`."""
    out: list[tuple[str, str]] = []
    for kv in filter(None, (p.strip() for p in str(text).strip().split(","))):
        k, _, v = kv.partition("=")
        if not k.strip() or not v.strip():
            raise ValueError(f"{kv!r} is not key=value")
        out.append((k.strip(), v.strip()))
    return tuple(out)


def parse_endpoint(endpoint: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[::1]:port` -> (host, port or None)."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+)(?::(\d{1,5}))?", endpoint.strip())
    if not m:
        raise ValueError(f"{endpoint!r} is not HOST or HOST:PORT")
    port = int(m[2]) if m[2] is not None else None
    if port is not None and port > 65535:
        raise ValueError(f"port {port} in {endpoint!r} is above 65535")
    return m[1], port


def normalize_signal(name: str) -> str:
    """`term` / `SIGTERM` / `15` -> `SIGTERM`; ValueError for non-signals."""
    return signal_name(signal_number(name))
