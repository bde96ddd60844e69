"""The process entry of `leto-run` (console script) and `python -m leto_run`: the re-execution
for the fork server first, then the CLI.

Why here, before the CLI's imports: the agent's fork server is a fork of the agent only where
the agent's process was exec'd with the job token and room for a worker's command line
(`leto_run.fork_server.inherit`).  Made after the CLI had imported click and built the config,
that exec cost an interpreter start plus those imports and the config a second time; made
here it costs the interpreter start alone (docs/BENCHMARKS.md, "Launcher overhead").  What can
be told without the config decides it (`early_refusal`: a pure function of the command line,
the environment and the interpreter); where it cannot tell (no job on the command line, a
setting it cannot read) the CLI decides after the config, as before (`leto_run.cli._run`),
and where it re-executed in vain (a YAML's non-numeric nproc_per_node) the agent's refusal
says why its fork server is exec'd instead.

Calling contract: `main()` only as a process's entry; in-process callers use
`leto_run.cli.main(argv)`.  Exits as the CLI does.
"""
from __future__ import annotations

import os
import secrets
import sys
from typing import Mapping, Sequence

# Options that make a run without a job (help, version, the printed config, kernel builds):
# the CLI handles them without re-executing.
NO_JOB = frozenset(("-h", "--help", "--version", "--print-config", "--print_config",
                    "--build-kernels", "--build_kernels"))
NO_PYTHON = frozenset(("--no-python", "--no_python"))


def early_refusal(argv: Sequence[str], environ: Mapping[str, str], orig_argv: Sequence[str],
                  executable: str, fork_server: str | None) -> str | None:
    """Why not to re-execute before the config is built (None: re-execute).  `argv`: sys.argv;
    `fork_server`: the LETO_FORK_SERVER setting, None where it did not parse (the CLI then
    reports it).  A flag of the list seen anywhere (a script argument too) only defers the
    decision to the CLI."""
    from leto_run.fork_server import inherit
    if fork_server is None:
        return "LETO_FORK_SERVER does not parse: the CLI says why"
    if fork_server != "auto":
        return f"LETO_FORK_SERVER={fork_server}"
    args = set(argv[1:])
    if args & NO_JOB:
        return "no job, or not sure: the CLI decides after the config"
    if args & NO_PYTHON:
        return "--no-python"
    # the workers' interpreter as leto_run.worker_cmd picks it
    return (inherit.python_refusal(executable, environ.get("PYTHON_EXEC") or executable)
            or inherit.interpreter_options(orig_argv))


def _fork_server_setting() -> str | None:
    from leto_runtime.wire import settings
    try:
        return settings.get().fork_server
    except settings.SettingsError:
        return None


def main() -> None:
    from leto_run.fork_server import inherit
    token, marked = inherit.take_token(os.environ)
    if token is not None and inherit.strip_padding(sys.argv):
        inherit.retitle(inherit.original_argv(sys.orig_argv, reexecuted=True))
    else:
        token = None            # not re-executed by us (a marker without the padding is not)
        if not marked and early_refusal(sys.argv, os.environ, sys.orig_argv, sys.executable,
                                        _fork_server_setting()) is None:
            inherit.reexec(secrets.token_hex(12))     # returns only where the exec failed
            marked = True                             # ... and the CLI must not try again
    from leto_run import cli
    cli.run_entry(token, marked)
