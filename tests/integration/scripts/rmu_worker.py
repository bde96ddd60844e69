"""One rank's RMU without the launcher: used by tests/integration/test_rmu_crash.py.

argv: SOCKET TOTAL PLAN_JSON [--local]
Opens (first run: creates and initializes) the retained states in the state manager at SOCKET,
recovers them if they exist (localize, remap, marker, resume point, repair, finish), then runs
iterations up to TOTAL with synthetic gradients (a function of the step).  PLAN_JSON is a list
of {"at": POINT, "step": t, "group": g|null, "chunk": c|null, "garbage": bool,
"pages": [inject kwargs...]}: at that point the listed pages are destroyed, then the process
SIGKILLs itself.  Prints one JSON line: {"digest", "resume", "repaired"}.
With --local the same run on ordinary tensors (no state manager): the fault-free reference.
RMU_WORKER_DEVICE=cuda runs it on the GPU (2 MiB pages; tests/gpu/test_rmu_crash_gpu.py): the
updater then queues its work and marker writes without waiting, and a kill strikes with the GPU
behind the host unless pages are destroyed with it (the stream is synchronized first, as
leto_runtime.faults does, so that no kernel runs into a page being unmapped).
"""
import hashlib
import json
import os
import signal
import sys

import torch

from leto_runtime.rmp.client import RmpClient
from leto_runtime.rmu.adamw import AdamWConfig
from leto_runtime.rmu.recovery import check_consistent, prepare
from leto_runtime.rmu.states import Geometry, Layout, open_states
from leto_runtime.rmu.updater import Updater

sock, total, plan = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
local = "--local" in sys.argv
transactions = "--no-transactions" not in sys.argv
DEV = os.environ.get("RMU_WORKER_DEVICE", "cpu")
GEO = Geometry(32, 16, 1, 4096 if DEV == "cpu" else 2 << 20)
CHUNK = 4
N = 70 * GEO.page_bytes // 4 + 300       # ~70.3 pages: groups of 32, 32 and 7 pages
cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, clip_grad_norm=1.0,
                  warmup_steps=2, total_steps=total)
layout = Layout.of([("w", (N,))], GEO.page_bytes)
client = None if local else RmpClient(sock, timeout=30)


def inject(point, step=None, group=None, chunk=None, garbage=None):
    for p in plan:
        if p["at"] != point or (not point.startswith("recovery.") and p["step"] != step):
            continue
        if p.get("group") is not None and p["group"] != group:
            continue
        if p.get("chunk") is not None and p["chunk"] != chunk:
            continue
        if p.get("garbage") and garbage is not None:
            garbage()               # a kill inside a kernel, before the HBM loss unmaps pages
        if DEV != "cpu" and p.get("pages"):
            torch.cuda.synchronize()
        for spec in p.get("pages", []):
            spec = dict(spec)
            name = spec.setdefault("state", "leto/params")
            if "gindex" in spec:                    # group position in the state -> pool id
                st = next(s for s in ss.all if s.name == name)
                spec["group"] = st.groups[spec.pop("gindex")].id
            client.inject_pages(**spec)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


ss = open_states(layout, client=client, geo=GEO, device=DEV, chunk_pages=CHUNK)
up = Updater(ss, cfg, inject=inject, backend="cpu" if DEV == "cpu" else "auto",
             transactions=transactions)
P, G = ss.flat(ss.model[0]), ss.flat(ss.grads)


def initialize():
    for st in (*ss.model, ss.grads):
        ss.flat(st).zero_()
    P[:N].copy_(torch.randn(N, generator=torch.Generator().manual_seed(7)).to(P.device))
    up.encode_all([*ss.model, ss.grads])
    up.marker.write(initialized=1, t=-1, phase=4)


# The trainer's own recovery sequence (leto_runtime.rmu.recovery.prepare, as job.py runs it).
res, rep = prepare(ss, up, rank=0, initialize=initialize, fire=inject,
                   transactions=transactions, backend="cpu" if DEV == "cpu" else "auto")
start = res.step
info = {"resume": None if rep is None else [res.action, res.t], "fold": up.fold,
        "repaired": 0 if rep is None else rep.pages,
        # right after the recovery (the interrupted update finished): later steps rewrite every
        # group's parity and would hide a write-back or tier 2 the recovery left stale
        "parity_after_recovery": [] if rep is None else check_consistent(ss, up)}
for t in range(start, total):
    up.begin(t)
    G.zero_()
    inject("step", step=t)
    G[:N].copy_((torch.randn(N, generator=torch.Generator().manual_seed(1000 + t)) * 0.3).to(G.device))
    up.step(t)
h = hashlib.sha256()
parts = []          # per state and protection group: which part differs, when one does
GE = GEO.data_pages * GEO.page_bytes // 4
for st in ss.model:
    flat = ss.flat(st)[:N].cpu()
    h.update(flat.numpy().tobytes())
    parts.append([hashlib.sha256(flat[i:i + GE].numpy().tobytes()).hexdigest()[:12]
                  for i in range(0, N, GE)])
bad = check_consistent(ss, up)
print(json.dumps({**info, "digest": h.hexdigest(), "parts": parts, "parity_problems": bad}), flush=True)
