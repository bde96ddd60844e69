"""Build a `JobConfig` from defaults, a YAML file, the environment and the command line.

Precedence (lowest to highest): dataclass defaults < YAML (`--config` / `LETO_CONFIG`) <
environment (`PET_<DEST>` for torchrun's options, exactly torchrun's rule; `LETO_*` for Leto's;
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` below `PET_SHUTDOWN_TIMEOUT`) < command line.  Every option is
one row of `OPTIONS`: its YAML key, CLI spellings, environment names, converter and fix hint; the
CLI (`leto_run.cli`) generates its click options from the same table, so the four surfaces cannot
drift apart.

Calling contract: `build_config(cli_values, cli_given, env, yaml_path)` is pure (reads only the
YAML file) and returns a valid, resolved `JobConfig` or raises `ConfigError` whose `source` names
where the offending value came from (`job.yaml:12`, `--nnodes`, `PET_NNODES`, `default`).
Empty environment variables count as unset.  torchrun's rendezvous rules are applied here
(`resolve_rendezvous`), so the agent reads final values.
"""
from __future__ import annotations

import dataclasses
import difflib
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from leto_run import config as C
from leto_run.config_conv import (conv_bool, conv_conf, conv_filters, conv_float,  # noqa: F401
                                  conv_int, conv_opt_str, conv_opt_str_or_int, conv_ranks,
                                  conv_script_args, conv_signals, conv_status, conv_std,
                                  conv_str, conv_str_or_int)
from leto_run.errors import ConfigError
from leto_run.inject import GRAMMAR, parse_inject, parse_inject_mapping
from leto_run.yaml_source import YamlDoc, load_yaml

SECTIONS = {"launch": C.LaunchConfig, "rendezvous": C.RendezvousConfig, "logs": C.LogsConfig,
            "recovery": C.RecoveryConfig, "checkpoint": C.CheckpointConfig}
DERIVED = {"launch.min_nodes": "launch.nnodes", "launch.max_nodes": "launch.nnodes",
           "rendezvous.auto_c10d": "rendezvous.backend"}
LETO_CONFIG_ENV = "LETO_CONFIG"
# ---- the option table -----------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    key: str                          # dotted YAML key == section.field
    flags: tuple[str, ...]            # CLI spellings; () for the positional arguments
    conv: Callable[[Any], Any]
    help: str
    env: tuple[str, ...] = ()         # highest priority first
    metavar: str = ""
    kind: str = "value"               # value | flag | bool_pair | multiple | positional
    fix: str = ""

    @property
    def dest(self) -> str:
        """click parameter name: torchrun's argparse dest (first long flag, dashes -> _)."""
        if not self.flags:
            return self.key.split(".")[1]
        long = next(f for f in self.flags if f.startswith("--"))
        return long[2:].split("/")[0].replace("-", "_")

    @property
    def section(self) -> str:
        return self.key.split(".")[0]


def _torch(key: str, flags: tuple[str, ...], conv, help: str, metavar: str = "", *,
           kind: str = "value", fix: str = "", env: bool = True) -> Option:
    """A torchrun option: dashed + underscored spellings, env PET_<DEST> (torchrun's rule)."""
    spelled: list[str] = []
    for f in flags:
        spelled.append(f)
        if f.startswith("--") and "-" in f[2:]:
            spelled.append("--" + f[2:].replace("-", "_"))
    opt = Option(key, tuple(spelled), conv, help, metavar=metavar, kind=kind, fix=fix)
    return dataclasses.replace(opt, env=(f"PET_{opt.dest.upper()}",) if env else ())


def _leto(key: str, flags: tuple[str, ...], conv, help: str, metavar: str = "", *,
          env: str | None = None, kind: str = "value", fix: str = "") -> Option:
    return Option(key, flags, conv, help, (env,) if env else (), metavar, kind, fix)


OPTIONS: tuple[Option, ...] = (
    # launch
    Option("launch.training_script", (), conv_str, "Script (or module with -m) to run.",
           kind="positional"),
    Option("launch.script_args", (), conv_script_args, "Arguments passed to the script untouched.",
           kind="positional"),
    _torch("launch.nnodes", ("--nnodes",), conv_str_or_int, "Number of nodes, N or MIN:MAX.",
           "N|MIN:MAX", fix="use N or MIN:MAX with 0 < MIN <= MAX, e.g. 2 or 1:4"),
    _torch("launch.nproc_per_node", ("--nproc-per-node",), conv_str_or_int,
           "Workers per node: an integer, or auto|cpu|gpu.", "N|auto|cpu|gpu",
           fix="use a positive integer or auto, cpu, gpu"),
    _torch("launch.node_rank", ("--node-rank",), conv_int,
           "Rank of this node (static rendezvous only).", "N", fix="use an integer >= 0"),
    _torch("launch.max_restarts", ("--max-restarts",), conv_int,
           "Whole-group restarts before giving up.", "N", fix="use an integer >= 0"),
    _torch("launch.monitor_interval", ("--monitor-interval",), conv_float,
           "Seconds between checks of the multi-node membership (exits are seen at once).", "SECONDS",
           fix="use a number of seconds > 0, e.g. 0.1"),
    _torch("launch.start_method", ("--start-method",), conv_str,
           "spawn|fork|forkserver (function entrypoints only).", "METHOD"),
    _torch("launch.role", ("--role",), conv_str, "Role name of the workers (ROLE_NAME).", "NAME"),
    _torch("launch.module", ("-m", "--module"), conv_bool,
           "Run the script as a module, like python -m.", kind="flag"),
    _torch("launch.no_python", ("--no-python",), conv_bool,
           "Execute the script directly, without python.", kind="flag"),
    _torch("launch.run_path", ("--run-path",), conv_bool,
           "Run an absolute script path with runpy.run_path.", kind="flag"),
    _torch("launch.signals_to_handle", ("--signals-to-handle",), conv_signals,
           "Signals forwarded to workers (SIGUSR1/2 allowed).", "SIG,SIG",
           fix="a comma list from SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"),
    dataclasses.replace(
        _torch("launch.shutdown_timeout", ("--shutdown-timeout",), conv_float,
               "SIGTERM -> SIGKILL grace period, seconds.", "SECONDS",
               fix="use a number of seconds >= 0, e.g. 30"),
        env=("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")),
    _leto("launch.exit_barrier_timeout", ("--exit-barrier-timeout", "--exit_barrier_timeout"),
          conv_float, "Seconds a finished node waits for the others.", "SECONDS",
          env="LETO_EXIT_BARRIER_TIMEOUT", fix="use a number of seconds >= 0, e.g. 300"),
    _torch("launch.numa_binding", ("--numa-binding",), conv_opt_str,
           "torchrun compat; not supported.", "MODE", env=False),
    _torch("launch.virtual_local_rank", ("--virtual-local-rank",), conv_bool,
           "torchrun compat; not supported.", kind="flag"),
    # rendezvous
    _torch("rendezvous.backend", ("--rdzv-backend",), conv_str,
           "static|c10d|etcd|etcd-v2.", "BACKEND"),
    _torch("rendezvous.endpoint", ("--rdzv-endpoint",), conv_str,
           "Rendezvous HOST:PORT (c10d default port 29400).", "HOST:PORT"),
    _torch("rendezvous.id", ("--rdzv-id",), conv_str, "Job id shared by all nodes.", "ID"),
    _torch("rendezvous.conf", ("--rdzv-conf",), conv_conf,
           "Backend options k=v,... (join_timeout, last_call_timeout, close_timeout).", "K=V,...",
           fix="use key=value,key=value, e.g. join_timeout=900"),
    _torch("rendezvous.standalone", ("--standalone",), conv_bool,
           "Single node: c10d store on a free local port, random run id.", kind="flag"),
    _torch("rendezvous.master_addr", ("--master-addr",), conv_str,
           "Rank-0 node address (static rendezvous).", "ADDR"),
    _torch("rendezvous.master_port", ("--master-port",), conv_int,
           "Rank-0 node port (static rendezvous).", "PORT",
           fix="use a port 1..65535"),
    _torch("rendezvous.local_addr", ("--local-addr",), conv_opt_str,
           "Address this node advertises.", "ADDR"),
    _leto("rendezvous.secret_file", ("--secret-file",), conv_opt_str,
          "Secret shared by every node (0600, 32+ bytes) that authenticates the job's stores; "
          "default ~/.config/leto/job_secret if it exists (needed by multi-node in-place jobs).",
          "FILE", env="LETO_SECRET_FILE", fix="give the path of a 0600 file of 32+ bytes"),
    # logs
    _torch("logs.log_dir", ("--log-dir",), conv_opt_str, "Base directory for per-rank logs.",
           "DIR"),
    _torch("logs.redirects", ("-r", "--redirects"), conv_std,
           "Redirect output to log files: 0-3 or 0:1,1:2.", "STD", fix=f"use {C._STD_HELP}"),
    _torch("logs.tee", ("-t", "--tee"), conv_std, "Tee output to log files and console.", "STD",
           fix=f"use {C._STD_HELP}"),
    _torch("logs.local_ranks_filter", ("--local-ranks-filter",), conv_ranks,
           "Console output only from these local ranks.", "R,R",
           fix="use comma-separated local ranks, e.g. 0,1"),
    _leto("logs.events", ("--events",), conv_opt_str,
          "Leto's JSONL event log.", "FILE", env="LETO_EVENTS"),
    _leto("logs.status", ("--status/--no-status",), conv_status,
          "Live status view on/off.", env="LETO_STATUS",
          kind="bool_pair", fix="use 1/0, true/false or auto"),
    _torch("logs.event_log_handler", ("--event-log-handler",), conv_str,
           "torchrun compat; only 'null' supported.", "NAME"),
    _torch("logs.logs_specs", ("--logs-specs",), conv_opt_str,
           "torchrun compat; not supported.", "NAME", env=False),
    _torch("logs.duplicate_stdout_filters", ("--duplicate-stdout-filters",), conv_filters,
           "torchrun compat; not supported.", "F,F"),
    _torch("logs.duplicate_stderr_filters", ("--duplicate-stderr-filters",), conv_filters,
           "torchrun compat; not supported.", "F,F"),
    # recovery
    _leto("recovery.mode", ("--recovery",), conv_str,
          "inplace (needs leto_runtime in the script) or restart (torchrun semantics).",
          "inplace|restart", env="LETO_RECOVERY"),
    _leto("recovery.hang_timeout", ("--hang-timeout", "--hang_timeout"), conv_float,
          "Seconds without a heartbeat before a rank counts as hung (0: off).", "SECONDS",
          env="LETO_HANG_TIMEOUT", fix="use a number of seconds >= 0 (0 disables)"),
    _leto("recovery.peer_timeout", ("--peer-timeout",), conv_float,
          "Multi-node: seconds a peer agent may go silent before its node counts as lost.",
          "SECONDS", env="LETO_PEER_TIMEOUT", fix="use a number of seconds > 0, e.g. 5"),
    _torch("recovery.page_bytes", ("--page-bytes",), conv_int,
           "Retained-memory page size in bytes (multiple of 4096).", "BYTES",
           fix="use a multiple of 4096, e.g. 2097152 (2 MiB)"),
    _torch("recovery.data_pages", ("--data-pages",), conv_int,
           "Data pages per protection group (D).", "N", fix="use an integer >= 1, e.g. 1024"),
    _torch("recovery.tier1", ("--tier1",), conv_int,
           "Tier-1 parity pages per group (H1, 1..16).", "N", fix="use 1..16, e.g. 16"),
    _torch("recovery.tier2", ("--tier2",), conv_int,
           "Tier-2 parity pages per group (H2, 1..H1).", "N", fix="use 1..tier1, e.g. 1"),
    _torch("recovery.chunk_pages", ("--chunk-pages",), conv_int,
           "RMU transaction size in pages (0: the runtime picks).", "N",
           fix="use an integer >= 0"),
    _torch("recovery.pg_timeout", ("--pg-timeout",), conv_float,
           "Seconds the trainers wait for process groups and the store.", "SECONDS",
           fix="use a number of seconds > 0, e.g. 600"),
    _torch("recovery.demote", ("--demote",), conv_str,
           "What happens to surviving actives of a HOF: replace (killed, fresh shadows) or "
           "release (they release GPU memory and become shadows in process).",
           "replace|release", fix="use replace or release"),
    _leto("recovery.preinit", ("--preinit",), conv_str,
          "How far shadows preinitialize: auto (as high as the device's memory allows, moved "
          "down before the active would run out), or a pinned L1 (imports), L2 (+ CUDA "
          "context) or L3 (+ process group).", "auto|L1|L2|L3", env="LETO_PREINIT",
          fix="use auto, L1, L2 or L3"),
    _leto("recovery.preinit_margin", ("--preinit-margin",), conv_int,
          "MiB of device memory kept free beyond the active's projected peak before a shadow "
          "may hold a level.", "MIB", env="LETO_PREINIT_MARGIN",
          fix="use an integer number of MiB >= 0, e.g. 1024"),
    _leto("recovery.max_inplace_recoveries", ("--max-inplace-recoveries",), conv_int,
          "In-place recoveries allowed within --inplace-window; past it, failures follow "
          "--max-restarts (0: every failure restarts).", "N",
          env="LETO_MAX_INPLACE_RECOVERIES", fix="use an integer >= 0, e.g. 20"),
    _leto("recovery.inplace_window", ("--inplace-window",), conv_float,
          "Seconds of the sliding window that --max-inplace-recoveries counts in.", "SECONDS",
          env="LETO_INPLACE_WINDOW", fix="use a number of seconds > 0, e.g. 3600"),
    _leto("recovery.scrub_budget", ("--scrub-budget",), conv_float,
          "Share of the step time the background scrub of retained state may take "
          "(0.002: 0.2%; 0 turns it off).", "FRACTION",
          env="LETO_SCRUB_BUDGET", fix="use a number 0..0.5, e.g. 0.002"),
    # checkpoint (leto_run.config_checkpoint)
    _leto("checkpoint.dir", ("--checkpoint-dir",), conv_opt_str,
          "Directory of periodic torch.distributed.checkpoint checkpoints; a failure in-place "
          "recovery cannot take falls back to the newest complete one (unset: off).", "DIR",
          env="LETO_CHECKPOINT_DIR"),
    _leto("checkpoint.every", ("--checkpoint-every",), conv_opt_str_or_int,
          "Checkpoint interval: STEPS, a DURATION (90s, 10m, 2h) or auto (Young's interval "
          "from --ff-mtbf).", "STEPS|DURATION|auto", env="LETO_CHECKPOINT_EVERY"),
    _leto("checkpoint.ff_mtbf", ("--ff-mtbf",), conv_opt_str_or_int,
          "Mean time between failures that are not HOFs (for --checkpoint-every auto).",
          "DURATION", env="LETO_FF_MTBF"),
    _leto("checkpoint.keep", ("--checkpoint-keep",), conv_int,
          "Complete checkpoints kept (older ones are removed).", "N",
          env="LETO_CHECKPOINT_KEEP", fix="use an integer >= 1, e.g. 2"),
    _leto("checkpoint.writer", ("--checkpoint-writer",), conv_str,
          "Who copies the state for a checkpoint: auto (rank 0's shadow, from retained memory "
          "while the active computes; the active where no shadow serves), shadow (the same, "
          "waiting up to 20 s for a shadow that is starting) or trainer.",
          "auto|shadow|trainer", env="LETO_CHECKPOINT_WRITER", fix="use auto, shadow or trainer"),
    _leto("checkpoint.max_fallbacks", ("--max-fallbacks",), conv_int,
          "Checkpoint fallbacks allowed before the job ends (exit 4).", "N",
          env="LETO_MAX_FALLBACKS", fix="use an integer >= 0, e.g. 3"),
)
INJECT_OPTION = _leto("inject", ("--inject",), conv_str,
                      "Inject a failure, e.g. kill:rank=1:after=5s, hang:rank=0:step=20, "
                      "signal=SIGSEGV:rank=2:after=500ms:attempt=1. Repeatable.", "SPEC", kind="multiple")
BY_KEY = {o.key: o for o in OPTIONS}
BY_DEST = {o.dest: o for o in OPTIONS}


# ---- merging -------------------------------------------------------------------------------
@dataclass
class _Raw:
    value: Any
    source: str


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _yaml_values(doc: YamlDoc) -> tuple[dict[str, _Raw], list[tuple[Any, str]]]:
    raw: dict[str, _Raw] = {}
    for sec, body in doc.data.items():
        where = doc.where(sec)
        if sec == "inject":
            continue
        if sec not in SECTIONS:
            hint = (" (did you mean 'rendezvous'?)" if str(sec).startswith("rdzv")
                    else _did_you_mean(sec, [*SECTIONS, "inject"]) or _unknown_hint("", str(sec)))
            raise ConfigError(str(sec), f"unknown section{hint}",
                              "sections are launch, rendezvous, logs, recovery, checkpoint, inject", where)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(sec, f"expected a mapping of keys, got {type(body).__name__} {body!r}",
                              f"indent the {sec} keys under `{sec}:`", where)
        for k, v in body.items():
            key, where = f"{sec}.{k}", doc.where(sec, k)
            if key in BY_KEY:
                if v is not None:     # `key:` / `key: null` means "the default", as if omitted
                    raw[key] = _Raw(v, where)
                continue
            if key in DERIVED:
                raise ConfigError(key, "is derived, not set", f"set {DERIVED[key]} instead", where)
            raise ConfigError(key, "unknown key" + _unknown_hint(sec, str(k)),
                              f"valid keys in {sec}: "
                              + ", ".join(o.key.split(".")[1] for o in OPTIONS if o.section == sec),
                              where)
    inject = doc.data.get("inject")
    items: list[tuple[Any, str]] = []
    if inject is not None:
        if not isinstance(inject, list):
            raise ConfigError("inject", f"expected a list, got {type(inject).__name__}",
                              f"write `inject:` followed by `- {GRAMMAR}` items", doc.where("inject"))
        items = [(x, doc.where("inject", i)) for i, x in enumerate(inject)]
    return raw, items


def _unknown_hint(sec: str, k: str) -> str:
    """Did-you-mean within the section, then: right key in another section, or a CLI spelling."""
    same = [o.key.split(".")[1] for o in OPTIONS if o.section == sec]
    hint = _did_you_mean(k, same)
    if hint:
        return hint
    for o in OPTIONS:
        name = o.key.split(".")[1]
        if name == k or o.dest == k.replace("-", "_"):
            return f" (did you mean {o.key!r}?)"
    return ""


def _env_values(env: Mapping[str, str]) -> dict[str, _Raw]:
    raw: dict[str, _Raw] = {}
    for o in OPTIONS:
        for name in o.env:
            v = env.get(name)
            if v is not None and v.strip() != "":
                raw[o.key] = _Raw(v, name)
                break
    return raw


def _cli_values(cli_values: Mapping[str, Any], cli_given: set[str]) -> dict[str, _Raw]:
    raw: dict[str, _Raw] = {}
    for dest in cli_given:
        o = BY_DEST.get(dest)
        if o is None:
            continue
        v = cli_values.get(dest)
        if o.kind == "positional":
            source = "TRAINING_SCRIPT" if dest == "training_script" else "SCRIPT_ARGS"
        elif o.kind == "bool_pair":
            pos, neg = o.flags[0].split("/")
            source = pos if v else neg
        else:
            source = next(f for f in o.flags if f.startswith("--"))
        raw[o.key] = _Raw(tuple(v) if isinstance(v, list) else v, source)
    if "launch.training_script" in raw and "launch.script_args" not in raw:
        # a script on the CLI replaces the YAML script *and* its arguments
        raw["launch.script_args"] = _Raw((), "SCRIPT_ARGS")
    return raw


def _convert(raw: dict[str, _Raw]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, r in raw.items():
        o = BY_KEY[key]
        try:
            out[key] = o.conv(r.value)
        except ValueError as e:
            fix = o.fix or (f"give {key} as {o.metavar}" if o.metavar else f"give {key} as text")
            raise ConfigError(key, str(e), fix, r.source) from None
    return out


def _parse_injects(cli_values, cli_given, yaml_items) -> tuple[list, list[str]]:
    specs, sources = [], []
    for item, where in yaml_items:    # always parsed: a bad YAML entry is an error even if
        key = f"inject[{len(specs)}]"  # --inject replaces the list
        if isinstance(item, dict):
            specs.append(parse_inject_mapping(item, where, key=key))
        elif isinstance(item, str):
            specs.append(parse_inject(item, where, key=key))
        else:
            raise ConfigError(key, f"{item!r} is neither a spec string nor a mapping",
                              "write `- kill:rank=1:after=5s` or "
                              "`- {kind: kill, rank: 1, after: 5s}`", where)
        sources.append(where)
    if "inject" in cli_given:   # the command line replaces the YAML list, like every option
        texts = cli_values.get("inject") or ()
        specs = [parse_inject(t, "--inject", key=f"inject[{i}]") for i, t in enumerate(texts)]
        sources = ["--inject"] * len(specs)
    return specs, sources


def default_of(key: str):
    """The dataclass default of a dotted key (`launch.nnodes` -> "1:1")."""
    sec, name = key.split(".")
    return next(f.default for f in dataclasses.fields(SECTIONS[sec]) if f.name == name)


def resolve_rendezvous(values: dict[str, Any], given: set[str], max_nodes: int,
                       warnings: list[str], new_id: Callable[[], str] | None = None) -> None:
    """torchrun's `run()` rules, applied in place to the converted `values` (dotted keys).

    `--standalone` -> c10d on localhost:0 with a random run id; static + no endpoint + no master
    port + max_nodes == 1 -> the same (auto_c10d); master_port defaults to 29500; a static
    endpoint is master_addr:master_port and its conf gets rank=node_rank.  Unlike torchrun, an
    explicit `--rdzv-id` is kept (torchrun discards it), and contradictions raise.
    """
    new_id = new_id or (lambda: str(uuid.uuid4()))

    def get(key: str):
        return values[key] if key in values else default_of(key)
    backend, endpoint, run_id = get("rendezvous.backend"), get("rendezvous.endpoint"), get("rendezvous.id")
    if get("rendezvous.standalone"):
        if endpoint:
            raise ConfigError("rendezvous.endpoint", f"{endpoint!r} contradicts --standalone "
                              "(which hosts its own store on a free local port)",
                              "drop --rdzv-endpoint or drop --standalone")
        if backend not in ("static", "c10d"):
            raise ConfigError("rendezvous.backend", f"{backend!r} contradicts --standalone "
                              "(which uses c10d)", "drop --rdzv-backend or drop --standalone")
        backend, endpoint = "c10d", "localhost:0"
        run_id = new_id() if run_id == "none" else run_id
    elif (backend == "static" and not endpoint and "rendezvous.master_port" not in given
          and max_nodes == 1):
        backend, endpoint = "c10d", "localhost:0"
        run_id = new_id() if run_id == "none" else run_id
        values["rendezvous.auto_c10d"] = True
    port = values.setdefault("rendezvous.master_port", C.DEFAULT_MASTER_PORT)
    if not 0 < port <= 65535:      # before it goes into the endpoint and is blamed there
        raise ConfigError("rendezvous.master_port", f"{port!r} is not a port 1..65535",
                          f"e.g. {C.DEFAULT_MASTER_PORT}, or omit it on a single node")
    conf = list(get("rendezvous.conf"))
    if backend == "static":
        endpoint = endpoint or f"{get('rendezvous.master_addr')}:{port}"
        node_rank = get("launch.node_rank")
        for k, v in conf:
            if k == "rank" and v.strip() != str(node_rank):
                raise ConfigError("rendezvous.conf", f"rank={v} contradicts node_rank {node_rank}",
                                  "drop rank= from --rdzv-conf and use --node-rank")
        conf = [(k, v) for k, v in conf if k != "rank"] + [("rank", str(node_rank))]
    else:
        for key, what in (("rendezvous.master_addr", "--master-addr"),
                          ("rendezvous.master_port", "--master-port"),
                          ("launch.node_rank", "--node-rank")):
            if key in given and get(key) != default_of(key):
                warnings.append(f"{what} is only used by the static rendezvous backend; "
                                f"ignored with {backend}")
    values.update({"rendezvous.backend": backend, "rendezvous.endpoint": endpoint,
                   "rendezvous.id": run_id, "rendezvous.conf": tuple(conf)})


def build_config(cli_values: Mapping[str, Any] | None = None, cli_given: set[str] | None = None,
                 env: Mapping[str, str] | None = None, yaml_path: str | None = None, *,
                 require_script: bool = True, new_id: Callable[[], str] | None = None,
                 sources_out: dict[str, str] | None = None) -> C.JobConfig:
    """Merge every source into a validated, resolved `JobConfig` (see module doc).

    cli_values: click's `ctx.params` (dest -> value); cli_given: the dests whose parameter source
    is the command line; env: the environment; yaml_path: `--config` (None: `LETO_CONFIG`).
    sources_out: filled with where each given key came from (`--log-dir`, `job.yaml:7`).
    """
    cli_values, cli_given, env = cli_values or {}, set(cli_given or ()), env or {}
    raw: dict[str, _Raw] = {}
    yaml_items: list = []
    yaml_source = "--config"
    if yaml_path is None and env.get(LETO_CONFIG_ENV, "").strip():
        yaml_path, yaml_source = env[LETO_CONFIG_ENV], LETO_CONFIG_ENV
    values: dict[str, Any] = {}
    if yaml_path:
        raw, yaml_items = _yaml_values(load_yaml(yaml_path, yaml_source))
        values = _convert(raw)    # the whole file is checked, even keys the CLI overrides
    later = {**_env_values(env), **_cli_values(cli_values, cli_given)}
    raw.update(later)
    values.update(_convert(later))   # env values the CLI overrides are never read (torchrun)
    sources = {k: r.source for k, r in raw.items()}
    specs, inject_sources = _parse_injects(cli_values, cli_given, yaml_items)
    sources.update({f"inject[{i}]": s for i, s in enumerate(inject_sources)})
    if sources_out is not None:
        sources_out.update(sources)

    def with_source(e: ConfigError) -> ConfigError:
        if e.source:
            return e
        return ConfigError(e.key, e.problem, e.fix, sources.get(e.key, "default"))

    warnings: list[str] = []
    try:
        if require_script and not values.get("launch.training_script"):
            raise ConfigError("launch.training_script", "no training script given",
                              "pass TRAINING_SCRIPT after the options, or set "
                              "launch.training_script in the YAML", "command line")
        try:
            max_nodes = C.parse_nnodes(values.get("launch.nnodes", "1:1"))[1]
        except ValueError:
            max_nodes = 1      # LaunchConfig below rejects the nnodes value, with its source
        resolve_rendezvous(values, set(raw), max_nodes, warnings, new_id)
        if values.get("launch.run_path") and values.get("launch.no_python"):
            warnings.append("--run-path takes precedence over --no-python (as in torchrun)")
        kwargs: dict[str, dict] = {s: {} for s in SECTIONS}
        for key, v in values.items():
            sec, name = key.split(".")
            kwargs[sec][name] = v
        sections = {s: cls(**kwargs[s]) for s, cls in SECTIONS.items()}
        return C.JobConfig(**sections, inject=tuple(specs), warnings=tuple(warnings))
    except ConfigError as e:
        raise with_source(e) from None
