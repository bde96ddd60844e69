"""Typed simulation configuration: the spec types of the ETTR simulator and their YAML loader.

Role: turn a YAML file (or a dict) into frozen dataclasses -- the workload's iteration-time
inputs (:class:`Workload`), the failure process (:class:`FailureSpec`) and each system's
recovery and overhead parameters (:class:`LetoSpec`, :class:`CheckpointSpec`) -- and reject
every bad value *before* any simulation runs.

Calling contract: :func:`load_config` (a path) or :func:`parse_config` (a mapping) returns a
:class:`SimConfig` or raises :class:`SimConfigError` naming the dotted field, the problem and
the fix.  Unknown keys are errors (a typo must not silently fall back to a default).  Durations
are numbers of seconds or strings such as ``"50us"``, ``"500ms"``, ``"30s"``, ``"10m"``, ``"1h"``, ``"2d"``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

#: System names the simulator knows (systems.py builds one model per name).
SYSTEM_NAMES = ("leto", "gemini_plus", "checkpoint_restart")

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|min|m|h|d)?\s*$")


class SimConfigError(ValueError):
    """A bad simulation input: which field, what is wrong with it, and how to fix it."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"field '{field}': {problem}; fix: {fix}")


# --------------------------------------------------------------------------- spec types
@dataclass(frozen=True)
class Bracket:
    """One bracket (contiguous layers of a stage) traversed by one microbatch, seconds."""
    forward: float
    backward: float


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its brackets, inter-stage p2p time and embedding/head extra."""
    brackets: tuple[Bracket, ...]
    p2p: float = 0.0
    extra: float = 0.0


@dataclass(frozen=True)
class Collective:
    """Fitted alpha-beta model of one collective: latency + factor * bytes / bandwidth."""
    latency: float
    bandwidth: float          # bytes per second (bus bandwidth)
    algorithm: str = "reduce_scatter"   # or "all_reduce" (twice the ring traffic)


@dataclass(frozen=True)
class Interference:
    """Residual interference of C.1.3: 'none', 'dense' (constant c) or 'moe' (f, all-to-all)."""
    kind: str = "none"
    c: float = 0.0
    f: float = 0.0
    alltoall: float = 0.0     # seconds of MoE all-to-all inside the backward window


@dataclass(frozen=True)
class Workload:
    """Iteration-time inputs of Appendix C.1 for one deployment."""
    microbatches: int
    virtual: int
    stages: tuple[Stage, ...]
    dp: int
    stage_params: float       # parameters whose gradients one rank of a stage synchronizes
    grad_bytes: float         # bytes per gradient element on the wire
    param_bytes: float        # bytes per parameter element for the sharded all-gather
    collective: Collective
    concurrency_penalty: float
    overlap: bool
    interference: Interference
    optimizer_step: float     # seconds: optimizer step + scalar (grad-norm) reduction
    sharded_optimizer: bool


@dataclass(frozen=True)
class FailureSpec:
    """The failure process: overall MTTF, HOF ratio, seeds and the wall-clock horizon."""
    mttf: float
    hof_ratio: float
    seeds: int
    horizon: float
    base_seed: int = 0


@dataclass(frozen=True)
class CheckpointSpec:
    """An interval-checkpointing system (Gemini+ or checkpoint-restart): recovery phases."""
    name: str
    detection: float
    init: float               # restart (fresh processes) or spare takeover (preinitialized)
    load: float               # reading the checkpoint back (storage or peer host memory)
    checkpoint_cost: float    # p: excess of a committing iteration / uncheckpointed t_iter
    interval: int | None      # None: Young's interval from the MTTF


@dataclass(frozen=True)
class LetoSpec:
    """Leto: in-place HOF recovery; FFs fall back to the named checkpointing system."""
    detection: float
    promotion: float          # shadow trainer takes over (prebuilt state, same hardware)
    reconstruction: float     # RMP localization + RMU page reconstruction
    rmu_overhead: float       # extra seconds per iteration of RMU's update phase
    ff_fallback: str          # a CheckpointSpec name in the same config
    ff_interval: int | None   # None: Young's interval from the FF MTTF M/(1-h)
    max_ff_interval: int      # used when h = 1 (no finite Young's interval)


@dataclass(frozen=True)
class SimConfig:
    """A whole simulation: name, workload, failure process and the systems to compare."""
    name: str
    workload: Workload
    failures: FailureSpec
    checkpointing: Mapping[str, CheckpointSpec] = field(default_factory=dict)
    leto: LetoSpec | None = None

    @property
    def system_names(self) -> tuple[str, ...]:
        names = tuple(n for n in SYSTEM_NAMES if n in self.checkpointing)
        return (("leto",) if self.leto else ()) + names


# --------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that reads a plain number as the CLI (click's int/float) reads the same text.

    PyYAML's YAML 1.1 resolvers read `010` as 8 (octal), `0x10` as 16, `1:4` as 64 (base 60),
    `1_0` as 10 and `yes`/`on` as true, while `--iterations 010` on the command line is 10.
    Here an int is decimal digits only and a float what float() reads (no `_`); anything else
    stays text, which the field's parser refuses by name.  Same rule as the launcher's YAML
    (leto_run.yaml_source), which the simulator does not import (it runs without leto_run)."""


_Loader.yaml_implicit_resolvers = {}
for _tag, _rx, _first in (
        ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
        ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
        ("tag:yaml.org,2002:int", r"^[-+]?[0-9]+$", list("-+0123456789")),
        ("tag:yaml.org,2002:float",
         r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$", list("-+0123456789.")),
        ("tag:yaml.org,2002:merge", r"^(?:<<)$", ["<"])):
    _Loader.add_implicit_resolver(_tag, re.compile(_rx), _first)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """Decimal, also for an explicit `!!int` (SafeLoader's reads `!!int 010` as 8)."""
    text = str(node.value).strip()
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a decimal integer (write e.g. 10)", node.start_mark)
    return int(text)


def _construct_float(loader: _Loader, node: yaml.ScalarNode) -> float:
    """An explicit `!!float`: what float() reads, less `_` (the CLI's numbers have none)."""
    text = str(node.value).strip()
    try:
        if "_" in text:
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a decimal number (write e.g. 1.5)",
            node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


# --------------------------------------------------------------------------- value parsers
def parse_duration(value: Any, where: str, *, allow_zero: bool = True) -> float:
    """Seconds from a number or a string with a unit; negative, NaN or bad units raise."""
    if isinstance(value, bool):
        raise SimConfigError(where, f"expected a duration, got {value!r}", "write e.g. 30s, 10m")
    if isinstance(value, (int, float)):
        secs = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m is None:
            raise SimConfigError(where, f"cannot read duration {value!r}",
                                 "write a number of seconds or e.g. 50us, 500ms, 30s, 10m, 1h, 2d")
        secs = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise SimConfigError(where, f"expected a duration, got {type(value).__name__}",
                             "write e.g. 30s, 10m, 1h")
    if not math.isfinite(secs) or secs < 0 or (secs == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise SimConfigError(where, f"must be {need} duration (got {value!r})",
                             f"give {need} duration such as 10m")
    return secs


def parse_number(value: Any, where: str, *, lo: float = 0.0, hi: float = math.inf,
            lo_open: bool = False) -> float:
    if isinstance(value, str):
        # A number given as text (quoted); float() would also take `1_000`, the CLI does not.
        try:
            value = float(value) if "_" not in value else value
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SimConfigError(where, f"expected a number, got {value!r}", "write a finite number")
    if value < lo or (lo_open and value == lo) or value > hi:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise SimConfigError(where, f"{value!r} is outside {rng}", f"give a value in {rng}")
    return float(value)


def _int(value: Any, where: str, *, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise SimConfigError(where, f"expected an integer >= {lo}, got {value!r}",
                             f"write a whole number >= {lo}")
    return value


def _interval(value: Any, where: str) -> int | None:
    # 'auto' (or absent) means Young's formula; a number pins the interval in iterations.
    if value is None or value == "auto":
        return None
    return _int(value, where)


def _mapping(value: Any, where: str, allowed: set[str], required: set[str] = frozenset()):
    """Check a YAML mapping: it is a mapping, has no unknown keys and has the required ones."""
    if not isinstance(value, Mapping):
        raise SimConfigError(where or "<top>", f"expected a mapping, got {type(value).__name__}",
                             "write key: value pairs")
    for key in value:
        if key not in allowed:
            raise SimConfigError(f"{where}.{key}".lstrip("."), "unknown key",
                                 f"remove it or use one of: {', '.join(sorted(allowed))}")
    for key in sorted(required - set(value)):
        raise SimConfigError(f"{where}.{key}".lstrip("."), "missing", "add it")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SimConfigError(where, f"expected true or false, got {value!r}", "write true/false")
    return value


# --------------------------------------------------------------------------- section parsers
def _parse_stage(raw: Any, where: str) -> list[Stage]:
    """A stage entry: brackets as [forward, backward] pairs; `repeat` copies it n times."""
    raw = _mapping(raw, where, {"brackets", "p2p", "extra", "repeat"}, {"brackets"})
    brackets = raw["brackets"]
    if not isinstance(brackets, list) or not brackets:
        raise SimConfigError(f"{where}.brackets", "expected a non-empty list of "
                             "[forward, backward] pairs", "write e.g. [[0.01, 0.02]]")
    parsed = []
    for j, b in enumerate(brackets):
        bw = f"{where}.brackets[{j}]"
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise SimConfigError(bw, f"expected a [forward, backward] pair, got {b!r}",
                                 "write two durations, e.g. [10ms, 20ms]")
        parsed.append(Bracket(parse_duration(b[0], bw + "[0]"), parse_duration(b[1], bw + "[1]")))
    stage = Stage(tuple(parsed), parse_duration(raw.get("p2p", 0), f"{where}.p2p"),
                  parse_duration(raw.get("extra", 0), f"{where}.extra"))
    return [stage] * _int(raw.get("repeat", 1), f"{where}.repeat")


def _parse_workload(raw: Any) -> Workload:
    w = "workload"
    raw = _mapping(raw, w, {"pipeline", "sync", "update"}, {"pipeline", "sync", "update"})
    pipe = _mapping(raw["pipeline"], f"{w}.pipeline", {"microbatches", "virtual", "stages"},
                    {"microbatches", "stages"})
    if not isinstance(pipe["stages"], list) or not pipe["stages"]:
        raise SimConfigError(f"{w}.pipeline.stages", "expected a non-empty list of stages",
                             "list each stage's brackets (use repeat for identical stages)")
    stages: list[Stage] = []
    for i, s in enumerate(pipe["stages"]):
        stages += _parse_stage(s, f"{w}.pipeline.stages[{i}]")
    sync = _mapping(raw["sync"], f"{w}.sync",
                    {"dp", "stage_params", "grad_bytes", "collective", "concurrency_penalty",
                     "overlap", "interference"}, {"dp", "stage_params", "collective"})
    coll = _mapping(sync["collective"], f"{w}.sync.collective",
                    {"latency", "bandwidth_gbps", "algorithm"}, {"bandwidth_gbps"})
    algo = coll.get("algorithm", "reduce_scatter")
    if algo not in ("reduce_scatter", "all_reduce"):
        raise SimConfigError(f"{w}.sync.collective.algorithm", f"unknown algorithm {algo!r}",
                             "use reduce_scatter or all_reduce")
    collective = Collective(
        parse_duration(coll.get("latency", 0), f"{w}.sync.collective.latency"),
        parse_number(coll["bandwidth_gbps"], f"{w}.sync.collective.bandwidth_gbps",
                lo_open=True) * 1e9 / 8, algo)
    update = _mapping(raw["update"], f"{w}.update", {"optimizer_step", "sharded", "param_bytes"},
                      {"optimizer_step"})
    return Workload(
        microbatches=_int(pipe["microbatches"], f"{w}.pipeline.microbatches"),
        virtual=_int(pipe.get("virtual", 1), f"{w}.pipeline.virtual"),
        stages=tuple(stages),
        dp=_int(sync["dp"], f"{w}.sync.dp"),
        stage_params=parse_number(sync["stage_params"], f"{w}.sync.stage_params", lo_open=True),
        grad_bytes=parse_number(sync.get("grad_bytes", 4), f"{w}.sync.grad_bytes", lo_open=True),
        param_bytes=parse_number(update.get("param_bytes", 2), f"{w}.update.param_bytes",
                            lo_open=True),
        collective=collective,
        concurrency_penalty=parse_number(sync.get("concurrency_penalty", 1.0),
                                    f"{w}.sync.concurrency_penalty", lo=1.0),
        overlap=_bool(sync.get("overlap", True), f"{w}.sync.overlap"),
        interference=_parse_interference(sync.get("interference"), f"{w}.sync.interference"),
        optimizer_step=parse_duration(update["optimizer_step"], f"{w}.update.optimizer_step"),
        sharded_optimizer=_bool(update.get("sharded", False), f"{w}.update.sharded"),
    )


def _parse_interference(raw: Any, where: str) -> Interference:
    if raw is None:
        return Interference()
    raw = _mapping(raw, where, {"kind", "c", "f", "alltoall"}, {"kind"})
    kind = raw["kind"]
    if kind == "none":
        return Interference()
    if kind == "dense":
        return Interference("dense", c=parse_number(raw.get("c", 0.0), f"{where}.c"))
    if kind == "moe":
        # f lies in [0, 1]: the sharing delay of two flows is in [0, min(G, A)] (C.1.3).
        return Interference("moe", f=parse_number(raw.get("f", 0.0), f"{where}.f", hi=1.0),
                            alltoall=parse_duration(raw.get("alltoall", 0), f"{where}.alltoall"))
    raise SimConfigError(f"{where}.kind", f"unknown interference kind {kind!r}",
                         "use none, dense or moe")


def _parse_failures(raw: Any) -> FailureSpec:
    w = "failures"
    raw = _mapping(raw, w, {"mttf", "hof_ratio", "seeds", "horizon", "base_seed"},
                   {"mttf", "hof_ratio", "horizon"})
    return FailureSpec(
        mttf=parse_duration(raw["mttf"], f"{w}.mttf", allow_zero=False),
        hof_ratio=parse_number(raw["hof_ratio"], f"{w}.hof_ratio", hi=1.0),
        seeds=_int(raw.get("seeds", 20), f"{w}.seeds", lo=2),
        horizon=parse_duration(raw["horizon"], f"{w}.horizon", allow_zero=False),
        base_seed=_int(raw.get("base_seed", 0), f"{w}.base_seed", lo=0),
    )


def _parse_checkpointing(name: str, raw: Any) -> CheckpointSpec:
    w = f"systems.{name}"
    raw = _mapping(raw, w, {"detection", "init", "load", "checkpoint_cost", "interval"},
                   {"detection", "init", "load", "checkpoint_cost"})
    return CheckpointSpec(
        name=name,
        detection=parse_duration(raw["detection"], f"{w}.detection"),
        init=parse_duration(raw["init"], f"{w}.init"),
        load=parse_duration(raw["load"], f"{w}.load"),
        checkpoint_cost=parse_number(raw["checkpoint_cost"], f"{w}.checkpoint_cost"),
        interval=_interval(raw.get("interval"), f"{w}.interval"),
    )


def _parse_leto(raw: Any, others: Mapping[str, CheckpointSpec]) -> LetoSpec:
    w = "systems.leto"
    raw = _mapping(raw, w, {"detection", "promotion", "reconstruction", "rmu_overhead",
                            "ff_fallback", "ff_interval", "max_ff_interval"},
                   {"detection", "promotion", "reconstruction", "rmu_overhead", "ff_fallback",
                    "max_ff_interval"})
    fallback = raw["ff_fallback"]
    if fallback not in others:
        raise SimConfigError(f"{w}.ff_fallback", f"{fallback!r} is not a checkpointing system "
                             "of this config", "name one listed under systems: "
                             + (", ".join(others) or "(add gemini_plus)"))
    return LetoSpec(
        detection=parse_duration(raw["detection"], f"{w}.detection"),
        promotion=parse_duration(raw["promotion"], f"{w}.promotion"),
        reconstruction=parse_duration(raw["reconstruction"], f"{w}.reconstruction"),
        rmu_overhead=parse_duration(raw["rmu_overhead"], f"{w}.rmu_overhead"),
        ff_fallback=fallback,
        ff_interval=_interval(raw.get("ff_interval"), f"{w}.ff_interval"),
        max_ff_interval=_int(raw["max_ff_interval"], f"{w}.max_ff_interval"),
    )


def parse_config(raw: Any) -> SimConfig:
    """Validate a mapping (parsed YAML) into a :class:`SimConfig`; raises SimConfigError."""
    raw = _mapping(raw, "", {"name", "workload", "failures", "systems"},
                   {"workload", "failures", "systems"})
    systems = _mapping(raw["systems"], "systems", set(SYSTEM_NAMES))
    if not systems:
        raise SimConfigError("systems", "no system to simulate", "add leto and/or gemini_plus")
    ckpt = {n: _parse_checkpointing(n, systems[n]) for n in SYSTEM_NAMES
            if n != "leto" and n in systems}
    leto = _parse_leto(systems["leto"], ckpt) if "leto" in systems else None
    name = raw.get("name", "unnamed")
    if not isinstance(name, str):
        raise SimConfigError("name", f"expected a string, got {name!r}", "quote the name")
    return SimConfig(name, _parse_workload(raw["workload"]), _parse_failures(raw["failures"]),
                     ckpt, leto)


def load_config(path: str | Path) -> SimConfig:
    """Read and validate a YAML config file; a missing or unparsable file is a SimConfigError."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SimConfigError("--config", f"cannot read {p} ({e.strerror})",
                             "pass an existing YAML file") from None
    try:
        raw = yaml.load(text, Loader=_Loader)   # noqa: S506 (a SafeLoader, numbers as the CLI)
    except yaml.YAMLError as e:
        raise SimConfigError("--config", f"{p} is not valid YAML ({str(e).splitlines()[0]})",
                             "fix the YAML syntax") from None
    return parse_config(raw)
