"""A waiting shadow's smaller context (leto_runtime/ctx_limits.py; issue 21) in a fresh process
on the GPU: lowering the stack limit gives device memory back as the driver accounts it (the
oracle: what NVML says this process holds, and the driver's own limit; where the driver hides
pids, the device's free memory through cudaMemGetInfo, which other processes on the GPU -- a
parallel test run -- can move); restoring sets the driver's default again, and kernels run after
the restore with the same result as in a context that never lowered it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, torch
os.environ["LETO_SHADOW_STACK"] = os.environ.get("WANT", "0")
from leto_runtime import ctx_limits
from leto_run.nvml import Nvml
torch.cuda.set_device(0)
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
nv = Nvml.open()
dev = nv.physical(0)
def held():                                 # free bytes as a "held" figure where pids are hidden
    mine = nv.process_bytes(dev).get(os.getpid())
    return ("nvml", mine) if mine is not None else ("free", -torch.cuda.mem_get_info()[0])
default = ctx_limits.get_stack()
how, h0 = held()
shrunk = ctx_limits.shrink()
low = ctx_limits.get_stack()
_, h1 = held()
ctx_limits.restore()
back = ctx_limits.get_stack()
y = (x.cumsum(0) * 3).sum().item()          # kernels run after the restore
_, h2 = held()
print(json.dumps(dict(default=default, shrunk=shrunk, low=low, back=back, y=y, how=how,
                      freed=h0 - h1, regained=h2 - h1)))
"""


def _child(want: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=300, env={**os.environ, "WANT": want})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu_alone          # the device's free memory may be its measure
def test_the_waiting_shadow_s_stack_reservation_is_given_back_and_restored():
    on, off = _child("0"), _child("off")
    print(f"\nstack limit ({on['how']}): default {on['default']} B; lowered to {on['low']} B freed "
          f"{on['freed'] / 2**20:.0f} MiB; the restore took back {on['regained'] / 2**20:.0f} MiB")
    assert on["shrunk"] and on["low"] == 0 and on["back"] == on["default"] > 0
    assert on["freed"] >= 64 << 20, on          # tens of MiB at least, as the driver accounts it
    # without the cut nothing moves: exactly, as NVML accounts this process (a device-wide
    # figure only within what other processes may have done meanwhile)
    slack = 0 if off["how"] == "nvml" else 64 << 20
    assert not off["shrunk"] and off["low"] == off["default"] and abs(off["freed"]) <= slack, off
    assert on["y"] == off["y"]
