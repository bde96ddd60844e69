"""Typed, frozen job configuration: the one object every other launcher module reads.

Sources merge as defaults < YAML (`--config`) < environment (`PET_*`, `LETO_*`) < CLI; see
`leto_run.config_load.load_config`.  The YAML layout mirrors the sections below
(`launch:`, `rendezvous:`, `logs:`, `recovery:`, `inject:`); key names equal field names.

Contract: a `JobConfig` that exists is valid.  Values are checked when the object is built
(`__post_init__`) and every problem raises `ConfigError` naming the key, the value and the fix;
callers never re-validate.
"""
from __future__ import annotations

import dataclasses
import signal as _signal
from dataclasses import dataclass, field

from leto_run.errors import ConfigError
from leto_run.inject import InjectSpec

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")
RECOVERY_MODES = ("inplace", "restart")
# Signals torchrun forwards by default, plus the ones Slurm users need (ANCHORS.md §1, #154849).
FORWARDABLE_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


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


@dataclass(frozen=True)
class RendezvousConfig:
    """torch.distributed.elastic rendezvous settings."""

    backend: str = "static"
    endpoint: str = ""
    id: str = "none"
    conf: tuple[tuple[str, str], ...] = ()   # --rdzv-conf k=v,... in order
    standalone: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int | None = None           # None: torchrun's rule (free port on 1 node, else 29500)
    local_addr: str | None = None


@dataclass(frozen=True)
class LogsConfig:
    """Where output goes: torchrun's log layout plus Leto's event log and status view."""

    log_dir: str | None = None
    redirects: str = "0"                     # 0..3 or per local rank "0:1,1:2"
    tee: str = "0"
    local_ranks_filter: tuple[int, ...] = ()
    events: str | None = None                # JSONL event log path (default: <log_dir>/events.jsonl)
    status: bool | None = None               # None: live view when stdout is a TTY


@dataclass(frozen=True)
class RecoveryConfig:
    """Leto's failure handling."""

    mode: str = "inplace"                    # inplace | restart (inplace needs leto_runtime.init())
    hang_timeout: float = 60.0               # seconds without a heartbeat => hang; 0 disables


@dataclass(frozen=True)
class JobConfig:
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    logs: LogsConfig = field(default_factory=LogsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    inject: tuple[InjectSpec, ...] = ()

    def replace(self, **sections) -> "JobConfig":
        return dataclasses.replace(self, **sections)


def signal_number(name: str) -> int:
    """`SIGTERM` / `TERM` / `15` -> 15; raises ValueError on anything else."""
    s = name.strip().upper()
    if s.isdigit():
        return int(_signal.Signals(int(s)))
    if not s.startswith("SIG"):
        s = "SIG" + s
    return int(getattr(_signal, s))
