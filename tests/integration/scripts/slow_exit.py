"""Heartbeats STEPS steps and ends its loop (`leto_runtime.done`); then rank 1 stays inside
`stuck_in_exit` for LINGER1 seconds before it exits, and rank 0 for LINGER0 (default 0)."""
import os
import sys
import time

import leto_runtime as leto

STEPS, LINGER1 = int(sys.argv[1]), float(sys.argv[2])
LINGER0 = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0


def stuck_in_exit(seconds: float):
    time.sleep(seconds)


for step in range(STEPS):
    leto.heartbeat(step)
    time.sleep(0.05)
leto.done()
linger = LINGER1 if os.environ.get("RANK") == "1" else LINGER0
if linger > 0:
    stuck_in_exit(linger)
