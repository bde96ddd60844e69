"""An installed (non-editable) Leto: the wheel carries the kernel sources and the quick-start
job recovers in place with kernels built from them (docs/KERNELS.md).

The wheel is built from a copy of the checkout's packaging inputs (so the checkout gets no
build/ folder), installed into a fresh venv whose only view of the dependencies (torch,
click, ...) is a .pth line naming this venv's site-packages -- a plain path line executes no
editable finder there, so the checkout is not importable.  The job runs from a temp directory
with copies of the example scripts.  Its kernel comes from the wheel's package data: the same
bytes as the checkout's give the same digest, so the session's cache serves it (a hit, no
build), and the digest is computed from the installed copy."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from leto_testing import ROOT, base_env, events

def _packaging() -> tuple[str, ...]:
    """What a wheel is built from: pyproject, the README, and the folder of every top-level
    package pyproject lists (through its package-dir), so a new package cannot be left out."""
    import tomllib
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {p.split(".")[0] for p in st["packages"]}
    return ("pyproject.toml", "README.md",
            *sorted(st.get("package-dir", {}).get(t, t) for t in tops))


PACKAGING = _packaging()
PROBE = """
import json, sys
import leto_run, leto_runtime
from leto_runtime.wire import kernel_cache as K
from leto_runtime.parity import _ext
_ext.load_cpu()
got = K.outcome("leto_parity_cpu")
print(json.dumps({"leto_run": leto_run.__file__, "leto_runtime": leto_runtime.__file__,
                  "sources": str(K.source_dir()), "sys_path": sys.path,
                  "kernel": str(got.path), "built": got.built}))
"""


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns its bin/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for part in PACKAGING:
        s, d = ROOT / part, src / part
        if s.is_dir():
            shutil.copytree(s, d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d)
    _sh([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist")], cwd=str(src), timeout=300)
    [whl] = (tmp / "dist").glob("leto-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for f in (ROOT / "cuda").iterdir():
        if f.suffix in (".cpp", ".cu", ".cuh", ".h", ".inc"):
            assert f"leto_cuda/{f.name}" in names, f"{f.name} is not in the wheel"
    assert "leto_cuda/__init__.py" in names and not [n for n in names if n.startswith("cuda/")]
    venv = tmp / "venv"
    _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    _sh([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
         "-q", str(whl)], timeout=300)
    purelib = _sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "leto_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin"


def _env(**extra) -> dict[str, str]:
    env = base_env(**extra)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_wheel_runs_the_quick_start_job_with_its_own_kernel_sources(installed, tmp_path):
    venv = installed.parent
    work = tmp_path / "job"
    work.mkdir()
    p = _sh([str(installed / "python"), "-c", PROBE], env=_env(), cwd=str(work), timeout=300)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("leto_run", "leto_runtime", "sources"):
        assert got[key].startswith(str(venv)), (key, got[key])
    assert got["sources"].endswith("leto_cuda")
    for entry in got["sys_path"]:        # the checkout is not importable; its venv only for deps
        e = Path(entry or work).resolve()
        assert e != ROOT and (ROOT not in e.parents or (ROOT / ".venv") in e.parents), entry
    assert not got["built"], "the wheel's sources hashed differently from the checkout's"
    # The quick-start job, in place: a kill in backward, recovered by the shadow.
    for f in ("gpt_inplace.py", "gpt.py"):
        shutil.copy2(ROOT / "examples" / f, work / f)
    ev = tmp_path / "ev.jsonl"
    p = subprocess.run([str(installed / "leto-run"), "--standalone", "--nproc-per-node", "1",
                        "--no-status", "--events", str(ev), "--log-dir", str(tmp_path / "logs"),
                        "--inject", "kill:rank=0:step=3:at=backward",
                        "gpt_inplace.py", "--steps", "6"],
                       env=_env(), cwd=str(work), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    evs = events(ev)
    assert [e for e in evs if e["event"] == "hof" and e["generation"] == 0]
    assert [e for e in evs if e["event"] == "promoted" and e["generation"] == 1]
    assert not [e for e in evs if e["event"] == "restart"]
    assert "in place: rank 0 Signal 9 (SIGKILL) at step 3" in p.stderr
    assert "leto: building" not in p.stderr and "NumPy reference" not in p.stderr, p.stderr[-3000:]
    assert os.path.exists(got["kernel"])
