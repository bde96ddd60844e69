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

In-place recovery keys (DESIGN.md §3, §6):

    kill:rank=1:step=5:gen=1                  kill rank 1 at step 5 of generation 1 (after a HOF)
    kill:rank=0:step=3:at=rmu.update:group=0:chunk=2:garbage=1
                                              inside the RMU update of group 0, chunk 2 of step 3,
                                              after writing garbage into the chunk
    hang:rank=0:step=4:at=sync                block at the global synchronization of step 4

`at=POINT` (kill, signal, hang, pages; one of `leto_runtime.contract.INJECT_POINTS`, default
`step`) names where inside a step a step-triggered spec fires; it needs `step=`.  `group=G`,
`chunk=C` and `garbage=1` (kill, signal) narrow an `rmu.*` point to one protection group / chunk
and make the runtime overwrite the chunk with garbage before the signal; they need an `rmu.*`
point.  A time-triggered spec with `gen=N` fires `after` seconds after generation N started (its
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
`leto_run`.  Range checks that need the job (rank < world size) are done by `JobConfig`.
"""
from __future__ import annotations

import difflib
import enum
import math
import re
import signal as _signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from leto_run.errors import ConfigError
from leto_runtime.contract import INJECT_POINTS

GRAMMAR = ("KIND[=ARG]:rank=R:(after=T|step=N)[:attempt=A][:gen=G][:at=POINT][:role=active]"
           "[:group=G:chunk=C:garbage=1]")
EXAMPLE = "kill:rank=1:after=5s"
ROLES = ("active",)          # `shadow` arrives with shadow trainers
# Signals whose default action is to do nothing: injecting one would not fail the process.
_HARMLESS = frozenset({"SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH"})


class InjectKind(str, enum.Enum):
    KILL = "kill"
    HANG = "hang"
    SIGNAL = "signal"
    PAGES = "pages"


def signal_number(name: str | int) -> int:
    """`SIGTERM` / `term` / `15` / 15 -> 15.  Raises ValueError for anything that is not a signal."""
    if isinstance(name, bool):
        raise ValueError(f"{name!r} is not a signal")
    s = str(name).strip().upper()
    if isinstance(name, int) or s.isdigit():
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
    if not re.fullmatch(r"\d+", v):
        raise ValueError(f"{v!r} is not a non-negative integer")
    return int(v)


_DURATION = re.compile(r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>ms|s|m)?")


def parse_duration(v: str) -> float:
    """`5s`, `500ms`, `2.5` (seconds), `1m` -> seconds as float."""
    m = _DURATION.fullmatch(v.strip())
    if not m:
        raise ValueError(f"{v!r} is not a duration (use e.g. 5s, 500ms, 2.5, 1m)")
    x = float(m["num"]) * {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m["unit"]]
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
        for name in ("rank", "attempt", "gen"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise self._err(f"{name}={v!r} must be an integer >= 0", f"e.g. {name}=0")
        if (self.after_s is None) == (self.step is None):
            raise self._err("needs exactly one trigger, got "
                            + ("both after= and step=" if self.after_s is not None else "none"),
                            "add after=5s (time after start) or step=20 (trainer step), not both")
        if self.after_s is not None:
            a = self.after_s
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
                raise self._err(f"after={a!r} must be a finite number of seconds >= 0", "e.g. after=5s")
            object.__setattr__(self, "after_s", float(a))
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)
                                      or self.step < 0):
            raise self._err(f"step={self.step!r} must be an integer >= 0", "e.g. step=20")
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
        object.__setattr__(self, "params", tuple(sorted(self.params)))
        self._check_point()
        object.__setattr__(self, "text", self._canonical())

    def _check_point(self) -> None:
        if self.at not in INJECT_POINTS:
            raise self._err(f"at={self.at!r} is not an injection point",
                            f"use one of {', '.join(INJECT_POINTS)}")
        if self.at != "step" and self.step is None:
            raise self._err(f"at={self.at} needs a step trigger (the runtime fires it)",
                            f"use step=N with at={self.at}, or drop at=")
        rmu = ({k for k, _ in self.params if k in RMU_KEYS}
               if self.kind in (InjectKind.KILL, InjectKind.SIGNAL) else set())
        if rmu and not self.at.startswith("rmu."):
            raise self._err(f"{', '.join(sorted(rmu))} only mean something at an rmu.* point "
                            f"(got at={self.at})",
                            "add at=rmu.update (or another rmu.* point), or drop them")

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
        rmu = self.kind in (InjectKind.KILL, InjectKind.SIGNAL)
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
