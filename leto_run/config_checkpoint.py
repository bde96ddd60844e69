"""The `checkpoint` section of the job's config: periodic checkpoints and the fallback to them.

    checkpoint:
      dir: /ckpt/run7          # --checkpoint-dir   (unset: no checkpoints, no fallback)
      every: 500               # --checkpoint-every: STEPS, a DURATION (10m, 90s, 2h), or auto
      ff_mtbf: 6h              # --ff-mtbf: the non-HOF failure interval; `every: auto` (the
                               #   default when it is set) takes Young's interval from it
      keep: 2                  # --checkpoint-keep: complete checkpoints kept
      max_fallbacks: 3         # --max-fallbacks: checkpoint fallbacks before the job ends
      writer: auto             # --checkpoint-writer: auto (rank 0's shadow snapshots the
                               #   retained state while the active computes; the active
                               #   itself where no shadow serves), shadow (the same, but a
                               #   due checkpoint waits, bounded, for a shadow starting up) or
                               #   trainer (always the active)

A failure that in-place recovery cannot take (page losses beyond the tolerance, a state manager
gone for good, contradicting markers) falls back to the newest complete checkpoint of `dir`
(docs/CHECKPOINTS.md).  Every contradiction is a `ConfigError` (exit 2) here; whether `dir` can
be written is the preflight's (`leto_run.preflight`).

Calling contract: `CheckpointConfig(**values)` validates on construction; `every_steps`,
`every_s` and `ff_mtbf_s` are the resolved values the trainers get (LETO_CHECKPOINT_*).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from leto_run import limits as L
from leto_run.errors import ConfigError
from leto_run.inject_values import parse_duration



def _err(key: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"checkpoint.{key}", problem, fix)


def seconds(text: str) -> float | None:
    """`90s`, `10m`, `2h`, `1d`, `500ms` -> seconds (`parse_duration`, with its unit required
    here: a bare number of `every` is steps); None if `text` is no such duration."""
    if not re.search(r"[a-z]\s*$", text.strip()):
        return None
    try:
        return parse_duration(text)
    except ValueError:
        return None


WRITERS = ("auto", "shadow", "trainer")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: str | None = None          # STEPS | DURATION | auto
    ff_mtbf: str | None = None        # DURATION
    keep: int = 2
    max_fallbacks: int = 3
    writer: str = "auto"              # auto | trainer

    def __post_init__(self) -> None:
        if self.writer not in WRITERS:
            raise _err("writer", f"{self.writer!r} is not one of {', '.join(WRITERS)}",
                       "use auto (the shadow snapshots, no stall), shadow or trainer")
        ex = "e.g. --checkpoint-every 500 (steps), 10m (a duration) or auto (with --ff-mtbf)"
        if self.dir is not None and not str(self.dir).strip():
            raise _err("dir", "is empty", "give a directory, or leave it unset (no checkpoints)")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or not \
                1 <= self.keep <= L.MAX_COUNT:
            raise _err("keep", f"{self.keep!r} is not an integer 1..{L.MAX_COUNT}",
                       "keep at least the newest checkpoint, e.g. 2")
        if isinstance(self.max_fallbacks, bool) or not isinstance(self.max_fallbacks, int) or \
                not 0 <= self.max_fallbacks <= L.MAX_COUNT:
            raise _err("max_fallbacks", f"{self.max_fallbacks!r} is not an integer "
                       f"0..{L.MAX_COUNT}", "e.g. 3 (0: a failure in-place recovery cannot take "
                       "ends the job, exit 4)")
        if self.dir is None:
            for key in ("every", "ff_mtbf"):
                if getattr(self, key) is not None:
                    raise _err(key, "is set but checkpoint.dir is not (nothing would be written)",
                               "add --checkpoint-dir DIR, or drop it")
            return
        if self.every is None and self.ff_mtbf is None:
            raise _err("every", "is not set (and no --ff-mtbf to derive it from)",
                       "set " + ex)
        self._check_every(ex)
        mtbf = self.ff_mtbf_s
        if self.ff_mtbf is not None and (mtbf is None or not 0 < mtbf <= L.MAX_WINDOW_SECONDS):
            raise _err("ff_mtbf", f"{self.ff_mtbf!r} is not a duration > 0 (up to a year)",
                       "e.g. --ff-mtbf 6h (how often a failure that is not a HOF happens)")
        if self.mode == "auto" and self.ff_mtbf is None:
            raise _err("every", "is auto but --ff-mtbf is not set (Young's interval needs it)",
                       "add --ff-mtbf DURATION, or give --checkpoint-every STEPS|DURATION")
        if self.mode != "auto" and self.ff_mtbf is not None:
            raise _err("ff_mtbf", f"contradicts checkpoint.every={self.every!r} (an explicit "
                       "interval; --ff-mtbf derives one)", "drop one of the two, or use "
                       "--checkpoint-every auto")

    def _check_every(self, ex: str) -> None:
        e = self.every
        if e is None or e.strip() == "auto":
            return
        text = e.strip()
        if re.fullmatch(r"[0-9]+", text):
            try:
                n = L.small_int(text)
            except ValueError as err:
                raise _err("every", str(err), ex) from None
            if not 1 <= n <= L.MAX_STEP:
                raise _err("every", f"{e!r} steps: a checkpoint interval must be at least one "
                           "step", ex)
            return
        s = seconds(text)
        if s is None:
            raise _err("every", f"{e!r} is neither a number of steps, a duration nor auto", ex)
        if not 0 < s <= L.MAX_SECONDS:
            raise _err("every", f"{e!r} is not a duration > 0 (up to two weeks)", ex)

    @property
    def mode(self) -> str:
        """off | steps | time | auto"""
        if self.dir is None:
            return "off"
        e = (self.every or "auto").strip()
        if e == "auto":
            return "auto"
        return "steps" if re.fullmatch(r"[0-9]+", e) else "time"

    @property
    def every_steps(self) -> int:
        return int(self.every.strip()) if self.mode == "steps" else 0

    @property
    def every_s(self) -> float:
        return seconds(self.every) if self.mode == "time" else 0.0

    @property
    def ff_mtbf_s(self) -> float | None:
        return None if self.ff_mtbf is None else seconds(str(self.ff_mtbf))


def worker_env(cfg: CheckpointConfig, load: str | None) -> tuple[tuple[str, str], ...]:
    """The trainers' LETO_CHECKPOINT_* values (leto_runtime.context reads them); `load`: the
    complete checkpoint a fallback's attempt starts from."""
    from leto_runtime.wire import contract as K
    out: list[tuple[str, str]] = []
    if cfg.mode != "off":
        out += [(K.LETO_CHECKPOINT_DIR, str(cfg.dir)),
                (K.LETO_CHECKPOINT_EVERY_STEPS, str(cfg.every_steps)),
                (K.LETO_CHECKPOINT_EVERY_S, repr(float(cfg.every_s))),
                (K.LETO_CHECKPOINT_FF_MTBF_S, repr(float(cfg.ff_mtbf_s or 0.0))),
                (K.LETO_CHECKPOINT_KEEP, str(cfg.keep)),
                (K.LETO_CHECKPOINT_WRITER, cfg.writer)]
    if load:
        out.append((K.LETO_CHECKPOINT_LOAD, load))
    return tuple(out)
