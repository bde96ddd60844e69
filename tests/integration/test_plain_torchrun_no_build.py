"""Plain torchrun never builds a kernel nor needs a compiler: a run without a state manager
retains nothing, so it protects nothing (parity backend "none", leto_runtime/job.py), and on CPU
it uses no native code at all.  Run for real on a machine without a compiler as far as the
trainers can tell: CXX names none, PATH holds none, and the kernel cache is empty -- and must
stay empty."""
from __future__ import annotations

import os
import shutil
import sys

from leto_testing import ROOT, base_env, run, torchrun_cmd

COMPILERS = ("c++", "g++", "gcc", "clang++", "cc", "nvcc")


def test_plain_torchrun_runs_without_a_compiler_and_builds_nothing(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    bare = tmp_path / "bin"        # PATH: only the interpreter
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    path = str(bare)
    assert not [c for c in COMPILERS if shutil.which(c, path=path)]
    env = base_env(PATH=path, CXX="/nonexistent/c++", LETO_EXT_DIR=str(cache),
                   TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_ext"))
    env.pop("CUDA_HOME", None)
    jobs = {"gpt_inplace": [str(ROOT / "examples" / "gpt_inplace.py"), "--steps", "2"],
            "toy_train": [str(ROOT / "examples" / "toy_train.py"), "--steps", "2",
                          "--ckpt-dir", str(tmp_path / "ckpt")]}
    for name, script in jobs.items():
        p = run(torchrun_cmd("--standalone", "--nproc-per-node", "1", *script), env, timeout=300)
        assert p.returncode == 0, f"{name}: {p.stderr[-4000:]}"
        assert "leto: building" not in p.stderr, name
        assert "NumPy reference" not in p.stderr, f"{name} asked for the parity codec: {p.stderr[-2000:]}"
        assert os.listdir(cache) == [], f"{name} created {os.listdir(cache)} in the kernel cache"
        assert not (tmp_path / "torch_ext").exists()
        if name == "gpt_inplace":
            assert "step    1" in p.stdout and "plain" in p.stdout, p.stdout[-2000:]
