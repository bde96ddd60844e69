"""Latent faults on the GPU (H200): page losses registered while no trainer fails, and a silent
parity flip, repaired at the step boundary by a live trainer whose retained state lives in CUDA
VMM pages (the remap replaces a page under a live mapping; host parity is pinned and re-pinned).
Exactness against torchrun (NCCL, world size 1).  See tests/integration/test_latent_faults.py
for the CPU versions and docs/TRUST.md for what is promised."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from leto_testing import (ROOT, SCRIPTS, base_env, events, final_digest, leto_cmd,  # noqa: E402
                          run, step_losses, torchrun_cmd)

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
FLIP = str(SCRIPTS / "flip_bits.py")
STEPS = 12
# ~7.2M parameters, 14 pages of 2 MiB per state -> groups of 8 and 6 (as test_inplace_gpu.py)
MODEL = ["--model", "small", "--n-layer", "4", "--n-embd", "384", "--steps", str(STEPS)]
GEOM = ["--data-pages", "8", "--tier1", "8", "--tier2", "1", "--chunk-pages", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ref")
    p = run(torchrun_cmd("--standalone", "--nproc-per-node", "1", SCRIPT, *MODEL, "--out",
                         str(d)), base_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return d


CASES = {
    # a parity page lost at step 3, then the same group needs its parity at step 7
    "p1-latent-then-kill-with-pages": ([
        "pages:rank=0:step=3:tier=host:part=p1:group=1:first=2:count=1",
        "pages:rank=0:step=7:at=rmu.update:tier=device:group=1:first=0:count=6",
        "kill:rank=0:step=7:at=rmu.update:group=1:chunk=1:garbage=1"], (), True),
    # device pages retired under the live trainer: rebuilt at the boundary, no HOF
    "device-pages-latent": (["pages:rank=0:step=4:tier=device:group=0:first=1:count=3"], (),
                            False),
    # a flipped tier-1 bit: the scrub re-encodes it; at step 8 the group needs its parity
    "p1-flip-then-kill-with-pages": ([
        "pages:rank=0:step=8:at=rmu.update:tier=device:group=1:first=0:count=6",
        "kill:rank=0:step=8:at=rmu.update:group=1:chunk=2"], ("p1:0:1:3",), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_latent_faults_on_gpu_are_repaired_exactly(case, reference, tmp_path):
    injects, flip, hof = CASES[case]
    ev = tmp_path / "events.jsonl"
    args = ["--standalone", "--nproc-per-node", "1", *GEOM, "--hang-timeout", "30",
            "--events", str(ev), "--log-dir", str(tmp_path / "logs")]
    for s in injects:
        args += ["--inject", s]
    script = [FLIP, *flip] if flip else [SCRIPT]
    p = run(leto_cmd(*args, *script, *MODEL, "--out", str(tmp_path)), base_env(), timeout=600)
    evs = events(ev) if ev.exists() else []
    found = [(e.get("phase"), e.get("step"), e.get("action"), e.get("reencoded"), e.get("decoded"))
             for e in evs if e["event"] == "phase" and e.get("phase") in ("repair", "scrub")]
    print(f"\n=== {case} ===\nboundary repairs / scrub: {found}\n"
          f"{p.stderr[p.stderr.find('Recovery report'):]}")
    assert p.returncode == 0, p.stderr[-5000:]
    assert final_digest(tmp_path, 0) == final_digest(reference, 0)
    want, got = step_losses(reference, 0), step_losses(tmp_path, 0)
    assert sorted(got) == list(range(STEPS))
    assert all(v == want[s] for s, v in got.items()), "losses differ"
    assert any(e["event"] == "promote" for e in evs) == hof
    if flip:
        assert any(f[0] == "scrub" and f[2] == "reencode" for f in found), found
    else:
        assert any(f[0] == "repair" for f in found), found
