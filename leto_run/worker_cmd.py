"""The command line of one worker, as torchrun builds it (run.py: config_from_args), and the
resolution of `--nproc-per-node`.  Pure functions of the config (and of the environment's
`PYTHON_EXEC`, torchrun's override of the interpreter, read only here)."""
from __future__ import annotations

import os
import sys
from typing import Mapping

from leto_run import limits as L
from leto_run.config import JobConfig
from leto_run.errors import ConfigError


def resolve_nproc(value: str) -> int:
    """Workers per node: the integer, or torchrun's resolution of auto | cpu | gpu.  Raises
    `ConfigError` when it does not resolve here (`gpu` without CUDA) or exceeds the bound."""
    if value.isdigit():
        return int(value)
    from torch.distributed.run import determine_local_world_size
    try:
        n = int(determine_local_world_size(value))
    except ValueError as e:
        raise ConfigError("launch.nproc_per_node", f"{value!r} does not resolve on this machine: "
                          f"{e}", "give a number of workers, or use cpu / auto") from None
    if not 0 < n <= L.MAX_NPROC_PER_NODE:
        raise ConfigError("launch.nproc_per_node", f"{value!r} resolves to {n} workers, outside "
                          f"1..{L.MAX_NPROC_PER_NODE}", "give a number of workers, e.g. 8")
    return n


def worker_argv(cfg: JobConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """torchrun's command line for one worker (run.py: config_from_args)."""
    la = cfg.launch
    python = (os.environ if env is None else env).get("PYTHON_EXEC") or sys.executable
    if la.run_path:
        code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        return [python, "-u", "-c", code, la.training_script, *la.script_args]
    if la.no_python:
        return [la.training_script, *la.script_args]
    argv = [python, "-u"]
    if la.module:
        argv.append("-m")
    return argv + [la.training_script, *la.script_args]
