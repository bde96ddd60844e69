"""Retained state under leto-run (in-place mode starts a state manager per slot).

mode "restart": attempt 0 writes seeded bytes into retained memory and is then killed (by an
  injection); attempt 1 attaches by name and checks the bytes -> $OUT_DIR/result_<rank>.
mode "smcrash": writes, signals `written_<rank>`, waits for `go`, then (the state manager was
  SIGKILLed and restarted meanwhile) lists through a reconnected client and checks the bytes.
"""
import hashlib
import os
import sys
import time

import numpy as np
import torch

import leto_runtime as leto
from leto_runtime.rmp import RmpClient

mode = sys.argv[1]
out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
nbytes = 3 * 1024 * 1024 + 4 * 1000          # two 2 MiB pages, ragged tail
data = np.random.default_rng(100 + rank).integers(0, 256, nbytes, dtype=np.uint8)
want = hashlib.sha256(data.tobytes()).hexdigest()
c = RmpClient(timeout=30)


def sha(st) -> str:
    return hashlib.sha256(st.tensor(dtype="uint8", nbytes=nbytes).numpy().tobytes()).hexdigest()


def report(text: str) -> None:
    with open(os.path.join(out, f"result_{rank}"), "w") as f:
        f.write(text)


if attempt == 0:
    st = c.allocate(f"params.{rank}", nbytes, dtype="float32", shape=[nbytes // 4])
    st.tensor(dtype="uint8", nbytes=nbytes).copy_(torch.from_numpy(data))
    if mode == "smcrash":
        open(os.path.join(out, f"written_{rank}"), "w").close()
        while not os.path.exists(os.path.join(out, "go")):
            time.sleep(0.02)
        names = [s["name"] for s in c.list()]             # reconnects to the new state manager
        report(f"{'ok' if sha(st) == want and f'params.{rank}' in names else 'BAD'} {names}")
        sys.exit(0)
    # Steps (and so the step-triggered kill) begin only once every rank has written: a rank
    # still importing when its peer reaches the kill step would have nothing to attach.
    open(os.path.join(out, f"written_{rank}"), "w").close()
    world = int(os.environ["WORLD_SIZE"])
    while not all(os.path.exists(os.path.join(out, f"written_{r}")) for r in range(world)):
        time.sleep(0.02)
    for step in range(1000):
        leto.heartbeat(step)
        time.sleep(0.02)
else:
    st = c.attach(f"params.{rank}")
    report(f"{'ok' if sha(st) == want else 'BAD'} attempt {attempt}")
