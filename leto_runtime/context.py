"""The one reader of the worker environment: `Context.from_env()`.

Everything a trainer needs to know about its place in the job and about the agent comes from
here; no other module of `leto_runtime` reads ``os.environ`` for contract variables.  Under a
plain ``torchrun`` (no LETO_* variables) the context still works: `under_leto` is False and the
Leto-specific features switch off.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from leto_runtime.wire import contract as C
from leto_runtime.control_auth import key_from_hex
from leto_runtime.wire.ckpt_files import Settings


class ContractError(RuntimeError):
    """The environment says Leto but does not match this runtime's contract version."""


@dataclass(frozen=True)
class Context:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    restart_count: int
    run_id: str
    under_leto: bool
    role: str                       # active | shadow ("active" outside Leto)
    generation: int
    run_dir: str | None
    heartbeat_socket: str | None
    hang_timeout: float
    recovery: str
    dump_signal: int
    inject_plan: tuple[dict, ...]
    sm_socket: str | None = None    # the state manager's socket (None: no memory pool)
    shadow_epoch: int = 0           # shadows of a generation restarted together get epoch + 1
    pg_timeout: float = 600.0       # seconds for process-group formation and store waits
    chunk_pages: int = 0            # RMU transaction size in pages (0: the runtime picks)
    demote: str = "replace"         # replace | release (what this active does when it survives a HOF)
    preinit_level: str = "L3"       # a shadow's preinitialization level (contract.PREINIT_LEVELS)
    warmup_room: int | None = None  # bytes a shadow's warm-up may take (None: the agent saw none)
    scrub_budget: float = 0.002     # share of the step time the background scrub may take (0: off)
    master_addr: str | None = None
    master_port: int | None = None
    job_key: bytes | None = field(default=None, repr=False)   # control values' MAC key
    error_file: str | None = None   # torchelastic's error file (TORCHELASTIC_ERROR_FILE)
    checkpoint: Settings | None = None     # periodic checkpoints (None: off)
    checkpoint_load: str | None = None       # a fallback's checkpoint to start from

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Context":
        env = os.environ if env is None else env
        under = C.LETO_CONTRACT_VERSION in env
        if under and env[C.LETO_CONTRACT_VERSION] != str(C.CONTRACT_VERSION):
            raise ContractError(
                f"{C.LETO_CONTRACT_VERSION}={env[C.LETO_CONTRACT_VERSION]} but this leto_runtime "
                f"speaks version {C.CONTRACT_VERSION}: install the same Leto version for the "
                "launcher and the trainers")

        def i(key: str, default: int = 0) -> int:
            return int(env.get(key, default))

        plan_text = env.get(C.LETO_INJECT_PLAN, "[]") if under else "[]"
        return cls(
            rank=i(C.RANK), local_rank=i(C.LOCAL_RANK), world_size=i(C.WORLD_SIZE, 1),
            local_world_size=i(C.LOCAL_WORLD_SIZE, 1), group_rank=i(C.GROUP_RANK),
            restart_count=i(C.TORCHELASTIC_RESTART_COUNT),
            run_id=env.get(C.TORCHELASTIC_RUN_ID, ""), under_leto=under,
            role=env.get(C.LETO_ROLE, "active"), generation=i(C.LETO_GENERATION),
            run_dir=env.get(C.LETO_RUN_DIR), heartbeat_socket=env.get(C.LETO_HEARTBEAT_SOCKET),
            hang_timeout=float(env.get(C.LETO_HANG_TIMEOUT, 0) or 0),
            recovery=env.get(C.LETO_RECOVERY, "restart"),
            dump_signal=i(C.LETO_DUMP_SIGNAL, C.DUMP_SIGNAL),
            inject_plan=tuple(json.loads(plan_text)),
            sm_socket=(env.get(C.LETO_SM_SOCKET) or None) if under else None,
            shadow_epoch=i(C.LETO_SHADOW_EPOCH),
            pg_timeout=float(env.get(C.LETO_PG_TIMEOUT, 600) or 600),
            chunk_pages=i(C.LETO_CHUNK_PAGES),
            error_file=env.get(C.TORCHELASTIC_ERROR_FILE) or None,
            demote=env.get(C.LETO_DEMOTE, "replace") if under else "replace",
            preinit_level=_preinit_level(env) if under else "L3",
            warmup_room=_warmup_room(env) if under else None,
            scrub_budget=float(env.get(C.LETO_SCRUB_BUDGET, 0.002) or 0) if under else 0.0,
            master_addr=env.get(C.MASTER_ADDR),
            master_port=int(env[C.MASTER_PORT]) if env.get(C.MASTER_PORT) else None,
            job_key=_job_key(env) if under else None,
            checkpoint=_checkpoint(env) if under else None,
            checkpoint_load=(env.get(C.LETO_CHECKPOINT_LOAD) or None) if under else None,
        )


def _checkpoint(env: Mapping[str, str]) -> Settings | None:
    d = env.get(C.LETO_CHECKPOINT_DIR)
    if not d:
        return None
    return Settings(directory=d, every_steps=int(env.get(C.LETO_CHECKPOINT_EVERY_STEPS, 0) or 0),
                    every_s=float(env.get(C.LETO_CHECKPOINT_EVERY_S, 0) or 0),
                    ff_mtbf=float(env.get(C.LETO_CHECKPOINT_FF_MTBF_S, 0) or 0),
                    keep=int(env.get(C.LETO_CHECKPOINT_KEEP, 2) or 2),
                    writer=env.get(C.LETO_CHECKPOINT_WRITER, "auto") or "auto")


def _preinit_level(env: Mapping[str, str]) -> str:
    level = env.get(C.LETO_PREINIT_LEVEL) or "L3"
    if level not in C.PREINIT_LEVELS:
        raise ContractError(f"{C.LETO_PREINIT_LEVEL}={level!r} is not one of "
                            f"{', '.join(C.PREINIT_LEVELS)}: the agent sets it; install the same "
                            "Leto version for the launcher and the trainers")
    return level


def _warmup_room(env: Mapping[str, str]) -> int | None:
    text = env.get(C.LETO_WARMUP_ROOM)
    if not text:
        return None
    if not text.isdigit():
        raise ContractError(f"{C.LETO_WARMUP_ROOM}={text!r} is not a number of bytes: the agent "
                            "sets it; install the same Leto version for the launcher and the "
                            "trainers")
    return int(text)


def _job_key(env: Mapping[str, str]) -> bytes | None:
    text = env.get(C.LETO_JOB_KEY)
    if not text:
        return None
    try:
        return key_from_hex(text)
    except ValueError as e:
        raise ContractError(f"{C.LETO_JOB_KEY}: {e}: install the same Leto version for the "
                            "launcher and the trainers") from None
