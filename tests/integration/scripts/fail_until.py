"""Records each attempt, then fails (exit 7) on rank 1 while TORCHELASTIC_RESTART_COUNT < N."""
import os
import sys
import time

n = int(sys.argv[1])
out = os.environ["OUT_DIR"]
rank, count = os.environ["RANK"], int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(out, f"attempt_{count}_rank_{rank}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_MAX_RESTARTS"])
if rank == "1" and count < n:
    time.sleep(0.2)
    sys.exit(7)
time.sleep(0.5)
