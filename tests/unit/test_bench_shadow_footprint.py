"""benchmarks/shadow_footprint.py on CPU: its child reaches L1 (no CUDA) and says so; the
benchmark itself refuses to run without a GPU, with the reason (its figures are GPU-only)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_child_reaches_l1_without_a_cuda_context(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.shadow_footprint", "--child", "L1",
                        "--store", str(tmp_path / "s")], cwd=str(ROOT), input="",
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ready "), p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_exits_2_and_says_why():
    p = subprocess.run([sys.executable, "-m", "benchmarks.shadow_footprint"], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr, p.stderr
