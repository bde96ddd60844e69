"""Heartbeats STEPS steps and ends its loop (`leto_runtime.done`); then rank 1 stays inside
`stuck_in_exit` for LINGER seconds before it exits (rank 0 exits at once)."""
import os
import sys
import time

import leto_runtime as leto

STEPS, LINGER = int(sys.argv[1]), float(sys.argv[2])


def stuck_in_exit():
    time.sleep(LINGER)


for step in range(STEPS):
    leto.heartbeat(step)
    time.sleep(0.05)
leto.done()
if os.environ.get("RANK") == "1":
    stuck_in_exit()
