"""A waiting shadow's smaller context (leto_runtime/ctx_limits.py; issue 21) in a fresh process
on the GPU: lowering the stack limit gives device memory back as the driver accounts it (the
oracle: the device's free memory through cudaMemGetInfo, read by the same process, and the
driver's own limit); restoring sets the driver's default again, and kernels run after the
restore with the same result as in a context that never lowered it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, torch
os.environ["LETO_SHADOW_STACK"] = os.environ.get("WANT", "0")
from leto_runtime import ctx_limits
torch.cuda.set_device(0)
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
default = ctx_limits.get_stack()
free0 = torch.cuda.mem_get_info()[0]
shrunk = ctx_limits.shrink()
low = ctx_limits.get_stack()
free1 = torch.cuda.mem_get_info()[0]
ctx_limits.restore()
back = ctx_limits.get_stack()
y = (x.cumsum(0) * 3).sum().item()          # kernels run after the restore
free2 = torch.cuda.mem_get_info()[0]
print(json.dumps(dict(default=default, shrunk=shrunk, low=low, back=back, y=y,
                      freed=free1 - free0, regained=free1 - free2)))
"""


def _child(want: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=300, env={**os.environ, "WANT": want})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_waiting_shadow_s_stack_reservation_is_given_back_and_restored():
    on, off = _child("0"), _child("off")
    print(f"\nstack limit: default {on['default']} B; lowered to {on['low']} B freed "
          f"{on['freed'] / 2**20:.0f} MiB; the restore took back {on['regained'] / 2**20:.0f} MiB")
    assert on["shrunk"] and on["low"] == 0 and on["back"] == on["default"] > 0
    assert on["freed"] >= 64 << 20, on          # tens of MiB at least, as the driver accounts it
    assert not off["shrunk"] and off["low"] == off["default"] and abs(off["freed"]) < 4 << 20
    assert on["y"] == off["y"]
