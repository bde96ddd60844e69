"""benchmarks/rmu_kernel_bench.py off the GPU: it says what it needs and exits 2 (it measures
CUDA kernels only), and its arguments are checked before anything runs."""
from __future__ import annotations

import subprocess
import sys

from leto_testing import ROOT, base_env

SCRIPT = str(ROOT / "benchmarks" / "rmu_kernel_bench.py")


def test_without_cuda_it_exits_2_and_says_where_to_run_it():
    p = subprocess.run([sys.executable, SCRIPT], env=base_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "needs a CUDA device" in p.stderr and "GPU machine" in p.stderr


def test_a_chunk_past_its_group_is_refused():
    p = subprocess.run([sys.executable, SCRIPT, "--k", "1024", "--first", "900", "--pages", "256"],
                       env=base_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "exceed the group's 1024 pages" in p.stderr
