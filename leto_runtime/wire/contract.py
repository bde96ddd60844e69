"""The launcher <-> trainer wire contract: every environment variable name, in one place.

`leto_run.worker_env.build_worker_env` is the only writer of these variables and
`leto_runtime.context.Context.from_env` the only reader.  Both import the names from here so
that a rename is one edit.  `leto_runtime` never imports `leto_run`; this module is the bridge.

torchrun's own variables (RANK, WORLD_SIZE, ...) are part of the contract too: Leto sets
exactly what torchrun sets, with the same meaning (docs/COMPATIBILITY.md, "The worker
environment").
"""
from __future__ import annotations

# ---- torchrun's worker environment (same names, same meaning) -----------------------------
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_NAME = "ROLE_NAME"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
# In a trainer's error file, extraInfo[SCRIPT_ERROR_KEY] = true: a leto_runtime.errors.ScriptError
# (a problem of the script that repeats in every generation, never a HOF).
SCRIPT_ERROR_KEY = "leto_script_error"
TORCHELASTIC_SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
TORCH_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# torch's opt-out of sharing the rendezvous store with the workers: the agent sets it for its
# own handlers (leto_run.rendezvous); it is not passed on to the workers.
TORCH_SHARE_RDZV_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

TORCHRUN_KEYS = (
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
    ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
    TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, TORCHELASTIC_SIGNALS_TO_HANDLE,
    TORCH_NCCL_ASYNC_ERROR_HANDLING,
)

# ---- Leto's own contract (all prefixed LETO_) ---------------------------------------------
LETO_CONTRACT_VERSION = "LETO_CONTRACT_VERSION"   # bumped on any incompatible change
LETO_ROLE = "LETO_ROLE"                           # slot role of this process: active | shadow
LETO_GENERATION = "LETO_GENERATION"               # recovery generation (0 at launch)
LETO_ATTEMPT = "LETO_ATTEMPT"                     # restart-mode attempt (== TORCHELASTIC_RESTART_COUNT)
LETO_RUN_DIR = "LETO_RUN_DIR"                     # private 0700 per-job directory (sockets live here)
LETO_HEARTBEAT_SOCKET = "LETO_HEARTBEAT_SOCKET"   # AF_UNIX datagram socket of the agent
LETO_EXIT_NOTICE_FD = "LETO_EXIT_NOTICE_FD"       # the exit-notice page (wire/exit_page.py)
LETO_EXIT_FENCE_FD = "LETO_EXIT_FENCE_FD"         # GPU machines: the exit fence pipe's write end (leto_run/exit_notice.py)
LETO_HANG_TIMEOUT = "LETO_HANG_TIMEOUT"           # seconds; 0 disables hang detection
LETO_INJECT_PLAN = "LETO_INJECT_PLAN"             # JSON list of this rank's step-triggered injections
LETO_RECOVERY = "LETO_RECOVERY"                   # inplace | restart
LETO_NODE = "LETO_NODE"                           # host name the agent reports for this node
LETO_JOB_TOKEN = "LETO_JOB_TOKEN"                 # random per leto-run; marks every descendant for cleanup
# equal to LETO_JOB_TOKEN in an agent that re-executed itself with it (leto_run/fork_server/inherit.py)
LETO_AGENT_EXEC = "LETO_AGENT_EXEC"
LETO_DUMP_SIGNAL = "LETO_DUMP_SIGNAL"             # signal number that makes the runtime dump Python stacks
LETO_SM_SOCKET = "LETO_SM_SOCKET"                 # this rank slot's state-manager socket (Resilient Memory Pool)
LETO_SHADOW_EPOCH = "LETO_SHADOW_EPOCH"           # shadows of one generation restarted together get a new epoch
LETO_PG_TIMEOUT = "LETO_PG_TIMEOUT"               # seconds: process-group / store waits of the runtime
LETO_CHUNK_PAGES = "LETO_CHUNK_PAGES"             # RMU transaction size in pages (0: the runtime picks)
LETO_DEMOTE = "LETO_DEMOTE"                       # replace | release: what a surviving active of a HOF does
# bytes a shadow's warm-up may take, from the agent's view of the device (unset: no view)
LETO_WARMUP_ROOM = "LETO_WARMUP_ROOM"
LETO_PREINIT_LEVEL = "LETO_PREINIT_LEVEL"         # L1 | L2 | L3: how far a shadow preinitializes before its promotion
LETO_JOB_KEY = "LETO_JOB_KEY"                     # hex, 32 bytes: MAC key of the control values in the job's stores (leto_runtime.control_auth)
LETO_SCRUB_BUDGET = "LETO_SCRUB_BUDGET"           # share of the step time the background scrub may take (0: off)
LETO_CHECKPOINT_DIR = "LETO_CHECKPOINT_DIR"       # --checkpoint-dir: where rank 0 writes periodic checkpoints (unset: off)
LETO_CHECKPOINT_EVERY_STEPS = "LETO_CHECKPOINT_EVERY_STEPS"   # checkpoint at multiples of this step (0: not by steps)
LETO_CHECKPOINT_EVERY_S = "LETO_CHECKPOINT_EVERY_S"   # seconds between checkpoints (0: not by time)
LETO_CHECKPOINT_FF_MTBF_S = "LETO_CHECKPOINT_FF_MTBF_S"   # seconds between non-HOF failures: Young's interval (0: not used)
LETO_CHECKPOINT_KEEP = "LETO_CHECKPOINT_KEEP"     # complete checkpoints kept
LETO_CHECKPOINT_WRITER = "LETO_CHECKPOINT_WRITER"   # auto (the shadow snapshots) | shadow (waits for one) | trainer
LETO_CHECKPOINT_LOAD = "LETO_CHECKPOINT_LOAD"     # a fallback: the complete checkpoint this attempt starts from
CHECKPOINT_ENV_PREFIX = "LETO_CHECKPOINT_"        # every one of them is set by the agent alone

CONTRACT_VERSION = 2   # 2: store values carry the job's MAC (LETO_JOB_KEY)

# ---- Signals the agent sends to runtime-enabled trainers ------------------------------------
# Real-time signals: no user code or library claims them, and their default action (terminate)
# is what a plain script without the runtime gets, which the agent never relies on.
import signal as _signal  # noqa: E402

DUMP_SIGNAL = int(_signal.SIGRTMIN) + 2   # faulthandler dumps every thread's Python stack
HANG_SIGNAL = int(_signal.SIGRTMIN) + 3   # injected hang: the runtime blocks the main thread
DEMOTE_SIGNAL = int(_signal.SIGRTMIN) + 4  # demote=release: a surviving active becomes a shadow
PROMOTE_SIGNAL = int(_signal.SIGRTMIN) + 5  # the go key of a ready shadow is set: look now


def demoted_env(generation: int) -> dict[str, str]:
    """The contract variables a demoted active rewrites in its own environment: it is now the
    shadow of `generation` (the HOF's g + 2), epoch 0 -- exactly what the agent gives a fresh
    shadow of that generation (`leto_run.worker_env`), so `Context.from_env()` reads the same."""
    return {LETO_ROLE: "shadow", LETO_GENERATION: str(generation), LETO_SHADOW_EPOCH: "0"}

# ---- In-place recovery protocol (docs/ARCHITECTURE.md; keys: docs/PROTOCOL.md) -------------
# Keys live in the job's worker store (MASTER_ADDR/MASTER_PORT, a TCPStore the agents host).
# Every value in it is signed with the job's key (LETO_JOB_KEY, `leto_runtime.auth_store`); a
# value that does not verify is never acted on.
# Every key carries the generation, so a process of an old generation can never act in a new one.
#
#   leto/g{G}/e{E}/pg/...     process group of the trainers of generation G (shadow epoch E):
#                             shadows of G form it at preinit level L3, while generation G-1 trains
#   leto/hof/{g}              set (first writer wins) by the agent that declares a HOF of
#                             generation g; value JSON {"rank", "how", "node", "mono"}.  Agents of
#                             other nodes wait on it.
#   leto/go/{G}/{rank}        set by the agent that owns `rank` once every process of an older
#                             generation of that rank is gone (it never writes retained memory
#                             again); the shadow of generation G waits for it, then takes over.
def pg_prefix(generation: int, epoch: int = 0) -> str:
    return f"leto/g{generation}/e{epoch}/pg"


# How far a shadow preinitializes (docs/PREINIT.md): L1 imports (no CUDA context), L2 + the
# device context, L3 + the process group of its generation.  Below L3 it waits for its go key in
# `leto_runtime.init()` and brings the missing levels up after it.
PREINIT_LEVELS = ("L1", "L2", "L3")


def preinit_ack_key(generation: int, rank: int, step: int) -> str:
    """Set by the agent once the shadows an injected `preinit` level change (fired by the active
    of `generation`, `rank` at `step`) started are ready; the active waits for it."""
    return f"leto/inject/preinit/{generation}/{rank}/{step}"


def hof_key(generation: int) -> str:
    return f"leto/hof/{generation}"


def go_key(generation: int, rank: int) -> str:
    return f"leto/go/{generation}/{rank}"


# Named points inside the runtime where step-triggered injections can fire (`at=POINT`).
# "step" is the start of the step (leto_runtime.heartbeat); the rmu.* points are the operations of
# Pseudocode 1 (before the operation runs; rmu.settle: everything queued, before the host waits
# for it, and rmu.lookahead: chunk j queued, before the host waits for chunk j - LETO_RMU_LOOKAHEAD
# on CUDA -- deaths there are ones the drain words prove, leto_runtime/drain.py); recovery.* are
# phases of a promoted trainer.
INJECT_POINTS = (
    "step", "forward", "backward", "grads.allreduce", "grads.protect", "sync", "sync.after",
    "rmu.load", "rmu.undo", "rmu.update", "rmu.delta", "rmu.commit", "rmu.writeback",
    "rmu.tier2", "rmu.writeback.drop", "rmu.done", "rmu.settle", "rmu.lookahead",
    "recovery.localize", "recovery.reconstruct", "recovery.finish",
    "checkpoint.write",     # rank 0's checkpoint writer, its files written, the manifest not yet
    "checkpoint.snapshot",  # rank 0's shadow: its copy of the state taken, not yet claimed
)

# A trainer whose retained state cannot be recovered in place (more page losses than the parity
# tolerates, state manager and kept fds lost) exits with this code after writing its error file;
# the agent then falls back to the newest complete checkpoint (`--checkpoint-dir`), or ends the
# job with `leto_run.errors.EXIT_UNRECOVERABLE` when there is none.
UNRECOVERABLE_EXIT = 86

# ---- Heartbeat datagram (JSON, one object per datagram) ------------------------------------
# {"v": 1, "kind": KIND, "rank": int, "role": str, "gen": int, "pid": int,
#  "step": int | null, "detail": str | null}
# KIND: beat | register | inject | unfired | bye, and for in-place recovery:
#   inject    an injection fires now (detail: its spec text; step: the step it fires in)
#   unfired   an injection of this trainer's plan can never fire (detail JSON {"spec": text,
#             "reason": why}, e.g. an rmu.* point naming a group or chunk the model lacks)
#   inplace   the trainer called leto_runtime.init(): in-place mode for its slot (detail: JSON
#             {"level": "L1"|"L2"|"L3", "seconds": preinit seconds} from a shadow that is ready)
#   reclaim   an active's allocation would run out of device memory after torch released its
#             cache (detail: the request's bytes, decimal); sent by cuda/lend_alloc.cpp, which
#             waits for the agent to lower the local shadows (docs/PREINIT.md)
#   promoted  a shadow woke up as the active of its generation (detail JSON {"mono": wake time})
#   phase     one recovery phase finished (detail JSON {"phase": NAME, "seconds": s, ...});
#             NAME in bringup | attach | localize | reconstruct | agree | finish | resume
#   demoted   (demote=release) a surviving active released its GPU memory and process group and
#             is now the shadow of generation g+2 (detail JSON {"seconds": signal to released,
#             "mono", "generation", "gpu_reserved_before", "gpu_reserved_after", "views_alive"})
#   forged    a value in the job's store did not verify with the job's key; the runtime did not
#             act on it (detail JSON {"key": name, "reason": why}); the agent stops the job
HEARTBEAT_VERSION = 1
HEARTBEAT_MAX_BYTES = 4096
