"""Heartbeats every step; at step HANG_AT it blocks inside `stuck_in_step` (a real hang)."""
import sys
import time

import leto_runtime as leto

HANG_AT = int(sys.argv[1])


def stuck_in_step():
    time.sleep(1000)


for step in range(100):
    leto.heartbeat(step)
    if step == HANG_AT:
        stuck_in_step()
    time.sleep(0.05)
