"""Upper bounds of every number a user can give Leto: options (CLI, YAML, environment) and the
fields of `--inject` specs.  The config (`leto_run.config`), the loader and the inject parser
read them from here, so a bound is stated once.

Why bounds at all: values past these pass a `>= 0` check and fail much later, after processes
started -- a timeout of 1e300 s overflows `timedelta` or epoll's millisecond integer the first
time the job waits on it, `--nproc-per-node 99999999999999999999` builds a list per worker.
Each bound is far above any real job and far below where anything overflows.

Contract: constants plus `small_int(text)`, the one parser of integers given as text (ASCII
digits only, bounded length), which raises ValueError with the problem.
"""
from __future__ import annotations

import re

# Timeouts, grace periods, intervals, injection delays: two weeks.  Every blocking wait in the
# launcher and the runtime accepts this (epoll's limit is about 24.8 days).
MAX_SECONDS = 14 * 24 * 3600
# The sliding window of the in-place recovery budget is arithmetic only, not a wait: a year.
MAX_WINDOW_SECONDS = 366 * 24 * 3600
MAX_NODES = 65536
MAX_NPROC_PER_NODE = 1024
MAX_WORLD_SIZE = MAX_NODES * MAX_NPROC_PER_NODE
# Counts of restarts, in-place recoveries, attempts and generations.
MAX_COUNT = 1_000_000
MAX_SCRUB_BUDGET = 0.5            # share of the step time: the scrub never takes most of it
MAX_PAGE_BYTES = 1 << 30
MAX_MIB = 1 << 24                 # device memory in MiB (16 TiB): beyond any device
MAX_STEP = 10 ** 12               # trainer steps (the runtime gathers them as int64)
MAX_GROUP_PAGES = 65535           # GF(2^16): no protection group holds more pages
MAX_INDEX = 2 ** 31 - 1           # protection-group and chunk numbers
# Integers given as text with more digits than this are refused before `int()`: Python's own
# refusal (past 4300 digits) comes with advice that does not apply here.
MAX_INT_DIGITS = 19

_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)


def small_int(text: str) -> int:
    """`"12"`, `"+3"`, `"-1"` -> int.  ASCII digits only (`int()` also takes other scripts'
    digits and `1_000`), at most MAX_INT_DIGITS of them; ValueError otherwise."""
    s = str(text).strip()
    if not _INT.fullmatch(s):
        raise ValueError(f"{text!r} is not an integer")
    if len(s.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"{text!r} is too large ({len(s.lstrip('+-'))} digits)")
    return int(s)


def seconds_text(x: float) -> str:
    """1209600 -> '1209600 (14 days)', for messages."""
    days = x / 86400
    return f"{x:g} ({days:g} days)" if days >= 1 else f"{x:g}"
