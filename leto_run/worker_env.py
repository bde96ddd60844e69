"""The one writer of a worker's environment.

Exactly torchrun's worker environment (same keys, values and rules, docs/COMPATIBILITY.md and
torch's ``LocalElasticAgent._start_workers``), plus Leto's ``LETO_*`` contract variables whose
names live in `leto_runtime.wire.contract` and which `leto_runtime.context.Context` reads.

Documented differences from torchrun (the env-parity test allows exactly these):
``LETO_*`` keys; values of run ids, ports and paths (error file, run dir); MASTER_ADDR of a
single-node job whose host name is not one loopback address (the worker store listens on
loopback only: `leto_run.store_listen`).  ``LETO_JOB_KEY`` (in-place mode) is the job's MAC key:
it reaches a worker only through its environment, which other users cannot read.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from leto_runtime.wire import contract as C


@dataclass(frozen=True)
class WorkerIdentity:
    """Where one worker sits in the job (torchrun's ``Worker`` fields)."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    role_name: str


@dataclass(frozen=True)
class WorkerEnvSpec:
    identity: WorkerIdentity
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    use_agent_store: bool
    error_file: str
    signals_to_handle: str
    # ---- Leto ----
    slot_role: str
    generation: int
    run_dir: str
    heartbeat_socket: str
    hang_timeout: float
    recovery: str
    node: str
    job_token: str
    dump_signal: int
    inject_plan: tuple[dict, ...] = ()
    sm_socket: str | None = None          # the slot's state manager (in-place mode only)
    shadow_epoch: int = 0                 # shadows of a generation restarted together: epoch + 1
    pg_timeout: float = 600.0             # trainers' process-group / store waits, seconds
    chunk_pages: int = 0                  # RMU transaction size in pages (0: the runtime picks)
    demote: str = "replace"               # replace | release (recovery.demote)
    preinit_level: str | None = None      # shadows: L1 | L2 | L3 (leto_run.preinit_control)
    warmup_room: int | None = None        # shadows: bytes their warm-up may take (None: no view)
    scrub_budget: float = 0.002           # share of the step time for the scrub (recovery.scrub_budget)
    job_key: str = field(default="", repr=False)   # hex MAC key of the stores' control values
    checkpoint_env: tuple[tuple[str, str], ...] = ()   # LETO_CHECKPOINT_* (config_checkpoint)


# Every LETO_* variable of the agent -> worker contract (`contract` spells each name as its own
# value; docs/PROTOCOL.md, "The worker environment", lists them).  The agent sets or removes each
# one for every worker: none may come from the agent's own environment, where a stale value (a
# LETO_JOB_KEY exported in a shell, an outer job's LETO_SM_SOCKET) would be read as the agent's.
# Tuning knobs (`leto_runtime.wire.settings`: LETO_RMU_*, ...) are not in it and pass through.
CONTRACT_VARIABLES = frozenset(v for k, v in vars(C).items()
                               if k.startswith("LETO_") and k == v)


def build_worker_env(base: Mapping[str, str], spec: WorkerEnvSpec) -> dict[str, str]:
    """Return the complete environment of one worker process.

    `base` is the agent's own environment (torchrun passes ``os.environ`` down the same way,
    including an ``OMP_NUM_THREADS`` the launcher set for nproc > 1).
    """
    ident = spec.identity
    # the agent's own LETO_CHECKPOINT_* settings are config, not the trainers' contract values;
    # nor is the rendezvous setting the agent made for itself (leto_run.rendezvous); nor any
    # contract variable of the agent's environment (CONTRACT_VARIABLES)
    env = {k: v for k, v in base.items() if not k.startswith(C.CHECKPOINT_ENV_PREFIX)
           and k != C.TORCH_SHARE_RDZV_STORE_OFF and k not in CONTRACT_VARIABLES}
    env.update({
        C.RANK: str(ident.global_rank),
        C.GROUP_RANK: str(ident.group_rank),
        C.ROLE_RANK: str(ident.role_rank),
        C.ROLE_NAME: ident.role_name,
        C.LOCAL_WORLD_SIZE: str(ident.local_world_size),
        C.WORLD_SIZE: str(ident.world_size),
        C.GROUP_WORLD_SIZE: str(ident.group_world_size),
        C.ROLE_WORLD_SIZE: str(ident.role_world_size),
        C.MASTER_ADDR: spec.master_addr,
        C.MASTER_PORT: str(spec.master_port),
        C.TORCHELASTIC_RESTART_COUNT: str(spec.restart_count),
        C.TORCHELASTIC_MAX_RESTARTS: str(spec.max_restarts),
        C.TORCHELASTIC_RUN_ID: spec.run_id,
        C.TORCHELASTIC_USE_AGENT_STORE: str(spec.use_agent_store),
        C.TORCH_NCCL_ASYNC_ERROR_HANDLING: base.get(C.TORCH_NCCL_ASYNC_ERROR_HANDLING, "1"),
        C.LOCAL_RANK: str(ident.local_rank),
        C.TORCHELASTIC_ERROR_FILE: spec.error_file,
        C.TORCHELASTIC_SIGNALS_TO_HANDLE: spec.signals_to_handle,
        # ---- Leto contract ----
        C.LETO_CONTRACT_VERSION: str(C.CONTRACT_VERSION),
        C.LETO_ROLE: spec.slot_role,
        C.LETO_GENERATION: str(spec.generation),
        C.LETO_ATTEMPT: str(spec.restart_count),
        C.LETO_RUN_DIR: spec.run_dir,
        C.LETO_HEARTBEAT_SOCKET: spec.heartbeat_socket,
        C.LETO_HANG_TIMEOUT: repr(float(spec.hang_timeout)),
        C.LETO_RECOVERY: spec.recovery,
        C.LETO_NODE: spec.node,
        C.LETO_JOB_TOKEN: spec.job_token,
        C.LETO_DUMP_SIGNAL: str(spec.dump_signal),
        C.LETO_INJECT_PLAN: json.dumps(list(spec.inject_plan), separators=(",", ":")),
        C.LETO_SHADOW_EPOCH: str(spec.shadow_epoch),
        C.LETO_PG_TIMEOUT: repr(float(spec.pg_timeout)),
        C.LETO_CHUNK_PAGES: str(spec.chunk_pages),
        C.LETO_DEMOTE: spec.demote,
        C.LETO_SCRUB_BUDGET: repr(float(spec.scrub_budget)),
    })
    env.update(spec.checkpoint_env)
    # the optional ones: set when the agent has a value, else absent (the base has none)
    if spec.preinit_level:
        env[C.LETO_PREINIT_LEVEL] = spec.preinit_level
    if spec.warmup_room is not None:
        env[C.LETO_WARMUP_ROOM] = str(spec.warmup_room)
    if spec.sm_socket:
        env[C.LETO_SM_SOCKET] = spec.sm_socket
    if spec.job_key:
        env[C.LETO_JOB_KEY] = spec.job_key
    return env


# What differs between the workers of one job: build_worker_env sets these per worker.  The rest
# of a worker's environment is the agent's own, the same for every worker (the fork server's).
_PER_WORKER = frozenset({
    C.RANK, C.GROUP_RANK, C.ROLE_RANK, C.ROLE_NAME, C.LOCAL_WORLD_SIZE, C.WORLD_SIZE,
    C.GROUP_WORLD_SIZE, C.ROLE_WORLD_SIZE, C.MASTER_ADDR, C.MASTER_PORT, C.LOCAL_RANK,
    C.TORCH_NCCL_ASYNC_ERROR_HANDLING})


def per_worker(key: str) -> bool:
    """`key` is one of the variables the agent sets per worker (nothing reads them at import)."""
    return key in _PER_WORKER or key.startswith(("LETO_", "TORCHELASTIC_"))


def shared_env(base: Mapping[str, str], token: str) -> dict[str, str]:
    """The environment every worker of the job shares: `base` as `build_worker_env` takes it,
    without the per-worker variables, plus the job token (a process forked with it carries the
    token in /proc/PID/environ, where the guardian and the stop look for escaped descendants)."""
    env = {k: v for k, v in base.items() if not k.startswith(C.CHECKPOINT_ENV_PREFIX)
           and k != C.TORCH_SHARE_RDZV_STORE_OFF and not per_worker(k)}
    env[C.LETO_JOB_TOKEN] = token
    return env


def default_omp_threads(environ: dict[str, str], nproc_per_node: int) -> str | None:
    """torchrun's rule: with nproc > 1 and OMP_NUM_THREADS unset, set it to 1 (and warn).

    Returns the warning text when it set the variable (the caller prints it), else None.
    Mutates `environ` like torchrun mutates ``os.environ``.
    """
    if C.OMP_NUM_THREADS in environ or nproc_per_node <= 1:
        return None
    environ[C.OMP_NUM_THREADS] = "1"
    return ("Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
            "to avoid your system being overloaded, please further tune the variable for "
            "optimal performance in your application as needed.")


def job_token_kv(token: str) -> str:
    return f"{C.LETO_JOB_TOKEN}={token}"

