"""`leto-run`: the command line (the console script's entry is `leto_run.entry:main`, which
re-executes for the fork server first and then calls `run_entry` here).

`leto-run [OPTIONS] TRAINING_SCRIPT [SCRIPT_ARGS]...` takes every torchrun option (dashed and
underscored spellings, `PET_*` environment equivalents) plus Leto's own.  Everything after
TRAINING_SCRIPT goes to the script untouched.  The click options are generated from
`leto_run.config_load.OPTIONS`; values arrive here as raw strings and are converted and validated
by `build_config`, so every bad value produces the same one-line `ConfigError` format.

Calling contract: `main()` parses, builds the `JobConfig`, checks this machine's side of it
(`leto_run.preflight`: paths, programs), then (lazily, so a broken agent can't break `--help`)
calls `leto_run.agent.run_job(cfg)` and exits with its return code.
`ConfigError` and click usage errors exit 2 with one line on stderr:
`leto-run: error: <key> (<source>): <problem> -- fix: <fix>`; other `LetoError`s exit with their
`.exit_code`.  Exit codes are defined in `leto_run.errors` only.
"""
from __future__ import annotations

import gc
import os
import secrets
import sys
from typing import Mapping

import click
from click.core import ParameterSource

from leto_run import config as C
from leto_run.config_load import INJECT_OPTION, OPTIONS, Option, build_config, default_of
from leto_run.errors import (EXIT_CONTROL_FORGED, EXIT_RESTARTS_EXHAUSTED, EXIT_UNRECOVERABLE,
                             EXIT_USAGE,
                             EXIT_WORKER_FAILED, ConfigError, LetoError)
from leto_run.preflight import preflight

PROG = "leto-run"
_TITLES = {
    "launch": "Launch (YAML section launch:)",
    "rendezvous": "Rendezvous (YAML section rendezvous:)",
    "logs": "Logs (YAML section logs:)",
    "recovery": "Recovery and failure injection (Leto; YAML recovery: and inject:)",
    "checkpoint": "Checkpoints and the fallback to them (Leto; YAML checkpoint:)",
    "compat": "Accepted for torchrun compatibility, not supported (non-default values are errors)",
    "other": "Other",
}
_DEFAULT_SHOWN = {"logs.log_dir": "a temp dir", "logs.status": "auto (when stdout is a TTY)",
                  "rendezvous.master_port": "29500 (one node: a free port)",
                  "rendezvous.local_addr": "FQDN",
                  "logs.events": "events.jsonl in the run's log directory (<log_dir>/<run id>_*/)",
                  "rendezvous.endpoint": "MASTER_ADDR:MASTER_PORT (static)"}
_EPILOG = f"""\
Precedence: defaults < YAML (--config, LETO_CONFIG) < environment (PET_* for torchrun options,
LETO_* for Leto's) < command line.  YAML key of an option: <section>.<name with underscores>
(e.g. launch.nproc_per_node), unless another "yaml:" key is shown.

\b
Examples:
  leto-run --nproc-per-node 2 train.py --lr 3e-4
  leto-run --config configs/restart_demo.yaml
  leto-run --standalone --nproc-per-node 4 --inject kill:rank=1:after=5s train.py
  leto-run --config job.yaml --print-config

\b
Exit codes: 0 success; {EXIT_WORKER_FAILED} a worker failed (no restart left);
{EXIT_USAGE} usage/config error (nothing started); {EXIT_RESTARTS_EXHAUSTED} failed again after
--max-restarts; {EXIT_UNRECOVERABLE} retained state unrecoverable; {EXIT_CONTROL_FORGED} a forged
control value (another user); 128+N stopped by signal N.
"""


def _compat(o: Option) -> bool:
    return o.key in C.UNSUPPORTED


def _help_record(o: Option) -> tuple[str, str]:
    flags = [f for f in o.flags if "_" not in f]          # underscored aliases: accepted, not shown
    names = ", ".join(flags)
    if o.metavar:
        names += f" {o.metavar}"
    extras = []
    if o.kind not in ("flag", "multiple"):
        default = _DEFAULT_SHOWN.get(o.key)
        if default is None:
            default = default_of(o.key)
            default = ",".join(map(str, default)) if isinstance(default, tuple) else default
        extras.append(f"default: {default if default not in ('', None) else 'none'}")
    if o.env:
        extras.append("env: " + " > ".join(o.env))
    if o.key != "inject" and o.key.split(".")[1] != o.dest:
        extras.append(f"yaml: {o.key}")
    return names, o.help + (f" [{'; '.join(extras)}]" if extras else "")


class LetoCommand(click.Command):
    """Grouped help, an exact usage line, and Leto's error-to-exit-code mapping in `main`."""

    def format_usage(self, ctx, formatter) -> None:
        formatter.write_usage(PROG, "[OPTIONS] TRAINING_SCRIPT [SCRIPT_ARGS]...")

    def format_options(self, ctx, formatter) -> None:
        groups: dict[str, list] = {k: [] for k in _TITLES}
        for o in OPTIONS + (INJECT_OPTION,):
            if o.kind == "positional":
                continue
            group = "compat" if _compat(o) else ("recovery" if o.key == "inject" else o.section)
            groups[group].append(_help_record(o))
        for p in self.get_params(ctx):
            if p.name in ("config", "print_config", "version", "build_kernels", "help"):
                groups["other"].append(p.get_help_record(ctx))
        for key, title in _TITLES.items():
            if groups[key]:
                with formatter.section(title):
                    formatter.write_dl(groups[key])

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name or PROG, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except ConfigError as e:
            code = _fail(str(e), e.exit_code)
        except click.UsageError as e:
            code = _fail(f"{e.format_message()} (see {PROG} --help)", EXIT_USAGE)
        except click.ClickException as e:
            code = _fail(e.format_message(), e.exit_code)
        except LetoError as e:
            code = _fail(str(e), e.exit_code)
        except (KeyboardInterrupt, click.Abort):
            code = _fail("interrupted", 128 + 2)
        if standalone_mode:
            sys.exit(code)
        return code


def _fail(message: str, code: int) -> int:
    from leto_run.console import CONSOLE
    CONSOLE.write(f"{PROG}: error: {message}\n")      # a closed console must not raise here
    return code


def _click_params() -> list[click.Parameter]:
    params: list[click.Parameter] = []
    for o in OPTIONS + (INJECT_OPTION,):
        if o.kind == "positional":
            continue
        if o.kind == "flag":
            params.append(click.Option([o.dest, *o.flags], is_flag=True, default=False, help=o.help))
        elif o.kind == "bool_pair":
            params.append(click.Option([o.dest, *o.flags], default=None, help=o.help))
        elif o.kind == "multiple":
            params.append(click.Option([o.dest, *o.flags], multiple=True, metavar=o.metavar,
                                       help=o.help))
        else:   # raw string; build_config converts, so errors name the option and the fix
            params.append(click.Option([o.dest, *o.flags], type=str, default=None,
                                       metavar=o.metavar, help=o.help))
    params += [
        click.Option(["config", "--config"], metavar="FILE", default=None,
                     help="YAML job config (env: LETO_CONFIG); see configs/full.yaml."),
        click.Option(["print_config", "--print-config"], is_flag=True, default=False,
                     help="Print the resolved configuration as a YAML job file (--config "
                          "accepts it) and exit."),
        click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True,
                     callback=_print_version, help="Print the versions of leto and torch and exit."),
        click.Option(["--build-kernels"], is_flag=True, expose_value=False, is_eager=True,
                     callback=_build_kernels,
                     help="Build (or find cached) every native kernel this machine can use, print "
                          "one line per kernel and exit: 0 when all usable ones are present, 1 "
                          "when a build failed (docs/KERNELS.md)."),
        click.Argument(["training_script"], required=False),
        click.Argument(["script_args"], nargs=-1, type=click.UNPROCESSED),
    ]
    return params


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version
    try:
        leto = version("leto")
    except PackageNotFoundError:      # a checkout on sys.path, not installed
        leto = "unknown (not installed)"
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    click.echo(f"{PROG} (leto) {leto}, torch {torch}, python {sys.version.split()[0]}")
    ctx.exit(0)


def _build_kernels(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from leto_runtime.kernel_build import build_all   # lazy: torch is imported only for this
    built = build_all()
    for b in built:
        click.echo(f"{PROG}: kernel {b.line()}")
    ctx.exit(1 if any(b.status == "failed" for b in built) else 0)


def _config(ctx: click.Context, params: dict, env: Mapping[str, str],
            sources: dict[str, str] | None = None) -> C.JobConfig:
    given = {name for name in params
             if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    return build_config(params, given, env, params.get("config"),
                        require_script=not params["print_config"], sources_out=sources)


def _run(ctx: click.Context, **params) -> int:
    env = (ctx.obj or {}).get("env", os.environ)
    sources: dict[str, str] = {}
    cfg = _config(ctx, params, env, sources)
    if params["print_config"]:
        from leto_run.config_print import render
        click.echo(render(cfg), nl=False)
        return 0
    # Paths, programs and knobs on this machine: checked before the agent starts anything.
    preflight(cfg, env, sources)
    entry = (ctx.obj or {}).get("process_entry")
    token = (ctx.obj or {}).get("reexec_token")
    if entry and not (ctx.obj or {}).get("reexec_tried"):
        _reexec_for_the_fork_server(cfg)        # returns only where it does not re-execute
    from leto_run.console import CONSOLE
    for w in cfg.warnings:
        CONSOLE.write(f"{PROG}: warning: {w}\n")        # a closed console must not stop the job
    from leto_run import agent_start
    start = agent_start.begin(cfg, os.environ, token) if entry else None
    from leto_run.agent import run_job   # lazy: the agent is not needed to parse or print config

    if entry:
        # The fork server as a fork of this process (its torch import is ours).  In the
        # forked child this raises a worker's SystemExit, which goes to the interpreter's top
        # level: nothing between here and there catches it.
        start = agent_start.with_server(start, cfg, os.environ)
        # The agent's own process (not a caller's, in-process): the imports' objects (torch's)
        # live as long as it does, so no collection walks them again, the exit's neither.
        gc.freeze()
    return int(run_job(cfg, start))


def _reexec_for_the_fork_server(cfg: C.JobConfig) -> None:
    """Re-execute this process with the job token and room for a worker's command line
    (`leto_run.fork_server.inherit`) where its fork server can be a fork of it."""
    from leto_run.agent_start import refusal
    from leto_run.fork_server import inherit
    if refusal(cfg, os.environ, reexecuted=False) is None:
        inherit.reexec(secrets.token_hex(12))


cli = LetoCommand(
    name=PROG,
    callback=click.pass_context(_run),
    params=_click_params(),
    help="Fault-tolerant, torchrun-compatible launcher for distributed PyTorch.\n\n"
         "Runs TRAINING_SCRIPT on every local worker with torchrun's environment; everything "
         "after TRAINING_SCRIPT is passed to it untouched.",
    epilog=_EPILOG,
    context_settings=dict(allow_interspersed_args=False, help_option_names=["-h", "--help"],
                          max_content_width=100),
)


def load_config(argv: list[str], env: Mapping[str, str] | None = None) -> C.JobConfig:
    """Parse `argv` (without the program name) like `leto-run` and build the config; no agent.

    Raises ConfigError or click.UsageError.  For tests and tools that want the resolved config.
    """
    ctx = cli.make_context(PROG, list(argv))
    return _config(ctx, dict(ctx.params), os.environ if env is None else env)


def main(argv: list[str] | None = None) -> None:
    """Parse, build the config, run the job, exit with its code.  `argv` given: a call
    in-process (the job runs, but the process is the caller's); else this process's entry
    (`leto_run.entry.main`, which the console script calls directly)."""
    if argv is not None:
        cli.main(args=argv, prog_name=PROG)
        return
    from leto_run import entry
    entry.main()


def run_entry(token: str | None, reexec_tried: bool) -> None:
    """The CLI as a process's entry (`leto_run.entry`): `token`, the job token this process
    was re-executed with (None: it was not); `reexec_tried`: it must not re-execute again."""
    cli.main(prog_name=PROG, obj={"process_entry": True, "reexec_token": token,
                                  "reexec_tried": reexec_tried})
