"""The JSON of an RMP message header, parsed within limits (`protocol.loads` wraps this).

Role: a header is plain data of bounded shape -- containers nested at most `MAX_DEPTH` deep,
integers in int64, finite numbers, strict JSON (no NaN / Infinity).  Past those limits the
body is refused with `HeaderRefused`, naming what was wrong, instead of the parser's own
RecursionError (100k nested lists) or ValueError (an integer of more than 4300 digits), and
before a huge integer can overflow a C type further on.  Our own headers nest below 8 levels.

Calling contract: `loads(body)` returns the parsed value or raises `HeaderRefused` (a
ValueError); it never raises anything else for any byte string.
"""
from __future__ import annotations

import json
import re

MAX_DEPTH = 32                   # nesting of a header's containers
INT_LIMIT = 1 << 63              # integers lie in [-INT_LIMIT, INT_LIMIT)


class HeaderRefused(ValueError):
    """A header body that is not UTF-8 JSON within the limits (the message says which)."""


def _int(s: str) -> int:
    # checked on the digits first: int() of thousands of digits is slow, and refused by
    # Python only past 4300 digits
    if len(s) > 20 or not -INT_LIMIT <= (v := int(s)) < INT_LIMIT:
        raise HeaderRefused(f"integer {s[:24]}{'...' if len(s) > 24 else ''} ({len(s)} "
                            "characters) is outside int64")
    return v


def _float(s: str) -> float:
    v = float(s)
    if v in (float("inf"), float("-inf")):
        raise HeaderRefused(f"number {s[:24]} is not finite")
    return v


def _constant(s: str):
    raise HeaderRefused(f"{s} is not JSON")


_DIGITS = bytes.maketrans(b"0123456789", b"9" * 10)
_LONG = b"9" * 19                            # a run of 19 digits: the only way past int64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OPEN_CLOSE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")


def too_deep(body: bytes) -> bool:
    """Whether valid JSON `body` nests containers deeper than MAX_DEPTH, at C speed: strings
    removed, brackets kept (one kind), then one level of empty "[]" peeled per round."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return False
    s = _STRING.sub(b"", body).translate(_OPEN_CLOSE, _NOT_BRACKET)
    for _ in range(MAX_DEPTH):
        s = s.replace(b"[]", b"")
        if not s:
            return False
    return True


def loads(body: bytes):
    # The checks cost little on our own headers: the int hook runs only where a long digit
    # run exists, the depth check only past MAX_DEPTH brackets; floats are few.
    hooks = {"parse_int": _int} if _LONG in body.translate(_DIGITS) else {}
    try:
        v = json.loads(body.decode("utf-8"), parse_float=_float, parse_constant=_constant,
                       **hooks)
    except HeaderRefused:
        raise
    except RecursionError:
        raise HeaderRefused(f"it nests deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as e:      # JSONDecodeError is a ValueError
        raise HeaderRefused(f"not UTF-8 JSON: {str(e)[:200]}") from None
    if too_deep(body):
        raise HeaderRefused(f"it nests deeper than {MAX_DEPTH} levels")
    return v
