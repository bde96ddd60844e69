"""The command line of one worker, as torchrun builds it (run.py: config_from_args), and the
resolution of `--nproc-per-node`.  Pure functions of the config."""
from __future__ import annotations

import os
import sys

from leto_run.config import JobConfig


def resolve_nproc(value: str) -> int:
    from torch.distributed.run import determine_local_world_size
    return int(determine_local_world_size(value))


def worker_argv(cfg: JobConfig) -> list[str]:
    """torchrun's command line for one worker (run.py: config_from_args)."""
    la = cfg.launch
    if la.run_path:
        code = ("import runpy, sys; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        return [os.getenv("PYTHON_EXEC", sys.executable), "-u", "-c", code,
                la.training_script, *la.script_args]
    if la.no_python:
        return [la.training_script, *la.script_args]
    argv = [os.getenv("PYTHON_EXEC", sys.executable), "-u"]
    if la.module:
        argv.append("-m")
    return argv + [la.training_script, *la.script_args]
