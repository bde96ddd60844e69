"""Typed, frozen job configuration: the one object every other launcher module reads.

Sources merge as defaults < YAML (`--config`) < environment (`PET_*`, `LETO_*`) < CLI; see
`leto_run.config_load.build_config`.  The YAML layout mirrors the sections below
(`launch:`, `rendezvous:`, `logs:`, `recovery:`, `inject:`); key names equal field names, except
the derived fields (`min_nodes`, `max_nodes`, `auto_c10d`, `JobConfig.warnings`), which the
loader computes.

Contract: a `JobConfig` that exists is valid.  Values are checked when the object is built
(`__post_init__`) and every problem raises `ConfigError` naming the key, the value and the fix;
callers never re-validate.  Every number is bounded above too (`leto_run.limits`: a value that
passes `>= 0` but overflows later is an error here), and injections that can never fire in this
job are refused (`leto_run.inject_checks`).  The loader adds the *source* (YAML file:line,
`--option`, `PET_X`) to errors raised here.  The loader also resolves torchrun's rendezvous rules (standalone,
single-node auto-c10d, default master port, static `rank`), so the agent reads final values.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field

from leto_run import limits as L
from leto_run.config_checkpoint import CheckpointConfig
from leto_run.config_values import (_STD_HELP, normalize_signal, parse_endpoint,  # noqa: F401
                                    parse_nnodes, parse_rdzv_conf, parse_std)
from leto_run.errors import ConfigError
from leto_run.inject import InjectSpec, signal_name, signal_number  # noqa: F401 (re-exported)
from leto_run.inject_checks import check_injects
from leto_runtime.wire.geometry import Geometry

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")
RECOVERY_MODES = ("inplace", "restart")
NPROC_KEYWORDS = ("auto", "cpu", "gpu")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")   # torchrun's --numa-binding choices
DEFAULT_MASTER_PORT = 29500
# Signals torchrun forwards by default, plus the ones Slurm users need (docs/COMPATIBILITY.md,
# "Behaviour that differs, and why"; pytorch issue #154849).
FORWARDABLE_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")

# torchrun options Leto parses for drop-in compatibility but does not implement: any value
# other than the default is rejected (never silently ignored).  key -> (default, what instead)
UNSUPPORTED = {
    "launch.numa_binding": (None, "bind CPUs yourself: run a wrapper with --no-python, e.g. "
                                  "`numactl --cpunodebind=N python train.py`"),
    "launch.virtual_local_rank": (False, "drop --virtual-local-rank and select the device with "
                                         "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))"),
    "logs.event_log_handler": ("null", "drop --event-log-handler; Leto writes its own JSONL event "
                                       "log (--events FILE)"),
    "logs.logs_specs": (None, "drop --logs-specs; use --log-dir, --redirects and --tee"),
    "logs.duplicate_stdout_filters": ((), "drop the filters; use --tee 3 with --log-dir and grep "
                                          "the per-rank log files"),
    "logs.duplicate_stderr_filters": ((), "drop the filters; use --tee 3 with --log-dir and grep "
                                          "the per-rank log files"),
}


def _err(key: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(key, problem, fix)


def _check_number(key: str, value, *, minimum: float, strict: bool = False,
                  integer: bool = False, example: str = "", maximum: float | None = None) -> None:
    """`value` is a number (an int when `integer`) >= `minimum` (> when `strict`) and, every
    option having one (`leto_run.limits`), <= `maximum`."""
    kinds = (int,) if integer else (int, float)
    bad_type = isinstance(value, bool) or not isinstance(value, kinds)
    op = ">" if strict else ">="
    what = "an integer" if integer else "a number"
    top = "" if maximum is None else f" and <= {L.seconds_text(maximum) if not integer else maximum}"
    fix = f"set {key} to {what} {op} {minimum:g}{top}" + (f", e.g. {example}" if example else "")
    if bad_type or (not integer and not math.isfinite(value)) or value < minimum or (
            strict and value == minimum):
        raise _err(key, f"{value!r} is not {what} {op} {minimum:g}", fix)
    if maximum is not None and value > maximum:
        raise _err(key, f"{value!r} is above the maximum {maximum:g}", fix)


def _check_supported(obj, section: str) -> None:
    for key, (default, instead) in UNSUPPORTED.items():
        sec, name = key.split(".")
        if sec == section and getattr(obj, name) != default:
            raise _err(key, f"{getattr(obj, name)!r}: this torchrun option is accepted for "
                            "compatibility but not supported by Leto", instead)


def _freeze(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class LaunchConfig:
    """What to run and how many of it: torchrun's launch options."""

    training_script: str = ""
    script_args: tuple[str, ...] = ()
    nnodes: str = "1:1"                      # as given; parsed into min_nodes/max_nodes
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: str = "1"                # int, or auto | cpu | gpu (resolved by the agent)
    node_rank: int = 0
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    shutdown_timeout: float = 30.0           # SIGTERM -> SIGKILL grace period, seconds
    exit_barrier_timeout: float = 300.0      # wait for other nodes after local success
    numa_binding: str | None = None          # torchrun compat: only None supported
    virtual_local_rank: bool = False         # torchrun compat: only False supported

    def __post_init__(self) -> None:
        _freeze(self, "script_args", tuple(self.script_args))
        if not all(isinstance(a, str) for a in self.script_args):
            raise _err("launch.script_args", f"{self.script_args!r} holds non-strings",
                       "quote every script argument")
        try:
            lo, hi = parse_nnodes(self.nnodes)
        except ValueError as e:
            raise _err("launch.nnodes", str(e), "use N or MIN:MAX, e.g. 2 or 1:4") from None
        if not 0 < lo <= hi:
            raise _err("launch.nnodes", f"{self.nnodes!r} needs 1 <= MIN <= MAX (got MIN={lo}, "
                       f"MAX={hi})", "use N >= 1 or MIN:MAX, e.g. "
                       + (f"{hi}:{lo}" if lo > hi > 0 else "2 or 1:4"))
        if hi > L.MAX_NODES:
            raise _err("launch.nnodes", f"{self.nnodes!r}: MAX={hi} is above {L.MAX_NODES} nodes",
                       f"use at most {L.MAX_NODES} nodes, e.g. 1:4")
        if (self.min_nodes, self.max_nodes) == (1, 1):   # not given: derive from nnodes
            _freeze(self, "min_nodes", lo)
            _freeze(self, "max_nodes", hi)
        elif (self.min_nodes, self.max_nodes) != (lo, hi):
            raise _err("launch.nnodes", f"{self.nnodes!r} contradicts min_nodes={self.min_nodes}, "
                       f"max_nodes={self.max_nodes}", "give nnodes only; min/max are derived")
        self._check_nproc()
        _check_number("launch.node_rank", self.node_rank, minimum=0, integer=True,
                      maximum=L.MAX_NODES - 1)
        _check_number("launch.max_restarts", self.max_restarts, minimum=0, integer=True,
                      example="3", maximum=L.MAX_COUNT)
        _check_number("launch.monitor_interval", self.monitor_interval, minimum=0, strict=True,
                      example="0.1", maximum=L.MAX_SECONDS)
        _check_number("launch.shutdown_timeout", self.shutdown_timeout, minimum=0, example="30",
                      maximum=L.MAX_SECONDS)
        _check_number("launch.exit_barrier_timeout", self.exit_barrier_timeout, minimum=0,
                      example="300", maximum=L.MAX_SECONDS)
        if self.start_method not in START_METHODS:
            raise _err("launch.start_method", f"{self.start_method!r} is not a start method",
                       f"use one of {', '.join(START_METHODS)}")
        if not isinstance(self.role, str) or not self.role.strip():
            raise _err("launch.role", f"{self.role!r} is empty", "use a name, e.g. trainer")
        self._check_entrypoint()
        self._check_signals()
        if self.numa_binding is not None and self.numa_binding not in NUMA_MODES:
            raise _err("launch.numa_binding", f"{self.numa_binding!r} is not a NUMA mode",
                       f"torchrun accepts {', '.join(NUMA_MODES)}; Leto supports none (omit it)")
        _check_supported(self, "launch")

    def _check_nproc(self) -> None:
        v = self.nproc_per_node
        s = str(v).strip().lower() if not isinstance(v, bool) else ""
        fix = (f"use a positive integer <= {L.MAX_NPROC_PER_NODE} (e.g. 4) or "
               f"{', '.join(NPROC_KEYWORDS)}")
        if re.fullmatch(r"\+?[0-9]+", s) and s.lstrip("+0"):
            if len(s.lstrip("+0")) > len(str(L.MAX_NPROC_PER_NODE)) or \
                    int(s) > L.MAX_NPROC_PER_NODE:
                raise _err("launch.nproc_per_node", f"{v!r} is above the maximum "
                           f"{L.MAX_NPROC_PER_NODE} workers per node", fix)
            s = str(int(s))
        elif s not in NPROC_KEYWORDS:
            raise _err("launch.nproc_per_node", f"{v!r} is not a positive integer or "
                       f"{'/'.join(NPROC_KEYWORDS)}", fix)
        _freeze(self, "nproc_per_node", s)

    def _check_entrypoint(self) -> None:
        script = self.training_script
        if not isinstance(script, str):
            raise _err("launch.training_script", f"{script!r} is not a string", "quote the path")
        if self.module and self.no_python:
            raise _err("launch.module", "--module and --no-python contradict each other "
                       "(a module needs the Python interpreter)", "drop one of them")
        if self.module and self.run_path:
            raise _err("launch.module", "--module and --run-path contradict each other "
                       "(run_path executes a file)", "drop one of them")
        if self.module and script and (script.endswith(".py") or "/" in script):
            raise _err("launch.module", f"with -m the script must be a module name, got path "
                       f"{script!r}", f"use -m {script.removesuffix('.py').replace('/', '.')} or drop -m")
        if self.run_path and script and not script.startswith("/"):
            raise _err("launch.run_path", f"--run-path needs an absolute script path, got "
                       f"{script!r}", "pass /abs/path/to/script.py (e.g. \"$PWD/train.py\")")

    def _check_signals(self) -> None:
        names = []
        for s in self.signals_to_handle:
            try:
                n = normalize_signal(s)
            except (ValueError, TypeError):
                raise _err("launch.signals_to_handle", f"{s!r} is not a signal",
                           f"use names from {','.join(FORWARDABLE_SIGNALS)}") from None
            if n in ("SIGKILL", "SIGSTOP"):
                raise _err("launch.signals_to_handle", f"{n} cannot be caught, so it cannot be "
                           "forwarded", f"remove it; forwardable: {','.join(FORWARDABLE_SIGNALS)}")
            if n not in FORWARDABLE_SIGNALS:
                raise _err("launch.signals_to_handle", f"{n} is not forwarded by Leto",
                           f"use names from {','.join(FORWARDABLE_SIGNALS)}")
            if n not in names:
                names.append(n)
        if not names:
            raise _err("launch.signals_to_handle", "empty list", "keep at least SIGTERM,SIGINT")
        _freeze(self, "signals_to_handle", tuple(names))

    @property
    def nproc_int(self) -> int | None:
        """Workers per node when given as an int; None for auto/cpu/gpu (the agent resolves)."""
        return int(self.nproc_per_node) if self.nproc_per_node.isdigit() else None


# The id names the run's log directory (`<log_dir>/<id>_XXXXXXXX`, as torchrun's): one path
# component, so at most NAME_MAX (255) bytes less mkdtemp's "_" and 8 random characters.
MAX_RDZV_ID_BYTES = 255 - 9


def _check_rdzv_id(rid) -> None:
    """torchrun takes any string; Leto, like torchrun, puts it in a path, so it must be one
    path component there (docs/COMPATIBILITY.md)."""
    fix = "use a job id without '/' or NUL, e.g. $SLURM_JOB_ID"
    if not isinstance(rid, str) or not rid.strip():
        raise _err("rendezvous.id", f"{rid!r} is empty", fix)
    if "/" in rid or "\0" in rid:
        raise _err("rendezvous.id", f"{rid!r} contains '/' or NUL: it names the log directory "
                   "<log_dir>/<id>_*, which must stay inside --log-dir", fix)
    size = len(rid.encode("utf-8", "surrogateescape"))
    if size > MAX_RDZV_ID_BYTES:
        raise _err("rendezvous.id", f"{rid[:40]!r}... is {size} bytes, above the maximum "
                   f"{MAX_RDZV_ID_BYTES} (it names the log directory: one file name)", fix)


@dataclass(frozen=True)
class RendezvousConfig:
    """torch.distributed.elastic rendezvous settings (final values after torchrun's rules)."""

    backend: str = "static"
    endpoint: str = ""
    id: str = "none"
    conf: tuple[tuple[str, str], ...] = ()   # --rdzv-conf k=v,... in order (+ rank for static)
    standalone: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT   # resolved: always an int (torchrun's 29500 default)
    local_addr: str | None = None
    secret_file: str | None = None           # shared secret of a multi-node job (leto_run.job_secret)
    auto_c10d: bool = False                  # torchrun's single-node rule switched static -> c10d

    def __post_init__(self) -> None:
        if self.backend not in RDZV_BACKENDS:
            close = difflib.get_close_matches(str(self.backend), RDZV_BACKENDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _err("rendezvous.backend", f"{self.backend!r} is not a rendezvous backend{hint}",
                       f"use one of {', '.join(RDZV_BACKENDS)}")
        if self.endpoint:
            try:
                parse_endpoint(self.endpoint)
            except ValueError as e:
                raise _err("rendezvous.endpoint", str(e), "use HOST:PORT, e.g. node0:29400") from None
        _check_rdzv_id(self.id)
        _freeze(self, "conf", tuple((str(k), str(v)) for k, v in self.conf))
        for k, v in self.conf:
            if k.endswith(("timeout", "interval")):    # torch turns these into timedeltas
                try:
                    x = float(v)
                except ValueError:
                    x = math.nan
                if not (math.isfinite(x) and 0 < x <= L.MAX_SECONDS):
                    raise _err("rendezvous.conf", f"{k}={v!r} is not a number of seconds > 0 "
                               f"and <= {L.seconds_text(L.MAX_SECONDS)}", f"e.g. {k}=600")
        if len({k for k, _ in self.conf}) != len(self.conf):
            raise _err("rendezvous.conf", f"duplicate key in {self.conf!r}", "give each key once")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise _err("rendezvous.master_addr", f"{self.master_addr!r} is empty",
                       "use the rank-0 node's address, e.g. 10.0.0.1")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 0 < self.master_port <= 65535:
            raise _err("rendezvous.master_port", f"{self.master_port!r} is not a port 1..65535",
                       f"e.g. {DEFAULT_MASTER_PORT}, or omit it on a single node (free port)")
        if self.local_addr is not None and not str(self.local_addr).strip():
            raise _err("rendezvous.local_addr", "empty address", "omit it to use the FQDN")

    def conf_dict(self) -> dict[str, str]:
        return dict(self.conf)

    def rdzv_configs(self) -> dict[str, object]:
        """What torchrun hands to `RendezvousParameters`: strings, except static's int `rank`."""
        d: dict[str, object] = dict(self.conf)
        if "rank" in d:
            d["rank"] = int(d["rank"])
        return d


@dataclass(frozen=True)
class LogsConfig:
    """Where output goes: torchrun's log layout plus Leto's event log and status view."""

    log_dir: str | None = None
    redirects: str = "0"                     # 0..3 or per local rank "0:1,1:2"
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] = ()
    events: str | None = None                # JSONL event log (default: in the run's log dir)
    status: bool | None = None               # None: live view when stdout is a TTY
    event_log_handler: str = "null"          # torchrun compat: only "null" supported
    logs_specs: str | None = None            # torchrun compat: only None supported
    duplicate_stdout_filters: tuple[str, ...] = ()   # torchrun compat: only () supported
    duplicate_stderr_filters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("log_dir", "events", "logs_specs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise _err(f"logs.{name}", f"{v!r} is empty", f"omit {name} or give a path")
        for name in ("redirects", "tee"):
            v = getattr(self, name)
            try:
                parse_std(v)
            except ValueError as e:
                raise _err(f"logs.{name}", str(e), f"use {_STD_HELP}") from None
            _freeze(self, name, str(v).strip())
        ranks = tuple(self.local_ranks_filter)
        if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < L.MAX_NPROC_PER_NODE
               for r in ranks):
            raise _err("logs.local_ranks_filter", f"{ranks!r} must be local ranks (integers "
                       f"0..{L.MAX_NPROC_PER_NODE - 1})", "e.g. --local-ranks-filter 0,1")
        _freeze(self, "local_ranks_filter", tuple(dict.fromkeys(ranks)))
        if self.status not in (None, True, False):
            raise _err("logs.status", f"{self.status!r} is not true/false", "use --status or "
                       "--no-status (omit: live view when stdout is a terminal)")
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            _freeze(self, name, tuple(getattr(self, name)))
        _check_supported(self, "logs")

    def std_map(self, name: str) -> int | dict[int, int]:
        """`redirects` / `tee` parsed: 0..3 for all ranks, or {local_rank: 0..3}."""
        return parse_std(getattr(self, name))


DEMOTE_MODES = ("replace", "release")
PREINIT_POLICIES = ("auto", "L1", "L2", "L3")   # leto_run.preinit.POLICIES


@dataclass(frozen=True)
class RecoveryConfig:
    """Leto's failure handling, and the geometry of the retained memory (docs/MEMORY.md,
    docs/RMU.md).

    The geometry (page_bytes, data_pages, tier1, tier2) goes to the state managers; chunk_pages
    and pg_timeout go to the trainers (LETO_CHUNK_PAGES, LETO_PG_TIMEOUT).  `demote` says what
    happens to the surviving actives of a HOF: `release` (default, the paper's design) makes
    each one release its GPU memory and process group in process and become a shadow of the
    next generation (imports and CUDA context kept), and kills and replaces one that cannot
    (it does not confirm within the agent's bound); `replace` always kills them and starts
    fresh shadows."""

    mode: str = "inplace"                    # inplace | restart (inplace needs leto_runtime.init())
    hang_timeout: float = 60.0               # seconds without a heartbeat => hang; 0 disables
    page_bytes: int = 2 << 20                # RMP page size (the CUDA VMM granularity)
    data_pages: int = 1024                   # D: data pages per protection group
    tier1: int = 16                          # H1: tier-1 parity pages per group (<= 16)
    tier2: int = 1                           # H2: tier-2 parity pages per group
    chunk_pages: int = 0                     # RMU transaction size in pages (0: the runtime picks)
    pg_timeout: float = 600.0                # seconds: trainers' process-group and store waits
    demote: str = "release"                  # release | replace (see the docstring)
    max_inplace_recoveries: int = 20         # in-place recoveries allowed per window (0: none)
    inplace_window: float = 3600.0           # seconds: the sliding window of that budget
    scrub_budget: float = 0.002              # share of the step time the scrub may take (0: off)
    peer_timeout: float = 5.0                # seconds a peer agent may go silent: its node is lost
    preinit: str = "auto"                    # auto | L1 | L2 | L3: the shadows' preinit level (docs/PREINIT.md)
    preinit_margin: int = 1024               # MiB the device keeps free beyond the active's projected peak

    def __post_init__(self) -> None:
        if self.mode not in RECOVERY_MODES:
            raise _err("recovery.mode", f"{self.mode!r} is not a recovery mode",
                       f"use one of {', '.join(RECOVERY_MODES)}")
        _check_number("recovery.hang_timeout", self.hang_timeout, minimum=0,
                      example="60 (0 disables hang detection)", maximum=L.MAX_SECONDS)
        _check_number("recovery.peer_timeout", self.peer_timeout, minimum=0, strict=True,
                      example="5", maximum=L.MAX_SECONDS)
        _check_number("recovery.page_bytes", self.page_bytes, minimum=4096, integer=True,
                      example="2097152 (2 MiB)", maximum=L.MAX_PAGE_BYTES)
        _check_number("recovery.data_pages", self.data_pages, minimum=1, integer=True,
                      example="1024", maximum=L.MAX_GROUP_PAGES)
        _check_number("recovery.tier1", self.tier1, minimum=1, integer=True, example="16",
                      maximum=L.MAX_GROUP_PAGES)
        _check_number("recovery.tier2", self.tier2, minimum=0, integer=True, example="1",
                      maximum=L.MAX_GROUP_PAGES)
        for issue in self.geometry.issues():       # the rules every side checks (wire.geometry)
            raise _err(f"recovery.{issue.field}", issue.problem, issue.fix)
        _check_number("recovery.chunk_pages", self.chunk_pages, minimum=0, integer=True,
                      example="0 (the runtime picks) or 64")
        if self.chunk_pages > self.data_pages:
            raise _err("recovery.chunk_pages", f"{self.chunk_pages} is above data_pages="
                       f"{self.data_pages} (a chunk, one RMU transaction, is part of one "
                       "protection group)", f"use 0 (the runtime picks) or 1..{self.data_pages}")
        _check_number("recovery.pg_timeout", self.pg_timeout, minimum=0, strict=True,
                      example="600", maximum=L.MAX_SECONDS)
        _check_number("recovery.max_inplace_recoveries", self.max_inplace_recoveries,
                      minimum=0, integer=True, example="20 (0: every failure restarts)",
                      maximum=L.MAX_COUNT)
        _check_number("recovery.inplace_window", self.inplace_window, minimum=0, strict=True,
                      example="3600", maximum=L.MAX_WINDOW_SECONDS)
        _check_number("recovery.scrub_budget", self.scrub_budget, minimum=0,
                      example="0.002 (0.2% of the step time; 0 turns the scrub off)",
                      maximum=L.MAX_SCRUB_BUDGET)
        if self.preinit not in PREINIT_POLICIES:
            raise _err("recovery.preinit", f"{self.preinit!r} is not a preinitialization policy",
                       f"use one of {', '.join(PREINIT_POLICIES)} (auto: as high as memory allows)")
        _check_number("recovery.preinit_margin", self.preinit_margin, minimum=0, integer=True,
                      example="1024 (MiB)", maximum=L.MAX_MIB)
        if self.demote not in DEMOTE_MODES:
            raise _err("recovery.demote", f"{self.demote!r} is not a demotion mode",
                       "use replace (survivors are killed, fresh shadows start) or release "
                       "(survivors release their GPU memory and become shadows in process)")

    @property
    def geometry(self):
        """The protection-group `Geometry` (leto_runtime.wire.geometry)."""
        return Geometry(data_pages=self.data_pages, tier1=self.tier1, tier2=self.tier2,
                        page_bytes=self.page_bytes)


def check_local_ranks(lg: LogsConfig, nproc: int) -> None:
    """The local ranks `--redirects`, `--tee` and `--local-ranks-filter` name exist."""
    for name in ("redirects", "tee"):
        m = lg.std_map(name)
        bad = sorted(r for r in m if r >= nproc) if isinstance(m, dict) else []
        if bad:
            raise _err(f"logs.{name}", f"names local rank(s) {bad} but nproc_per_node is "
                       f"{nproc}", f"use local ranks 0..{nproc - 1}")
    bad = [r for r in lg.local_ranks_filter if r >= nproc]
    if bad:
        raise _err("logs.local_ranks_filter", f"local rank(s) {bad} do not exist with "
                   f"nproc_per_node {nproc}", f"use local ranks 0..{nproc - 1}")


@dataclass(frozen=True)
class JobConfig:
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    logs: LogsConfig = field(default_factory=LogsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    inject: tuple[InjectSpec, ...] = ()
    warnings: tuple[str, ...] = ()           # non-fatal notes from the loader, for the startup log

    def __post_init__(self) -> None:
        _freeze(self, "inject", tuple(self.inject))
        _freeze(self, "warnings", tuple(self.warnings))
        la, rz, lg = self.launch, self.rendezvous, self.logs
        if rz.standalone and la.max_nodes > 1:
            raise _err("rendezvous.standalone", f"--standalone is single-node but nnodes is "
                       f"{la.nnodes!r}", "drop --standalone and use --rdzv-backend c10d "
                       "--rdzv-endpoint HOST:PORT for several nodes")
        if (rz.backend == "static" or rz.auto_c10d) and la.node_rank >= la.max_nodes:
            raise _err("launch.node_rank", f"node_rank {la.node_rank} is not below nnodes "
                       f"{la.nnodes!r}", f"use a node rank in 0..{la.max_nodes - 1}")
        if la.nproc_int is not None:
            check_local_ranks(lg, la.nproc_int)
        # With auto|cpu|gpu these checks run in preflight, once the count is known here
        # (`with_nproc`, `check_local_ranks`).
        check_injects(self)

    def with_nproc(self, nproc: int) -> "JobConfig":
        """This job with `--nproc-per-node auto|cpu|gpu` resolved to `nproc` workers: every
        check that needs the count (local ranks named by the log options, injections' ranks)
        runs again, so a resolved count gets the same refusals as a given one."""
        return self.replace(launch=dataclasses.replace(self.launch, nproc_per_node=str(nproc)))

    @property
    def max_world_size(self) -> int | None:
        """max_nodes x nproc_per_node, or None while nproc is auto/cpu/gpu."""
        n = self.launch.nproc_int
        return None if n is None else self.launch.max_nodes * n

    def replace(self, **sections) -> "JobConfig":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON-able) of every field, for --print-config and the log."""
        def plain(v):
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            return v
        out: dict = {}
        for sec in ("launch", "rendezvous", "logs", "recovery", "checkpoint"):
            obj = getattr(self, sec)
            out[sec] = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out["rendezvous"]["conf"] = dict(self.rendezvous.conf)
        out["inject"] = [s.text for s in self.inject]
        out["warnings"] = list(self.warnings)
        return out
