"""benchmarks/rmu_kernel_bench.py off the GPU: it says what it needs and returns 2 (it measures
CUDA kernels only), and its arguments are checked before anything runs."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from leto_testing import ROOT

_spec = importlib.util.spec_from_file_location("rmu_kernel_bench", ROOT / "benchmarks" / "rmu_kernel_bench.py")
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it would run the benchmark")
def test_without_cuda_it_returns_2_and_says_where_to_run_it(capsys):
    assert kb.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "GPU machine" in err


def test_a_chunk_past_its_group_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        kb.parse_args(["--k", "1024", "--first", "900", "--pages", "256"])
    assert e.value.code == 2 and "exceed the group's 1024 pages" in capsys.readouterr().err


def test_an_unknown_layout_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as e:
        kb.parse_args(["--layouts", "4x2x3,3x3x3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "3x3x3 not among 4x2x3, 4x2x3-statemajor" in err


def test_an_unknown_bench_kernel_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as e:
        kb.parse_args(["--bench-kernels", "ws-fold+counts/4,ws-fold+counts/3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "ws-fold+counts/3 not among fold, fold+counts" in err
    assert kb.parse_args(["--bench-kernels", "ws-fold+counts,ws-fold+counts/2"]).bench_kernels
