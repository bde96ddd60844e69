"""Converters of option values: a raw value (text from the environment or the command line, or a
YAML-native value) -> the config field's value.  One per kind of option; `leto_run.config_load`
names the converter of every option in its table.

Contract: each converter returns the value or raises ValueError whose text is the problem (the
loader adds the key, the source and the fix).  Types and syntax only: ranges are the config's.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from leto_run.config_values import parse_rdzv_conf, parse_std
from leto_run.limits import small_int

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# ---- converters: raw value (str from env/CLI, or a YAML-native value) -> field value ----------
def _type_error(raw, want: str) -> ValueError:
    return ValueError(f"expected {want}, got {type(raw).__name__} {raw!r}")


def conv_str(raw) -> str:
    if not isinstance(raw, str):
        raise _type_error(raw, "a string")
    return raw


def conv_opt_str(raw) -> str | None:
    """Paths and addresses: "" means unset, as in torchrun (`if not log_dir: mkdtemp()`)."""
    return None if raw is None or conv_str(raw).strip() == "" else raw


def conv_opt_str_or_int(raw) -> str | None:
    """STEPS|DURATION settings: YAML may say `100` (a number) or `"10m"`; "" means unset."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return conv_opt_str(raw)


def conv_str_or_int(raw) -> str:
    """nnodes / nproc_per_node / redirects: YAML may say `4` or `"1:4"`."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return conv_str(raw).strip()


def conv_int(raw) -> int:
    """Ranges are the config's; huge YAML ints pass here and are refused there."""
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise _type_error(raw, "an integer")
    return raw if isinstance(raw, int) else small_int(raw)


def conv_float(raw) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise _type_error(raw, "a number")
    if isinstance(raw, str) and "_" in raw:      # float() takes 1_0; nobody means it
        raise ValueError(f"{raw!r} is not a number")
    try:
        x = float(raw)
    except (ValueError, OverflowError):          # OverflowError: an int past 1e308
        raise ValueError(f"{raw!r} is not a finite number") from None
    if not math.isfinite(x):
        raise ValueError(f"{raw!r} is not a finite number")
    return x + 0.0                               # -0.0 -> 0.0: the same value everywhere


def conv_bool(raw) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"{raw!r} is not a boolean (use 1/0, true/false)")


def conv_status(raw) -> bool | None:
    if raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto"):
        return None
    return conv_bool(raw)


def _conv_list(raw, item: Callable[[Any], Any], split: Callable[[str], list[str]]) -> tuple:
    if isinstance(raw, str):
        return tuple(item(x) for x in split(raw))
    if isinstance(raw, (list, tuple)):
        return tuple(item(x) for x in raw)
    raise _type_error(raw, "a list or a comma-separated string")


def _commas(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def conv_signals(raw) -> tuple[str, ...]:
    return _conv_list(raw, lambda x: str(x).strip(), _commas)


def conv_ranks(raw) -> tuple[int, ...]:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return (raw,)
    if isinstance(raw, str) and not raw.strip():
        return ()      # torchrun: an empty filter shows every rank

    def rank(x):
        if isinstance(x, int) and not isinstance(x, bool):
            return x
        if isinstance(x, str) and x.strip().isascii() and x.strip().isdigit():
            return small_int(x)
        raise ValueError(f"{x!r} is not a local rank (an integer >= 0)")
    return _conv_list(raw, rank, lambda s: [x.strip() for x in s.split(",")])


def conv_filters(raw) -> tuple[str, ...]:
    """torchrun's comma list where `,,` escapes a literal comma."""
    def split(s: str) -> list[str]:
        ph = "\0"
        return [x.replace(ph, ",") for x in s.replace(",,", ph).split(",") if x]
    return _conv_list(raw, conv_str, split)


def conv_std(raw) -> str:
    if isinstance(raw, dict):   # YAML: {0: 1, 1: 2}
        raw = ",".join(f"{conv_int(k)}:{conv_int(v)}" for k, v in raw.items())
    s = conv_str_or_int(raw)
    parse_std(s)
    return s


def conv_conf(raw) -> tuple[tuple[str, str], ...]:
    if isinstance(raw, dict):   # YAML: {join_timeout: 900}
        out = []
        for k, v in raw.items():
            if isinstance(v, (dict, list, bool)) or v is None:
                raise ValueError(f"{k}: {v!r} is not a scalar")
            out.append((str(k), str(v)))
        return tuple(out)
    return parse_rdzv_conf(conv_str(raw))


def conv_script_args(raw) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)):
        raise _type_error(raw, "a list of strings")
    for i, a in enumerate(raw):
        if not isinstance(a, str):
            raise ValueError(f"item {i} is {type(a).__name__} {a!r}, not a string (quote it: "
                             f"'{a}')")
    return tuple(raw)
