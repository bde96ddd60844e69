"""What the agent's process settles before the agent exists, and before its `import torch`.

The workers per node (a ``--nproc-per-node`` that does not resolve is exit 2 before anything
starts), torchrun's OMP_NUM_THREADS rule (before the import: a fork server forked from the
agent shares the agent's import with every worker, `leto_run.fork_server.inherit`), the job
token (the one this process was re-executed with, else a new one), and the fork server once
it is forked from the agent.

Calling contract: `begin(cfg, environ)` before the process imports torch (it sets
OMP_NUM_THREADS in `environ`, as torchrun sets it in ``os.environ``); `with_server` after the
agent's imports and before `Agent()`, in the agent's own process (leto_run.cli).
"""
from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, replace
from typing import MutableMapping

from leto_run.config import JobConfig
from leto_run.fork_server import inherit, preload
from leto_run.worker_cmd import resolve_nproc, worker_argv
from leto_run.worker_env import default_omp_threads, shared_env
from leto_runtime.wire import settings


@dataclass(frozen=True)
class AgentStart:
    nproc: int
    token: str
    omp_warning: str | None = None      # the agent prints it (torchrun's text)
    server: object = None               # client.ForkServer forked from this process
    server_note: str | None = None      # why the fork server is exec'd instead (None: forked)
    rule_before_torch: bool = False     # the OMP rule was applied before any `import torch`
    reexecuted: bool = False            # this process re-executed itself with `token`
    preload: preload.Plan = preload.Plan(preload.ALL, "")   # the server's imports after torch


def serves(cfg: JobConfig) -> bool:
    """Does this job have a fork server at all (LETO_FORK_SERVER not off, no --no-python)?"""
    return settings.get().fork_server != "off" and not cfg.launch.no_python


def refusal(cfg: JobConfig, environ, reexecuted: bool) -> str | None:
    """Why this agent's fork server cannot be a fork of it (`inherit.refusal`)."""
    mode = settings.get().fork_server
    if not serves(cfg):
        return "the fork server is off (LETO_FORK_SERVER=0, --no-python)"
    if mode == "exec":
        return "LETO_FORK_SERVER=exec"
    return inherit.refusal(inherit.original_argv(sys.orig_argv, reexecuted), sys.executable,
                           worker_argv(cfg, environ)[0], cfg.launch.nproc_per_node)


def begin(cfg: JobConfig, environ: MutableMapping[str, str],
          reexec_token: str | None = None) -> AgentStart:
    """`reexec_token`: the token this process re-executed itself with (`inherit.take_token`)."""
    before = "torch" in sys.modules
    nproc = resolve_nproc(cfg.launch.nproc_per_node)
    warning = default_omp_threads(environ, nproc)
    return AgentStart(nproc, reexec_token or secrets.token_hex(12), warning,
                      rule_before_torch=not before and "torch" not in sys.modules,
                      reexecuted=reexec_token is not None,
                      preload=_preload(cfg, environ))


def _preload(cfg: JobConfig, environ) -> preload.Plan:
    if not serves(cfg):
        return preload.Plan((), "no fork server")
    if settings.get().fork_preload == "all":
        return preload.Plan(preload.ALL, "LETO_FORK_PRELOAD=all")
    return preload.plan(worker_argv(cfg, environ), os.getcwd(), cfg.checkpoint.dir is not None)


def with_server(start: AgentStart, cfg: JobConfig, environ) -> AgentStart:
    """`start` with the fork server forked from this process, or with the reason it is not."""
    why = refusal(cfg, environ, start.reexecuted)
    if why is None and not start.reexecuted:
        why = "leto-run did not re-execute itself with the job token"
    if why is None and not start.rule_before_torch:
        why = "torch was imported before the OMP_NUM_THREADS rule"
    if why is not None:
        return replace(start, server_note=why)
    python = worker_argv(cfg, environ)[0]
    try:
        server = inherit.fork_server(python, shared_env(environ, start.token),
                                     start.preload.modules)
    except OSError as e:
        return replace(start, server_note=f"the fork failed: {e}")
    return replace(start, server=server)
