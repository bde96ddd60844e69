"""Drives a real fork server as the agent does (subreaper, ForkServer.spawn, release, wait) and
prints, as JSON, each command line's exit status, stdout and stderr.

Usage: forkserver_driver.py '<JSON list of argument lists after `python -u`>'
"""
import json
import os
import sys

from leto_run import procs
from leto_run.fork_server.client import ForkServer


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
    server = ForkServer(sys.executable, env)
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
        proc.poll_exit()
    server.close()
    print(json.dumps(results))


main()
