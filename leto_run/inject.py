"""Failure-injection specs: parse, validate and serialize `--inject` / YAML `inject:` entries.

Grammar (one spec)::

    KIND[=ARG]:key=value:key=value...

    kill:rank=1:after=5s                 SIGKILL global rank 1, 5 s after the attempt's workers started
    hang:rank=0:step=20                  rank 0 blocks when the trainer reaches step 20 (runtime does it)
    signal=SIGSEGV:rank=3:after=500ms:attempt=1

Keys: `rank` (required, global rank), exactly one trigger -- `after` (seconds: `5s`, `500ms`,
`2.5`, `1m`) or `step` (fired by `leto_runtime` inside the trainer) -- plus optional `attempt`
(restart attempt it applies to; default 0, so an injection fires once and not again after the
restart it causes), `gen` (in-place recovery generation it fires in; default 0: a spec fires in
the generation it names, so a HOF does not re-fire it in the promoted trainer) and `role`
(`active` only for now).

In-place recovery keys (docs/ARCHITECTURE.md, "One in-place recovery, end to end"; docs/RMU.md,
"Fault points"):

    kill:rank=1:step=5:gen=1                  kill rank 1 at step 5 of generation 1 (after a HOF)
    kill:rank=0:step=3:at=rmu.update:group=0:chunk=2:garbage=1
                                              inside the RMU update of group 0, chunk 2 of step 3,
                                              after writing garbage into the chunk
    hang:rank=0:step=4:at=sync                block at the global synchronization of step 4

`at=POINT` (kill, signal, hang, pages; one of `leto_runtime.wire.contract.INJECT_POINTS`, default
`step`) names where inside a step a step-triggered spec fires; it needs `step=`.  `group=G`,
`chunk=C` and `garbage=1` (kill, signal) narrow an `rmu.*` point to one protection group / chunk
and make the runtime overwrite the chunk with garbage before the signal; they need an `rmu.*`
point that passes them (`CHUNK_POINTS`, `GROUP_POINTS`, `GARBAGE_POINTS`): anything else could
never fire, and is refused.  A time-triggered spec with `gen=N` fires `after` seconds after generation N started (its
promotion time for N > 0).

Who fires what: time-triggered specs are fired by the agent; step-triggered ones are shipped in
`LETO_INJECT_PLAN` (JSON list of `to_json()`) to every trainer of the rank -- active *and*
shadow -- of the matching `attempt`, and the runtime fires those whose `gen` equals its
generation, at the point `at`.  The runtime reads the top-level JSON fields `kind`, `step`,
`gen`, `at`, `group`, `chunk`, `garbage`, `signal` and `text`.

Kinds live in a registry (`KINDS`): each names its argument, its default signal and any extra
keys it accepts.  A later kind (e.g. `pages:rank=0:group=3:count=16:tier=device`) is one more
`KindRule` with `extra_keys`; its values land in `InjectSpec.params`, so `InjectSpec` keeps its
shape.

Calling contract: `parse_inject` (text) and `parse_inject_mapping` (YAML mapping) return a valid,
frozen `InjectSpec` or raise `ConfigError`.  `InjectSpec.to_json()` is the wire form that
`leto_runtime` reads (plain JSON types; `kind` as its string), so the runtime never imports
`leto_run`.  Every number is bounded (`leto_run.limits`).  Checks that need the job (rank <
world size, the recovery mode, the geometry) are `leto_run.inject_checks`', run by `JobConfig`.
"""
from __future__ import annotations

import difflib
import enum
import math
import signal as _signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from leto_run import limits as L
from leto_run.errors import ConfigError
from leto_run.inject_values import (ROLES, _choice, _flag01, _fmt_seconds, _inject_signal,  # noqa: F401
                                    _nonneg_int, _point, _positive_int, _role, parse_duration,
                                    signal_name, signal_number)
from leto_runtime.wire.contract import INJECT_POINTS

GRAMMAR = ("KIND[=ARG]:rank=R:(after=T|step=N)[:attempt=A][:gen=G][:at=POINT][:role=active]"
           "[:group=G:chunk=C:garbage=1]")
EXAMPLE = "kill:rank=1:after=5s"
# Where the runtime passes which coordinates (the `inject` calls of leto_runtime/rmu/updater.py
# and lookahead.py): a chunk inside a chunk transaction and in the wait after it, a group at
# every rmu.* point but the step's end, the garbage callback at the two points that write into
# the chunk.  A key the point never passes would never match, so the spec would never fire.
CHUNK_POINTS = ("rmu.undo", "rmu.update", "rmu.delta", "rmu.commit", "rmu.lookahead")
GROUP_POINTS = CHUNK_POINTS + ("rmu.load", "rmu.writeback", "rmu.tier2", "rmu.writeback.drop")
GARBAGE_POINTS = ("rmu.update", "rmu.delta")


class InjectKind(str, enum.Enum):
    KILL = "kill"
    HANG = "hang"
    SIGNAL = "signal"
    PAGES = "pages"
    PREINIT = "preinit"


# ---- the kind registry --------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyRule:
    """One `key=value` field: its parser (raises ValueError) and the fix shown when it fails."""

    parse: Callable[[str], Any]
    fix: str


@dataclass(frozen=True)
class KindRule:
    """What one kind accepts.  `arg` names its `=ARG` (None: takes none)."""

    kind: InjectKind
    summary: str
    default_signal: int
    arg: str | None = None
    parse_arg: Callable[[str], int] | None = None
    extra_keys: Mapping[str, "KeyRule"] = field(default_factory=dict)
    required_extra: frozenset[str] = frozenset()


# `pages`: emulated memory faults in the rank's Resilient Memory Pool (leto_run/state_manager):
# `count` consecutive pages from `first` of protection group `group` (default: the lowest) are
# destroyed and made unavailable -- data pages for tier=device, tier-1 parity (`part=p1`, the
# default there) or `part=p2` / host-state `part=data` for tier=host.  Cross-field checks (parity
# lives in host memory; the pages must exist) are made by the state manager when it fires.
PAGES_KEYS: dict[str, KeyRule] = {
    "tier": KeyRule(_choice("device", "host"), "tier=device (GPU data pages) or tier=host"),
    "group": KeyRule(_nonneg_int, "group=G with G a protection group number >= 0"),
    "count": KeyRule(_positive_int, "count=N with N >= 1 (e.g. 16 for a DRAM row)"),
    "first": KeyRule(_nonneg_int, "first=P, the first page's index within the group (>= 0)"),
    "part": KeyRule(_choice("data", "p1", "p2"), "part=data, p1 (tier-1 parity) or p2 (tier-2)"),
}

# kill / signal at an RMU point: which protection group and chunk, and whether the runtime
# writes garbage into the chunk before the signal (a torn in-place update).
RMU_KEYS: dict[str, KeyRule] = {
    "group": KeyRule(_nonneg_int, "group=G with G a protection group number >= 0"),
    "chunk": KeyRule(_nonneg_int, "chunk=C with C a chunk index >= 0 within the group"),
    "garbage": KeyRule(_flag01, "garbage=1 (overwrite the chunk before the signal) or 0"),
}
_AT_RMU = (InjectKind.KILL, InjectKind.SIGNAL)
def _level(v: str) -> str:
    if v.upper() not in ("L1", "L2", "L3"):
        raise ValueError(f"{v!r} is not one of L1, L2, L3")
    return v.upper()


# `preinit`: the level the controller pins the shadows to from then on (docs/PREINIT.md).
PREINIT_KEYS: dict[str, KeyRule] = {
    "level": KeyRule(_level, "level=L1, L2 or L3"),
}

KINDS: dict[str, KindRule] = {
    r.kind.value: r
    for r in (
        KindRule(InjectKind.KILL, "SIGKILL the rank's process", int(_signal.SIGKILL),
                 extra_keys=RMU_KEYS),
        KindRule(InjectKind.HANG, "the rank blocks (stops heartbeating) without exiting", 0),
        KindRule(InjectKind.SIGNAL, "deliver a signal (name or number) to the rank's process", 0,
                 arg="signal", parse_arg=_inject_signal, extra_keys=RMU_KEYS),
        KindRule(InjectKind.PAGES, "destroy retained memory pages and make them unavailable", 0,
                 extra_keys=PAGES_KEYS, required_extra=frozenset({"tier"})),
        KindRule(InjectKind.PREINIT, "move the shadows to preinit level `level` (the agent "
                 "relaunches them; the active waits in that step until they are ready)", 0,
                 extra_keys=PREINIT_KEYS, required_extra=frozenset({"level"})),
    )
}
# Keys every kind accepts; `rank` is required and exactly one of TRIGGERS must be given.
COMMON_KEYS: dict[str, KeyRule] = {
    "rank": KeyRule(_nonneg_int, "rank=R with R the global rank, an integer >= 0"),
    "after": KeyRule(parse_duration, "after=5s, after=500ms or after=2.5 (seconds)"),
    "step": KeyRule(_nonneg_int, "step=N with N an integer >= 0"),
    "attempt": KeyRule(_nonneg_int, "attempt=N with N >= 0 (0 = the first launch)"),
    "gen": KeyRule(_nonneg_int, "gen=N with N >= 0 (the in-place recovery generation)"),
    "at": KeyRule(_point, f"at=POINT with POINT one of {', '.join(INJECT_POINTS)}"),
    "role": KeyRule(_role, "role=active (shadow roles come with shadow trainers)"),
}
TRIGGERS = ("after", "step")
# Bounds of the kind-specific integers: page numbers within a protection group, group and chunk
# numbers.
PARAM_MAX = {"count": L.MAX_GROUP_PAGES, "first": L.MAX_GROUP_PAGES - 1, "group": L.MAX_INDEX,
             "chunk": L.MAX_INDEX}


@dataclass(frozen=True)
class InjectSpec:
    """One validated injection.  `text` is always recomputed as the canonical spec."""

    kind: InjectKind
    rank: int
    after_s: float | None = None      # time trigger: seconds after the attempt's workers started
    step: int | None = None           # step trigger: fired by leto_runtime at that step
    signal: int = 9                   # signal number delivered (kill: SIGKILL; hang: 0; signal: given)
    attempt: int = 0
    role: str = "active"
    text: str = ""                    # canonical spec text, for messages and the event log
    params: tuple[tuple[str, Any], ...] = ()   # kind-specific extra keys (sorted)
    gen: int = 0                      # in-place recovery generation it fires in
    at: str = "step"                  # where inside a step it fires (contract.INJECT_POINTS)

    def __post_init__(self) -> None:
        try:
            kind = InjectKind(self.kind)
        except ValueError:
            raise self._err(f"unknown kind {self.kind!r}",
                            f"use one of {', '.join(KINDS)}") from None
        object.__setattr__(self, "kind", kind)
        rule = KINDS[kind.value]
        for name, top in (("rank", L.MAX_WORLD_SIZE - 1), ("attempt", L.MAX_COUNT),
                          ("gen", L.MAX_COUNT), ("step", L.MAX_STEP)):
            v = getattr(self, name)
            if v is None and name == "step":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise self._err(f"{name}={v!r} must be an integer 0..{top}", f"e.g. {name}=0")
        if (self.after_s is None) == (self.step is None):
            raise self._err("needs exactly one trigger, got "
                            + ("both after= and step=" if self.after_s is not None else "none"),
                            "add after=5s (time after start) or step=20 (trainer step), not both")
        if self.after_s is not None:
            a = self.after_s
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) \
                    or not 0 <= a <= L.MAX_SECONDS:
                raise self._err(f"after={a!r} must be a number of seconds 0.."
                                f"{L.seconds_text(L.MAX_SECONDS)}", "e.g. after=5s")
            object.__setattr__(self, "after_s", float(a) + 0.0)
        if self.role not in ROLES:
            raise self._err(f"role={self.role!r} is not supported", f"use role={ROLES[0]}")
        if rule.parse_arg is None:
            # The field default (9) stands for "not given": arg-less kinds get their own signal.
            if self.signal == 9:
                object.__setattr__(self, "signal", rule.default_signal)
            if self.signal != rule.default_signal:
                raise self._err(f"kind {kind.value} always delivers signal {rule.default_signal}, "
                                f"got {self.signal}", "use signal=N to deliver another signal")
        else:
            try:
                rule.parse_arg(str(self.signal))
            except ValueError as e:
                raise self._err(str(e), "e.g. signal=SIGSEGV, SIGABRT, SIGBUS or 11") from None
        unknown = {k for k, _ in self.params} - set(rule.extra_keys)
        missing = rule.required_extra - {k for k, _ in self.params}
        if unknown or missing:
            raise self._err(f"parameters {sorted(unknown)} not accepted / {sorted(missing)} missing "
                            f"for kind {kind.value}", f"see {GRAMMAR}")
        object.__setattr__(self, "params", tuple(sorted(
            (k, self._param(k, v, rule.extra_keys[k])) for k, v in self.params)))
        self._check_point()
        object.__setattr__(self, "text", self._canonical())

    def _param(self, key: str, value, rule: KeyRule):
        """One kind-specific value, parsed again (a spec from JSON is not trusted) and bounded."""
        try:
            if isinstance(value, bool):
                raise ValueError(f"{value!r} is not a value for {key}")
            v = rule.parse(str(value))
        except ValueError as e:
            raise self._err(f"{key}: {e}", rule.fix) from None
        top = PARAM_MAX.get(key)
        if top is not None and v > top:
            raise self._err(f"{key}={v} is above {top}", rule.fix + f", at most {top}")
        return v

    def _check_point(self) -> None:
        if self.at not in INJECT_POINTS:
            raise self._err(f"at={self.at!r} is not an injection point",
                            f"use one of {', '.join(INJECT_POINTS)}")
        if self.at != "step" and self.step is None:
            raise self._err(f"at={self.at} needs a step trigger (the runtime fires it)",
                            f"use step=N with at={self.at}, or drop at=")
        rmu = ({k for k, _ in self.params if k in RMU_KEYS}
               if self.kind in _AT_RMU else set())
        if rmu and not self.at.startswith("rmu."):
            raise self._err(f"{', '.join(sorted(rmu))} only mean something at an rmu.* point "
                            f"(got at={self.at})",
                            "add at=rmu.update (or another rmu.* point), or drop them")
        params = dict(self.params)
        for key, points in (("chunk", CHUNK_POINTS), ("group", GROUP_POINTS)):
            if key in rmu and self.at not in points:
                raise self._err(f"{key}= never matches at {self.at} (the runtime names no "
                                f"{key} there), so this never fires",
                                f"use {key}= with at= one of {', '.join(points)}, or drop it")
        if params.get("garbage") and self.kind != InjectKind.PAGES and \
                self.at not in GARBAGE_POINTS:
            raise self._err(f"garbage=1 does nothing at {self.at}: only "
                            f"{' and '.join(GARBAGE_POINTS)} write into a chunk",
                            f"use at={GARBAGE_POINTS[0]}, or drop garbage=1")
        if self.kind == InjectKind.PAGES and params.get("tier") == "device" and \
                params.get("part") in ("p1", "p2"):
            raise self._err(f"part={params['part']} is parity, which lives in host memory, not "
                            "on the device", f"use tier=host:part={params['part']}")

    def _err(self, problem: str, fix: str) -> ConfigError:
        return ConfigError("inject", problem, fix)

    def _canonical(self) -> str:
        head = self.kind.value
        if KINDS[head].arg:
            head += "=" + signal_name(self.signal)
        parts = [head, f"rank={self.rank}"]
        parts.append(f"after={_fmt_seconds(self.after_s)}" if self.after_s is not None
                     else f"step={self.step}")
        if self.attempt:
            parts.append(f"attempt={self.attempt}")
        if self.gen:
            parts.append(f"gen={self.gen}")
        if self.at != "step":
            parts.append(f"at={self.at}")
        if self.role != "active":
            parts.append(f"role={self.role}")
        parts += [f"{k}={v}" for k, v in self.params]
        return ":".join(parts)

    @property
    def trigger(self) -> str:
        """`after` or `step`: who fires it (agent timer vs. leto_runtime in the trainer)."""
        return "after" if self.after_s is not None else "step"

    def to_json(self) -> dict:
        """Plain JSON-able dict, self-describing (field names, kind as its string value).

        `group`, `chunk`, `garbage` repeat the RMU coordinates of kill/signal at top level (None
        when absent or for other kinds: a `pages` spec's `group` is the faulted protection
        group and stays in `params`)."""
        params = {k: v for k, v in self.params}
        rmu = self.kind in _AT_RMU
        return {"kind": self.kind.value, "rank": self.rank, "after_s": self.after_s,
                "step": self.step, "signal": self.signal, "signal_name": signal_name(self.signal),
                "attempt": self.attempt, "role": self.role, "text": self.text,
                "params": params, "gen": self.gen, "at": self.at,
                "group": params.get("group") if rmu else None,
                "chunk": params.get("chunk") if rmu else None,
                "garbage": params.get("garbage", 0) if rmu else 0}

    @classmethod
    def from_json(cls, d: dict) -> "InjectSpec":
        """Inverse of `to_json` (validates again; `text`/`signal_name` are derived, not trusted)."""
        if not isinstance(d, dict):
            raise ConfigError("inject", f"expected a JSON object, got {type(d).__name__}",
                              "pass InjectSpec.to_json() output")
        allowed = {"kind", "rank", "after_s", "step", "signal", "signal_name", "attempt", "role",
                   "text", "params", "gen", "at", "group", "chunk", "garbage"}
        extra = set(d) - allowed
        if extra:
            raise ConfigError("inject", f"unknown JSON fields {sorted(extra)}",
                              f"allowed: {sorted(allowed)}")
        if "kind" not in d or "rank" not in d:
            raise ConfigError("inject", f"JSON needs 'kind' and 'rank', got {sorted(d)}",
                              "pass InjectSpec.to_json() output")
        kw = {k: d[k] for k in ("after_s", "step", "signal", "attempt", "role", "gen", "at")
              if k in d}
        return cls(kind=d["kind"], rank=d["rank"], params=tuple((d.get("params") or {}).items()),
                   **kw)


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_inject(text: str, source: str | None = None, *, key: str = "inject") -> InjectSpec:
    """Parse one spec string (see module doc).  Raises ConfigError naming `key` and `source`."""

    def err(problem: str, fix: str = f"write it as {GRAMMAR}, e.g. {EXAMPLE}") -> ConfigError:
        return ConfigError(key, f"{text!r}: {problem}", fix, source)

    if not isinstance(text, str) or not text.strip():
        raise err("empty injection spec")
    tokens = [t.strip() for t in text.strip().split(":")]
    if any(not t for t in tokens):
        raise err("empty field between ':' separators")
    kind_s, eq, arg = tokens[0].partition("=")
    kind_s = kind_s.strip().lower()
    rule = KINDS.get(kind_s)
    if rule is None:
        raise err(f"unknown kind {kind_s!r}{_did_you_mean(kind_s, KINDS)}",
                  f"use one of: {', '.join(KINDS)}")
    signal_num = rule.default_signal
    if rule.arg is None and eq:
        raise err(f"kind {kind_s} takes no argument (got {kind_s}={arg})",
                  f"write {kind_s}:rank=...; use signal={arg} to deliver a signal")
    if rule.arg is not None:
        if not arg.strip():
            raise err(f"kind {kind_s} needs an argument: {kind_s}=<{rule.arg}>",
                      f"e.g. {kind_s}=SIGSEGV:rank=0:after=5s")
        try:
            signal_num = rule.parse_arg(arg.strip())
        except ValueError as e:
            raise err(str(e), "use a signal name or number, e.g. SIGSEGV, SIGABRT, SIGBUS, 11; "
                              "use kill or hang for SIGKILL / a hang") from None

    allowed = {**COMMON_KEYS, **rule.extra_keys}
    values: dict[str, Any] = {}
    for tok in tokens[1:]:
        k, eq, v = tok.partition("=")
        k, v = k.strip().lower(), v.strip()
        if k not in allowed:
            raise err(f"unknown key {k!r}{_did_you_mean(k, allowed)}",
                      f"keys for {kind_s}: {', '.join(allowed)}")
        if not eq or not v:
            raise err(f"key {k!r} needs a value ({k}=...)")
        if k in values:
            raise err(f"key {k!r} given twice")
        try:
            values[k] = allowed[k].parse(v)
        except ValueError as e:
            raise err(f"{k}: {e}", allowed[k].fix) from None
    if "rank" not in values:
        raise err("missing rank=R (the global rank to inject into)", f"add :rank=0, e.g. {EXAMPLE}")
    given = [t for t in TRIGGERS if t in values]
    if len(given) != 1:
        raise err("needs exactly one trigger, got " + (" and ".join(given) or "none"),
                  "add after=5s (seconds after the workers started) or step=20 (trainer step)")
    missing = rule.required_extra - set(values)
    if missing:
        raise err(f"kind {kind_s} needs {', '.join(sorted(missing))}")
    try:
        return InjectSpec(
            kind=rule.kind, rank=values["rank"], after_s=values.get("after"),
            step=values.get("step"), signal=signal_num, attempt=values.get("attempt", 0),
            role=values.get("role", "active"), gen=values.get("gen", 0),
            at=values.get("at", "step"),
            params=tuple((k, values[k]) for k in rule.extra_keys if k in values))
    except ConfigError as e:  # defensive: the spec re-validates; keep text and source
        raise err(e.problem, e.fix) from None


def parse_inject_mapping(d: Mapping[str, Any], source: str | None = None, *,
                         key: str = "inject") -> InjectSpec:
    """YAML form: `{kind: signal, signal: SIGSEGV, rank: 1, after: 5s, attempt: 0}`.

    Same fields and parsers as the string form (the mapping is rendered to a spec string), so
    the two can never disagree.
    """
    d = dict(d)
    kind = d.pop("kind", None)
    if not isinstance(kind, str) or not kind.strip():
        raise ConfigError(key, f"mapping {d!r} has no 'kind'",
                          f"add kind: one of {', '.join(KINDS)}", source)
    rule = KINDS.get(kind.strip().lower())
    head = kind.strip()
    if rule is not None and rule.arg and rule.arg in d:
        head += f"={d.pop(rule.arg)}"
    for k, v in d.items():
        if isinstance(v, (bool, list, dict)) or v is None:
            raise ConfigError(key, f"{k}: {v!r} is not a scalar value",
                              f"e.g. {k}: 5 (see {GRAMMAR})", source)
    text = ":".join([head] + [f"{k}={v}" for k, v in d.items()])
    return parse_inject(text, source, key=key)


def for_rank(specs, rank: int, attempt: int) -> tuple[InjectSpec, ...]:
    """The injections that apply to global `rank` in restart attempt `attempt`."""
    return tuple(s for s in specs if s.rank == rank and s.attempt == attempt)


def trainer_plan(specs, rank: int, attempt: int) -> tuple[dict, ...]:
    """`LETO_INJECT_PLAN` of every trainer (active and shadow) of `rank` in restart attempt
    `attempt`: its step-triggered specs of every generation (the runtime filters by `gen`)."""
    return tuple(s.to_json() for s in for_rank(specs, rank, attempt) if s.step is not None)


def timed_for_generation(specs, ranks, attempt: int, generation: int) -> tuple[InjectSpec, ...]:
    """Time-triggered specs the agent arms when `generation` starts (launch or promotion)."""
    return tuple(s for s in specs if s.after_s is not None and s.attempt == attempt
                 and s.gen == generation and s.rank in ranks)
