"""Every tuning knob, read from the environment in one place.

Role: the variables a user, a benchmark or a test sets to choose a code path or a size: the
RMU's paths (LETO_RMU_*), the memory pool's attach and repair paths (LETO_RMP_*), the parity
codec's (LETO_PARITY_*), activation lending (LETO_LEND*) and reclaiming (LETO_RECLAIM), the
agent's preinitialization controller (LETO_PREINIT_CONTROL, _HORIZON, _RAISE_HOLD), a waiting
shadow's context (LETO_SHADOW_STACK), the kernel cache (LETO_EXT_*) and the
state manager's (LETO_SM_*), the exit notice and fence (LETO_EXIT_NOTICE, LETO_EXIT_FENCE), the fork server
(LETO_FORK_SERVER, LETO_FORK_PRELOAD), and the toolchain variables the kernel builds honour (CXX,
CUDA_HOME, CUDA_PATH, PYTORCH_NVCC, TORCH_CUDA_ARCH_LIST, TORCH_EXTENSIONS_DIR, XDG_CACHE_HOME).
What the agent tells a trainer about its job (rank, generation,
sockets) is the env contract instead (`leto_runtime.wire.contract`, read by `context`).  Nothing else
in leto_runtime or leto_run reads these variables.

Each knob is typed and checked: a value out of its domain raises `SettingsError` naming the
variable, what is wrong and the fix (leto-run checks its own environment before anything
starts and exits 2).  An empty variable is unset, for every knob: it gets the default.  Defaults
are the measured best (docs/BENCHMARKS.md).

Calling contract:
    s = get()                  # the Settings of os.environ now (re-read only when it changed)
    s.rmu_wb_overlap, s.rmp_map_threads, ...
    Settings.from_env(env)     # of any mapping; raises SettingsError
    problems(env)              # [message] of every bad knob in env (leto-run's preflight)
    raw()                      # {variable: text} of the knobs that are set
`get()` compares the knobs' raw values with the last read, so a test that changes the
environment in process sees the change; a process that never does reads it once.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _given(env: Mapping[str, str], var: str) -> str | None:
    """The knob's text, or None when unset.  Empty (or blank) is unset, as for every environment
    variable torchrun and Leto's options read: `LETO_X=` gives the default, for every kind of
    knob (it turned a flag off but stopped leto-run for a count)."""
    raw = env.get(var)
    return None if raw is None or raw.strip() == "" else raw


class SettingsError(ValueError):
    """A tuning knob with a value out of its domain."""

    def __init__(self, var: str, raw: str, problem: str, fix: str):
        super().__init__(f"{var}={raw[:60]!r}: {problem} -- fix: {fix}")
        self.var, self.problem, self.fix = var, f"{raw[:60]!r} {problem}", fix


def _flag(var: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingsError(var, raw, "is not a yes/no value", "use 1 or 0 (or unset it)")


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        v = raw.strip()
        if v not in allowed:
            raise SettingsError(var, raw, "is not one of " + ", ".join(allowed),
                                f"use one of {', '.join(allowed)} (or unset it)")
        return v
    return parse


def _fork_server(var: str, raw: str) -> str:
    """auto (a yes value): forked from the agent where it can be, else exec'd; exec; off."""
    if raw.strip().lower() == "exec":
        return "exec"
    try:
        return "auto" if _flag(var, raw) else "off"
    except SettingsError:
        raise SettingsError(var, raw, "is not 1, 0 or exec",
                            "use 1 (the default), exec (an exec'd fork server) or 0 (none)") from None


def _count(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(var: str, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            v = lo - 1
        if not lo <= v <= hi:
            raise SettingsError(var, raw, f"is not a whole number in {lo}..{hi}",
                                f"use a number in {lo}..{hi} (or unset it)")
        return v
    return parse


def seconds(var: str, raw: str) -> float | None:
    """A number of seconds in (0, 604800]; "" is unset (None: the state manager's parser of its
    timeouts, which degrades a bad value to the default with a warning; `Settings` never passes
    "", see `_given`)."""
    if raw.strip() == "":
        return None
    try:
        v = float(raw.strip())
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 0 < v <= 7 * 86400):
        raise SettingsError(var, raw, "is not a number of seconds in (0, 604800]",
                            "use e.g. 30 (or unset it)")
    return v


def _text(var: str, raw: str) -> str:
    return raw


def _path_prefix(var: str, raw: str) -> str:
    if not raw.startswith("/") or len(raw) < 2:
        raise SettingsError(var, raw, "is not an absolute path prefix",
                            "use e.g. /dev/nvidia (or unset it)")
    return raw


def _auto_or_count(var: str, raw: str) -> int | None:
    """A whole number in 1..2^20, or "auto" / "" (None)."""
    return None if raw.strip().lower() in ("", "auto") else _count(1, 1 << 20)(var, raw)


def _optional_count(var: str, raw: str) -> int | None:
    return None if raw.strip() == "" else _count(0, 1 << 20)(var, raw)


def _bytes_or_off(var: str, raw: str) -> int | None:
    """Bytes in 0..1 MiB, or "off" (None)."""
    return None if raw.strip().lower() == "off" else _count(0, 1 << 20)(var, raw)


# field -> (variable, parser, default).  The default applies when the variable is unset or empty.
KNOBS: dict[str, tuple[str, Callable[[str, str], Any], Any]] = {
    # RMU (leto_runtime/rmu): docs/RMU.md
    "rmu_fused": ("LETO_RMU_FUSED", _flag, True),
    "rmu_fused_syndrome": ("LETO_RMU_FUSED_SYNDROME", _flag, True),
    "rmu_fused_layout": ("LETO_RMU_FUSED_LAYOUT", _text, "4x2x3"),      # checked by rmu.fused
    "rmu_fused_variant": ("LETO_RMU_FUSED_VARIANT", _optional_count, None),
    "rmu_stream_marker": ("LETO_RMU_STREAM_MARKER", _choice("kernel", "hostfunc", "1", "0"), "kernel"),
    "rmu_undo_pipeline": ("LETO_RMU_UNDO_PIPELINE", _flag, False),
    "rmu_fold": ("LETO_RMU_FOLD", _flag, True),             # the folded chunk (rmu/fold.py)
    # its stages per count: a fence every 1 or 4 stages (cuda/adamw_ws.cu; the count's meaning is
    # the same, so recovery does not change)
    "rmu_fold_batch": ("LETO_RMU_FOLD_BATCH", _choice("1", "4"), "1"),
    "rmu_wb_overlap": ("LETO_RMU_WB_OVERLAP", _flag, True),
    "rmu_lookahead": ("LETO_RMU_LOOKAHEAD", _count(0, 16), 1),     # chunks queued ahead (rmu/lookahead.py)
    # a waiting shadow's rehearsed update on scratch (leto_runtime/rmu/rehearsal.py)
    "rehearse": ("LETO_REHEARSE", _flag, True),
    # the device memory (MiB) a waiting shadow's warm-up may take (leto_runtime/warmup.py);
    # auto: the room the agent's preinitialization controller sees, else warmup.DEFAULT_MIB
    "warmup_mib": ("LETO_WARMUP_MIB", _auto_or_count, None),
    "plain_rmu": ("LETO_PLAIN_RMU", _flag, False),      # job.optimizer in plain mode: RMU, not torch
    "lend": ("LETO_LEND", _flag, True),
    "lend_warmup": ("LETO_LEND_WARMUP", _count(0, 1 << 20), 0),
    # a lent allocation that would OOM asks the agent to lower the shadows first (docs/PREINIT.md)
    "reclaim": ("LETO_RECLAIM", _flag, True),
    # the agent's preinitialization controller (leto_run/preinit_control.py): docs/PREINIT.md
    "preinit_control": ("LETO_PREINIT_CONTROL", _flag, True),
    "preinit_horizon": ("LETO_PREINIT_HORIZON", seconds, 30.0),
    "preinit_raise_hold": ("LETO_PREINIT_RAISE_HOLD", seconds, 60.0),
    # a waiting shadow's per-thread stack limit (leto_runtime/ctx_limits.py): bytes, or off
    "shadow_stack": ("LETO_SHADOW_STACK", _bytes_or_off, 0),
    # parity codec (leto_runtime/parity): docs/PARITY.md
    "parity_delta": ("LETO_PARITY_DELTA", _choice("auto", "pagewise", "syndrome"), "auto"),
    "parity_cuda_variant": ("LETO_PARITY_CUDA_VARIANT", _text, "auto"),  # checked by the extension
    # memory pool client (leto_runtime/rmp): docs/MEMORY.md
    "rmp_map": ("LETO_RMP_MAP", _choice("native", "python"), "native"),
    "rmp_map_threads": ("LETO_RMP_MAP_THREADS", _count(1, 256), 1),
    "rmp_map_batch": ("LETO_RMP_MAP_BATCH", _count(1, 1 << 20), 1024),
    "rmp_grant_once": ("LETO_RMP_GRANT_ONCE", _flag, False),
    "rmp_probe_threads": ("LETO_RMP_PROBE_THREADS", _count(1, 256), 1),
    "rmp_reconstruct_path": ("LETO_RMP_RECONSTRUCT_PATH", _choice("auto", "staged"), "auto"),
    # the kernel cache (leto_runtime/wire/kernel_cache.py): docs/KERNELS.md
    "ext_dir": ("LETO_EXT_DIR", _text, None),
    "ext_verbose": ("LETO_EXT_VERBOSE", _flag, False),
    # the state manager (leto_run/state_manager): docs/MEMORY.md
    "sm_idle_timeout": ("LETO_SM_IDLE_TIMEOUT", seconds, None),
    "sm_send_stall": ("LETO_SM_SEND_STALL", seconds, None),
    "sm_fault_emulation": ("LETO_SM_FAULT_EMULATION", _choice("truncate", "retire"), "truncate"),
    # the agent learns of an abrupt death as its exit begins (leto_run/exit_notice.py)
    "exit_notice": ("LETO_EXIT_NOTICE", _flag, True),
    # ... and, with a GPU, when its device work stopped: "auto" (the fence, on a machine with
    # an NVIDIA device), "on" (as if it had one: the CPU tests of the fence), "off" (the reap)
    "exit_fence": ("LETO_EXIT_FENCE", _choice("auto", "on", "off"), "auto"),
    # ... or, sooner, when its update's drain words prove its queued device work done
    # (leto_runtime/drain.py); 0: the fence alone
    "exit_drain": ("LETO_EXIT_DRAIN", _flag, True),
    # workers forked from a process that imported torch already (leto_run/fork_server): the
    # server a fork of the agent where it can be (auto), always exec'd (exec), or none (off)
    "fork_server": ("LETO_FORK_SERVER", _fork_server, "auto"),
    # what the server imports after torch: what the training script's code uses (auto,
    # leto_run/fork_server/preload.py), or all of it, as for a script it cannot read (all)
    "fork_preload": ("LETO_FORK_PRELOAD", _choice("auto", "all"), "auto"),
    # the path prefix of a GPU's device files: what the fence must sit below, and what marks a
    # stray process that may still run a dead trainer's GPU work (tests point it at own files)
    "device_files": ("LETO_DEVICE_FILES", _path_prefix, "/dev/nvidia"),
    # the toolchain the kernels are built with (the ecosystem's own variables, read here too)
    "cxx": ("CXX", _text, None),
    "cuda_home": ("CUDA_HOME", _text, None),
    "cuda_path": ("CUDA_PATH", _text, None),
    "pytorch_nvcc": ("PYTORCH_NVCC", _text, None),
    "torch_cuda_arch_list": ("TORCH_CUDA_ARCH_LIST", _text, ""),
    "torch_extensions_dir": ("TORCH_EXTENSIONS_DIR", _text, None),
    "xdg_cache_home": ("XDG_CACHE_HOME", _text, None),
}
VARIABLES = tuple(var for var, _, _ in KNOBS.values())


@dataclass(frozen=True)
class Settings:
    rmu_fused: bool
    rmu_fused_syndrome: bool
    rmu_fused_layout: str
    rmu_fused_variant: int | None
    rmu_stream_marker: str
    rmu_undo_pipeline: bool
    rmu_fold: bool
    rmu_fold_batch: str
    rmu_wb_overlap: bool
    rmu_lookahead: int
    rehearse: bool
    warmup_mib: int | None
    plain_rmu: bool
    lend: bool
    lend_warmup: int
    reclaim: bool
    preinit_control: bool
    preinit_horizon: float | None
    preinit_raise_hold: float | None
    shadow_stack: int | None
    parity_delta: str
    parity_cuda_variant: str
    rmp_map: str
    rmp_map_threads: int
    rmp_map_batch: int
    rmp_grant_once: bool
    rmp_probe_threads: int
    rmp_reconstruct_path: str
    ext_dir: str | None
    ext_verbose: bool
    sm_idle_timeout: float | None
    sm_send_stall: float | None
    sm_fault_emulation: str
    exit_notice: bool
    exit_fence: str
    exit_drain: bool
    fork_server: bool
    fork_preload: str
    device_files: str
    cxx: str | None
    cuda_home: str | None
    cuda_path: str | None
    pytorch_nvcc: str | None
    torch_cuda_arch_list: str
    torch_extensions_dir: str | None
    xdg_cache_home: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        out = {}
        for name, (var, parse, default) in KNOBS.items():
            raw = _given(env, var)
            out[name] = default if raw is None else parse(var, raw)
        return cls(**out)


assert [f.name for f in fields(Settings)] == list(KNOBS), "Settings and KNOBS disagree"


def problems(env: Mapping[str, str]) -> list[str]:
    """One message per knob in `env` whose value is out of its domain."""
    out = []
    for var, parse, _ in KNOBS.values():
        if _given(env, var) is not None:
            try:
                parse(var, env[var])
            except SettingsError as e:
                out.append(str(e))
    return out


def raw() -> dict[str, str]:
    """The knobs set (not empty) in os.environ, unparsed (for a reader that degrades a bad value
    to its default with a warning instead of stopping: the state manager's idle timeout)."""
    return {v: os.environ[v] for v in VARIABLES if _given(os.environ, v) is not None}


_last: tuple[tuple, Settings] | None = None


def get() -> Settings:
    """The knobs of os.environ now (see the module docstring)."""
    global _last
    raw = tuple(os.environ.get(v) for v in VARIABLES)
    hit = _last
    if hit is None or hit[0] != raw:
        hit = _last = (raw, Settings.from_env(os.environ))
    return hit[1]


def visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as the process sees it (the agent maps a local rank's device to the
    driver's index with it: `leto_run.nvml`)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
