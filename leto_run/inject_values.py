"""Value parsers of `--inject` fields (`leto_run.inject` re-exports the public ones): signals,
durations, integers, points and choices.

Contract: each parser takes the text of one field and returns its value or raises ValueError
whose text is the problem (the spec parser adds the spec and the fix).
"""
from __future__ import annotations

import difflib
import math
import re
import signal as _signal
from typing import Callable

from leto_run import limits as L
from leto_runtime.wire.contract import INJECT_POINTS

ROLES = ("active",)          # `shadow` arrives with shadow trainers
# Signals whose default action is to do nothing: injecting one would not fail the process.
_HARMLESS = frozenset({"SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH"})


def signal_number(name: str | int) -> int:
    """`SIGTERM` / `term` / `15` / 15 -> 15.  Raises ValueError for anything that is not a signal."""
    if isinstance(name, bool):
        raise ValueError(f"{name!r} is not a signal")
    s = str(name).strip().upper()
    if isinstance(name, int) or (s.isascii() and s.isdigit()):
        if len(s) > 4:
            raise ValueError(f"{name!r} is not a signal number on this system")
        n = int(s)
        # valid_signals() includes the unnamed real-time signals, which can be delivered too
        if n not in {int(x) for x in _signal.valid_signals()}:
            raise ValueError(f"{name!r} is not a signal number on this system")
        return n
    if not s.startswith("SIG"):
        s = "SIG" + s
    try:
        return int(_signal.Signals[s])
    except KeyError:
        raise ValueError(f"{name!r} is not a signal name") from None


def signal_name(num: int) -> str:
    """15 -> 'SIGTERM'; a number without a name (real-time signals) -> its digits."""
    try:
        return _signal.Signals(num).name
    except ValueError:
        return str(num)


# ---- value parsers (ValueError carries the problem text) ------------------------------------
def _nonneg_int(v: str) -> int:
    if not re.fullmatch(r"[0-9]+", v):
        raise ValueError(f"{v!r} is not a non-negative integer")
    return L.small_int(v)


_DURATION = re.compile(r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>ms|s|min|m|h|d)?")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(v: str) -> float:
    """`5s`, `500ms`, `2.5` (seconds), `1m` / `1min`, `2h`, `1d` -> seconds as float."""
    m = _DURATION.fullmatch(v.strip())
    if not m:
        raise ValueError(f"{v!r} is not a duration (use e.g. 5s, 500ms, 2.5, 1m)")
    x = float(m["num"]) * _UNITS[m["unit"]]
    if not math.isfinite(x):
        raise ValueError(f"{v!r} is not a finite duration")
    return x


def _role(v: str) -> str:
    if v not in ROLES:
        raise ValueError(f"role {v!r} is not supported (allowed: {', '.join(ROLES)})")
    return v


def _fmt_seconds(x: float) -> str:
    s = repr(float(x))
    return (s[:-2] if s.endswith(".0") else s) + "s"


def _inject_signal(v: str) -> int:
    n = signal_number(v)  # ValueError for unknown names
    if n == 0 or signal_name(n) in _HARMLESS:
        raise ValueError(f"{v!r} does not stop or fail a process by default")
    return n


def _positive_int(v: str) -> int:
    n = _nonneg_int(v)
    if n < 1:
        raise ValueError(f"{v!r} must be >= 1")
    return n


def _point(v: str) -> str:
    if v not in INJECT_POINTS:
        close = difflib.get_close_matches(v, INJECT_POINTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{v!r} is not an injection point{hint}")
    return v


def _flag01(v: str) -> int:
    if v not in ("0", "1"):
        raise ValueError(f"{v!r} is not 0 or 1")
    return int(v)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v.lower() not in allowed:
            raise ValueError(f"{v!r} is not one of {', '.join(allowed)}")
        return v.lower()
    return parse
