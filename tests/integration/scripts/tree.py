"""Worker that starts a grandchild ignoring SIGTERM (and optionally one that escapes with setsid:
--escape exec'd, --escape-fork forked without an exec, so its /proc/PID/environ is the block the
worker's ancestor was exec'd with), records pids, and records forwarded signals.  Loops until
killed."""
import os
import signal
import subprocess
import sys
import time

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
GRANDCHILD = ("import signal, time, os, sys\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "if sys.argv[1] == 'setsid': os.setsid()\n"
              "open(os.path.join(os.environ['OUT_DIR'], f'ready_{os.getpid()}'), 'w').close()\n"
              "time.sleep(1000)\n")
kids = [subprocess.Popen([sys.executable, "-c", GRANDCHILD, "stay"]).pid]
if "--escape" in sys.argv:
    kids.append(subprocess.Popen([sys.executable, "-c", GRANDCHILD, "setsid"]).pid)
if "--escape-fork" in sys.argv:
    child = os.fork()
    if child == 0:
        try:
            sys.argv = ["-c", "setsid"]
            exec(GRANDCHILD)
        finally:
            os._exit(0)
    kids.append(child)


def on_usr1(signum, frame):
    with open(os.path.join(out, f"usr1_by_{rank}"), "a") as f:      # who got it (active only)
        f.write(f"{os.getpid()}\n")
    with open(os.path.join(out, f"usr1_{rank}"), "w") as f:
        f.write(str(time.monotonic()))


signal.signal(signal.SIGUSR1, on_usr1)
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# Report only once the grandchildren are set up (handlers installed, setsid done).
while not all(os.path.exists(os.path.join(out, f"ready_{k}")) for k in kids):
    time.sleep(0.01)
with open(os.path.join(out, f"pids_{rank}"), "w") as f:
    f.write(" ".join(str(p) for p in [os.getpid()] + kids))
while True:
    time.sleep(0.05)
