"""A test fork server: Python scripts started as fresh processes forked from one process that
has already imported torch and leto_runtime (tests/integration/test_rmu_crash.py runs 90 of
them).  Imported as `from leto_forkserver import ForkServer` (tests/ is on sys.path)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from leto_testing import ROOT

_FORKSERVER = r"""
import importlib, json, os, runpy, sys, traceback
replies = os.fdopen(os.dup(1), "w", buffering=1)
for name in sys.argv[1:]:
    importlib.import_module(name)
for line in sys.stdin:
    r = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            replies.close()
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, r["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, r["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                f = os.open(path, flags, 0o600)
                os.dup2(f, fd)
                os.close(f)
            os.environ.clear()
            os.environ.update(r["env"])
            os.chdir(r["cwd"])
            sys.argv = [r["script"], *r["args"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(r["script"])))
            try:
                runpy.run_path(r["script"], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class ForkServer:
    """Starts Python scripts as fresh processes forked from one process that has already
    imported `preload` (torch, leto_runtime...): a real process each -- its own pid, memory
    and fds, killed by real signals, exit status as `subprocess` reports it -- without paying
    the ~2 s import of torch each time (tests/integration/test_rmu_crash.py runs 90 of them).

    The script runs as `python SCRIPT ARGS` would (runpy, `__main__`, the given env and cwd,
    stdin /dev/null).  The preloaded modules must not read per-run settings at import: the
    child's environment is set after they were imported (LETO_* options are read when used).
    One script at a time; the server goes when its stdin closes (`close()`, or our death)."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None):
        import tempfile

        self.tmp, self.n = Path(tempfile.mkdtemp(prefix="leto-forkserver-")), 0
        self.proc = subprocess.Popen([sys.executable, "-c", _FORKSERVER, *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=str(ROOT), text=True)

    def _reply(self, deadline: float, pid: int | None = None) -> dict:
        import select
        import time

        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                if pid is not None:
                    os.kill(pid, 9)                 # a hung child: kill it, then read its end
                    return {"pid": pid, **json.loads(self.proc.stdout.readline()),
                            "timed_out": True}
                raise TimeoutError("the fork server did not start the script")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
            return json.loads(line)

    def run(self, script: str, args: list[str], env: dict[str, str], *, timeout: float,
            on_start=None) -> tuple[int, str, str]:
        """(returncode, stdout, stderr) of `script ARGS`; `on_start(pid)` once it exists."""
        import time

        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        req = {"script": script, "args": list(args), "env": dict(env), "cwd": os.getcwd(),
               "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._reply(deadline)["pid"]
        if on_start is not None:
            on_start(pid)
        end = self._reply(deadline, pid)
        text = out.read_text(), err.read_text()
        out.unlink()
        err.unlink()
        if end.get("timed_out"):
            raise subprocess.TimeoutExpired(script, timeout, text[0], text[1])
        return end["returncode"], *text

    def close(self) -> None:
        import shutil

        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
