"""Leto's error taxonomy and the exit codes the CLI maps them to (the only place codes live).

| code | meaning |
|------|---------|
| 0    | every worker succeeded |
| 1    | a worker failed and no restart was allowed (torchrun's code) |
| 2    | usage or configuration error: nothing was started |
| 3    | gave up: the group failed again after `--max-restarts` restarts |
| 4    | unrecoverable retained state (in-place recovery impossible) and no checkpoint to fall back to |
| 5    | a forged control value, or a role its agent did not grant: the job was stopped |
| 128+N| `leto-run` itself was stopped by signal N (after stopping every worker) |
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
EXIT_RESTARTS_EXHAUSTED = 3
EXIT_UNRECOVERABLE = 4
EXIT_CONTROL_FORGED = 5


class LetoError(Exception):
    """Base of every error Leto raises on purpose; carries its exit code."""

    exit_code = EXIT_WORKER_FAILED


class ConfigError(LetoError):
    """Bad CLI option, YAML key, environment value or inject spec.  Raised before anything starts.

    `key` is the dotted config key (``launch.nnodes``) or option; `source` says where the value
    came from (``job.yaml:12``, ``--nnodes``, ``PET_NNODES``); `fix` tells the user what to do.
    """

    exit_code = EXIT_USAGE

    def __init__(self, key: str, problem: str, fix: str = "", source: str | None = None):
        self.key, self.problem, self.fix, self.source = key, problem, fix, source
        where = f" ({source})" if source else ""
        msg = f"{key}{where}: {problem}"
        if fix:
            msg += f" -- fix: {fix}"
        super().__init__(msg)


class RendezvousFailed(LetoError):
    """The rendezvous did not complete (timeout, closed, unreachable store)."""


class WorkersFailed(LetoError):
    """The worker group failed and no restart remains; `failures` are ProcessFailure records."""

    def __init__(self, message: str, failures=(), exhausted: bool = False):
        super().__init__(message)
        self.failures = list(failures)
        self.exit_code = EXIT_RESTARTS_EXHAUSTED if exhausted else EXIT_WORKER_FAILED


class Unrecoverable(LetoError):
    """Retained state cannot be reused; in-place recovery is impossible."""

    exit_code = EXIT_UNRECOVERABLE


class ControlForged(LetoError):
    """A control value in the job's stores did not verify with the job's key, or a process
    took a role its agent did not grant (`leto_run.job_secret`): the job is stopped, nothing
    acted on the value."""

    exit_code = EXIT_CONTROL_FORGED


class StoppedBySignal(LetoError):
    """`leto-run` received a terminating signal and stopped the job."""

    def __init__(self, signum: int):
        import signal as _s

        super().__init__(f"stopped by {_s.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum
