"""A forked worker runs its command line as ``python -u <args>`` would.

The three forms torchrun builds (`leto_run.worker_cmd`): a script path (a file, or a directory
or zip file with a ``__main__.py``), ``-m module`` and ``-c code``.  What the interpreter sets
up for each is set up here: ``sys.argv``, ``sys.path[0]`` (the script's real directory, the
working directory, or ""), a fresh ``__main__`` module (``__file__``, ``__loader__``,
``__cached__``; runpy's own for modules and directories), an unhandled exception printed by
``sys.excepthook`` with exit status 1 (a KeyboardInterrupt: death by SIGINT after the exit
functions),
a script that cannot be opened reported as the interpreter reports it, with status 2.

Calling contract: `run(args)` once, in a worker `server` set up; it ends in `sys.exit` or
raises what the user's code raised.
"""
from __future__ import annotations

import atexit
import builtins
import os
import runpy
import signal
import sys
import types
import zipfile
from importlib.machinery import BuiltinImporter, SourceFileLoader


def run(args: list[str]) -> None:
    head, rest = args[0], args[1:]
    if head == "-c":
        sys.argv = ["-c", *rest[1:]]
        sys.path.insert(0, "")
        _exec_main(rest[0], "<string>", BuiltinImporter)
    elif head == "-m":
        sys.argv = ["-m", *rest[1:]]
        sys.path.insert(0, os.getcwd())
        _guarded(lambda: runpy._run_module_as_main(rest[0]))
    else:
        sys.argv = [head, *rest]
        path = os.path.join(os.getcwd(), head)      # the interpreter's: joined, not normalized
        if os.path.isdir(head) or zipfile.is_zipfile(head):
            sys.path.insert(0, path)
            _guarded(lambda: runpy._run_module_as_main("__main__", alter_argv=False))
        try:
            with open(head, "rb") as f:
                source = f.read()
        except OSError as e:
            sys.stderr.write(f"{sys.executable}: can't open file {path!r}: "
                             f"[Errno {e.errno}] {e.strerror}\n")
            sys.exit(2)
        sys.path.insert(0, os.path.dirname(os.path.realpath(head)))
        _exec_main(source, path, SourceFileLoader("__main__", path))
    sys.exit(0)


def _exec_main(source, path: str, loader) -> None:
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={}, __loader__=loader)
    if loader is not BuiltinImporter:
        main.__dict__.update(__file__=path, __cached__=None)
    sys.modules["__main__"] = main
    _guarded(lambda: exec(compile(source, path, "exec"), main.__dict__))


def _guarded(body) -> None:
    """Run `body` as the interpreter runs `__main__`: an unhandled exception goes to
    sys.excepthook without this module's frames, then exit status 1 -- or, for a
    KeyboardInterrupt, the exit functions run and the process dies of SIGINT."""
    try:
        body()
    except SystemExit:
        raise
    except BaseException as e:                      # noqa: BLE001
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)
    sys.exit(0)
