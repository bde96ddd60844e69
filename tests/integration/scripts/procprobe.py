"""Writes what a worker process looks like from inside -- its command line as the interpreter
set it up, environment, descriptors, signals, limits, parent -- as JSON to
$OUT_DIR/probe_<RANK>_<TORCHELASTIC_RESTART_COUNT>.json.  PROBE_EXIT=<rank>:<code> makes that
rank exit with the code; PROBE_KILL_FORK_SERVER=1 makes rank 1 of attempt 0 SIGKILL this
job's fork server first (found by its command line and the job token in its environment); PROBE_SLEEP=<s> makes
every rank sleep that long before it exits."""
import json
import os
import resource
import signal
import sys
import time

TORCH_PRELOADED = "torch" in sys.modules        # before anything of the probe imports it
# torch's modules the fork server's preload brought (no name spelled out here: the preload's
# decision reads this file's code)
PRELOADED = sorted(m for m in sys.modules if m.startswith("torch.") and m.count(".") <= 2)


def fds() -> dict:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue                           # the listing's own descriptor
        out[name] = target.split(":")[0] if ":" in target else "file"
    return out


def handler(s):
    h = signal.getsignal(s)
    return {signal.SIG_DFL: "SIG_DFL", signal.SIG_IGN: "SIG_IGN", None: "None"}.get(
        h, getattr(h, "__name__", repr(type(h))))


def kill_fork_server() -> None:
    needle = b"\0LETO_JOB_TOKEN=" + os.environ["LETO_JOB_TOKEN"].encode() + b"\0"
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cmd = open(f"/proc/{e.name}/cmdline", "rb").read()
            env = b"\0" + open(f"/proc/{e.name}/environ", "rb").read()
        except OSError:
            continue
        if b"leto_run.fork_server" in cmd and needle in env:
            os.kill(int(e.name), signal.SIGKILL)


rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if os.environ.get("PROBE_KILL_FORK_SERVER") and rank == "1" and attempt == "0":
    kill_fork_server()
import random  # noqa: E402
import numpy  # noqa: E402
main = sys.modules["__main__"]
facts = {
    "argv": sys.argv, "path": sys.path, "file": __file__, "name": __name__,
    "main_globals": sorted(k for k in vars(main) if k.startswith("__")),
    "loader": type(__loader__).__name__, "spec": repr(__spec__), "cached": globals().get("__cached__"),
    "cwd": os.getcwd(), "env": dict(os.environ), "fds": fds(),
    "signals": {s.name: handler(s) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "own_group": os.getpgid(0) == os.getpid(), "session_leader": os.getsid(0) == os.getpid(),
    "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
    "parent": open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")[:3],
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource)
                if n.startswith("RLIMIT_")},
    "umask": os.umask(0o22), "nice": os.nice(0), "affinity": sorted(os.sched_getaffinity(0)), "write_through": sys.stdout.write_through,
    "flags": list(sys.flags), "random": random.random(), "numpy": float(numpy.random.rand()),
    "torch_preloaded": TORCH_PRELOADED, "preloaded": PRELOADED,
}
facts["parent"] = [p.decode() for p in facts["parent"]]
with open(os.path.join(os.environ["OUT_DIR"], f"probe_{rank}_{attempt}.json"), "w") as f:
    json.dump(facts, f)
time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
code = os.environ.get("PROBE_EXIT", "")
if code.split(":")[0] == rank and attempt == "0":
    sys.exit(int(code.split(":")[1]))
