"""Faults that strike retained memory while no trainer fails: a page loss the state manager
registers (latent, or on a survivor of a later HOF) and a silent bit flip (issue "trust at the
edges", items 1 and 2).  Real leto-run jobs of examples/gpt_inplace.py on CPU/gloo; the oracle
is the same script under torchrun without any fault tolerance: every loss and the final model
and optimizer state must be bit-identical to it -- or the job must stop and say why.

Pool-wide group ids follow allocation order: params' groups first, so pool group 1 is group 1
of leto/params (fault_matrix.py uses the same rule)."""
from __future__ import annotations

from pathlib import Path

import pytest

from fault_matrix import GEOMETRY, STEPS
from leto_testing import ROOT, SCRIPTS, base_env, compare_runs, events, leto_cmd, run

SCRIPT = str(ROOT / "examples" / "gpt_inplace.py")
FLIP = str(SCRIPTS / "flip_bits.py")


def _geometry() -> list[str]:
    g = GEOMETRY
    return ["--page-bytes", str(g["page_bytes"]), "--data-pages", str(g["data_pages"]),
            "--tier1", str(g["tier1"]), "--tier2", str(g["tier2"]),
            "--chunk-pages", str(g["chunk_pages"])]


@pytest.fixture
def reference(gpt_reference) -> Path:
    return gpt_reference(2, STEPS)          # the exactness tests' reference (tests/conftest.py)


def _leto(tmp_path: Path, injects: list[str], script: str = SCRIPT, pre: tuple = ()):
    ev = tmp_path / "events.jsonl"
    args = ["--standalone", "--nproc-per-node", "2", "--no-status", *_geometry(),
            "--hang-timeout", "30", "--events", str(ev), "--log-dir", str(tmp_path / "logs")]
    for s in injects:
        args += ["--inject", s]
    p = run(leto_cmd(*args, script, *pre, "--steps", str(STEPS), "--out", str(tmp_path)),
            base_env(), timeout=300)
    return p, (events(ev) if ev.exists() else [])


def _assert_exact(ref: Path, out: Path, why: str) -> None:
    compare_runs(ref, out, 2, range(STEPS), why)


def _phases(evs, name):
    return [e for e in evs if e["event"] == "phase" and e.get("phase") == name]


def test_a_latent_parity_loss_is_recomputed_from_the_data_before_any_use(reference, tmp_path):
    """A tier-1 parity page lost at step 3 with no failure, then at step 8 a kill in the
    update of the same group together with 16 lost data pages (the tolerance): the latent loss
    must not be read again -- it is recomputed from the data at the next step boundary, so the
    16 data pages are rebuilt from trustworthy parity."""
    injects = ["pages:rank=0:step=3:tier=host:part=p1:group=1:first=2:count=1",
               "pages:rank=0:step=8:at=rmu.update:tier=device:group=1:first=0:count=16",
               "kill:rank=0:step=8:at=rmu.update:group=1:chunk=1"]
    p, evs = _leto(tmp_path, injects)
    why = p.stderr[-4000:]
    assert p.returncode == 0, why
    _assert_exact(reference, tmp_path, why)
    rep = [e for e in _phases(evs, "repair") if e["rank"] == 0 and e["generation"] == 0]
    assert [(e["step"], e["reencoded"]) for e in rep] == [(3, [["leto/params", 1]])], why
    assert {e["generation"] for e in evs if e["event"] == "promote"} == {1}, why   # one HOF
    assert ("rank 0 gen 0 step 3: 1 lost page(s) repaired before any use: parity recomputed "
            "from the data for leto/params group 1") in p.stderr, why           # the report


def test_pages_lost_on_a_survivor_before_it_demotes(reference, tmp_path):
    """Rank 1 is killed in its update; rank 0, which survives it, loses a parity page and three
    data pages of the group it is about to update, before it demotes.  Nothing of the lost pages
    may reach the parity or the model."""
    injects = ["pages:rank=0:step=5:at=sync.after:tier=host:part=p1:group=1:first=5:count=1",
               "pages:rank=0:step=5:at=sync.after:tier=device:group=1:first=4:count=3",
               "kill:rank=1:step=5:at=rmu.update:group=1:chunk=0"]
    p, evs = _leto(tmp_path, injects)
    why = p.stderr[-4000:]
    assert p.returncode == 0, why
    _assert_exact(reference, tmp_path, why)


def test_a_latent_data_loss_within_tolerance_is_rebuilt_without_a_failure(reference, tmp_path):
    """Five data pages of a live trainer lost at a step boundary: rebuilt from parity at that
    boundary (no HOF, no recomputed step)."""
    p, evs = _leto(tmp_path, ["pages:rank=1:step=4:tier=device:group=2:first=3:count=5"])
    why = p.stderr[-4000:]
    assert p.returncode == 0, why
    _assert_exact(reference, tmp_path, why)
    rep = [e for e in _phases(evs, "repair") if e["rank"] == 1]
    assert [(e["step"], e["decoded"]) for e in rep] == [(4, [["leto/params", 2, 5]])], why
    assert not [e for e in evs if e["event"] == "promote"], why


@pytest.mark.parametrize("what", ["p1", "p2"])
def test_a_silently_flipped_parity_bit_is_scrubbed_before_a_failure_needs_it(reference, tmp_path,
                                                                             what):
    """One bit of group 1's parity flipped at step 3 (nothing registered); at step 9 a kill in
    that group's update with 16 data pages lost needs exactly that parity."""
    injects = ["pages:rank=0:step=9:at=rmu.update:tier=device:group=1:first=8:count=16",
               "kill:rank=0:step=9:at=rmu.update:group=1:chunk=3"]
    p, evs = _leto(tmp_path, injects, script=FLIP, pre=(f"{what}:0:1:3",))
    why = p.stderr[-4000:]
    assert p.returncode == 0, why
    _assert_exact(reference, tmp_path, why)
    found = [e for e in _phases(evs, "scrub") if e.get("action") == "reencode"]
    assert [(e["rank"], e["state"], e["group"]) for e in found] == [(0, "leto/params", 1)], why
    assert found[0]["step"] in (3, 4), why


def test_a_silently_flipped_data_bit_stops_the_job_and_says_why(tmp_path):
    """A flipped bit in a data page may already have been used: the scrub stops the job with the
    unrecoverable exit code and names the group, instead of training on."""
    p, evs = _leto(tmp_path, [], script=FLIP, pre=("data:2:0:3",))
    assert p.returncode == 4, p.stderr[-4000:]
    assert "the scrub found group 0 of 'leto/exp_avg_sq' inconsistent" in p.stderr
    assert "data page(s) [3]" in p.stderr
