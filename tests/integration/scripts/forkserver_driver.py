"""Drives a real fork server as the agent does (subreaper, ForkServer.spawn, release, wait) and
prints, as JSON, each command line's exit status, stdout and stderr.

Usage: forkserver_driver.py '<JSON list of argument lists after `python -u`>' [exec|inherit]

inherit: the server is a fork of this process after its `import torch`
(`leto_run.fork_server.inherit`, as under a re-executed agent; run this driver with
``python -u``); else it is exec'd and imports torch itself.

DRIVER_CHANGE=1: once the server runs, this process changes its umask, nice value, CPU affinity
and soft RLIMIT_NOFILE (as a `renice`, `taskset` or the agent's own limit raise would), and each
case also runs by exec from here, after the change (its result under "exec").
"""
import json
import os
import resource
import subprocess
import sys

from leto_run import procs
from leto_run.fork_server.client import ForkServer
from leto_run.fork_server.inherit import fork_server
from leto_run.fork_server.server import ALSO_PRELOAD


def drain(fd: int) -> str:
    parts = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            os.close(fd)
            return b"".join(parts).decode(errors="replace")
        parts.append(b)


def main() -> None:
    assert procs.become_subreaper()
    env = dict(os.environ)
    if sys.argv[2:3] == ["inherit"]:
        import torch  # noqa: F401 -- the agent's own import, before the fork
        server = fork_server(sys.executable, env, ALSO_PRELOAD)
    else:
        server = ForkServer.spawned(sys.executable, env)
    change = os.environ.get("DRIVER_CHANGE") == "1"
    if change:
        os.umask(0o027)
        os.nice(1)
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            os.sched_setaffinity(0, cpus[:1])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    results = []
    for args in json.loads(sys.argv[1]):
        o_r, o_w = os.pipe()
        e_r, e_w = os.pipe()
        proc = server.spawn([sys.executable, "-u", *args], env, o_w, e_w, ())
        os.close(o_w)
        os.close(e_w)
        proc.release()
        out, err = drain(o_r), drain(e_r)         # small outputs: no pipe fills up
        results.append({"rc": proc.popen.wait(timeout=60), "stdout": out, "stderr": err,
                        "forked_from": server.proc.pid})
        if change:
            p = subprocess.run([sys.executable, "-u", *args], env=env, capture_output=True,
                               text=True, timeout=60)
            results[-1]["exec"] = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        proc.poll_exit()
    server.close()
    print(json.dumps(results))


main()
