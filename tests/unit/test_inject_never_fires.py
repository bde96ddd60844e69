"""Which injections can fire (issue 16, item 10): the point tables agree with the runtime that
fires them, and specs that can fire stay accepted (the refusals are the bad-input table's,
tests/unit/test_bad_inputs.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from leto_run.config import JobConfig, LaunchConfig, RecoveryConfig
from leto_run.errors import ConfigError
from leto_run.inject import CHUNK_POINTS, GARBAGE_POINTS, GROUP_POINTS, parse_inject
from leto_run.inject_checks import never_fires
from leto_runtime.wire.contract import INJECT_POINTS
from leto_runtime.rmu.states import Geometry, pick_chunk_pages

RMU = Path(__file__).resolve().parents[2] / "leto_runtime" / "rmu"
FIRING = ("updater.py", "lookahead.py")         # the modules that fire the rmu.* points


def updater_points() -> dict[str, set[str]]:
    """point -> the keywords the updater passes with it (`**where` is step, group, chunk)."""
    tree = ast.Module(body=[n for f in FIRING for n in ast.parse((RMU / f).read_text()).body],
                      type_ignores=[])
    wheres = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and \
                getattr(n.value.func, "id", "") == "dict":
            wheres[n.targets[0].id] = {k.arg for k in n.value.keywords}
    out: dict[str, set[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "inject" and n.args \
                and isinstance(n.args[0], ast.Constant):
            keys = set()
            for k in n.keywords:
                keys |= wheres[k.value.id] if k.arg is None else {k.arg}
            out.setdefault(n.args[0].value, set()).update(keys)
    return out


def test_point_tables_match_what_the_updater_passes():
    seen = updater_points()
    rmu = {p for p in INJECT_POINTS if p.startswith("rmu.")}
    assert rmu <= set(seen)                   # every rmu.* point is fired by the updater
    assert set(CHUNK_POINTS) == {p for p, k in seen.items() if "chunk" in k}
    assert set(GROUP_POINTS) == {p for p, k in seen.items() if "group" in k}
    assert set(GARBAGE_POINTS) == {p for p, k in seen.items() if "garbage" in k}


@pytest.mark.parametrize("d, c", [(1024, 0), (32, 4), (32, 5), (7, 7), (2, 0), (1024, 300)])
def test_chunk_bound_is_never_below_the_runtime_chunk_count(d, c):
    """The config's bound on chunk= must admit every chunk the runtime can make (any page
    granule), and be exact when the chunk size is given."""
    job = JobConfig(recovery=RecoveryConfig(data_pages=d, chunk_pages=c))
    for page in (4096, 2 << 20, 64 << 20):
        n = -(-d // pick_chunk_pages(c, Geometry(d, 16, 1, page)))
        last = parse_inject(f"kill:rank=0:step=1:at=rmu.update:chunk={n - 1}")
        assert never_fires(last, job) is None
    if c:
        over = parse_inject(f"kill:rank=0:step=1:at=rmu.update:chunk={n}")
        assert never_fires(over, job) is not None


@pytest.mark.parametrize("spec, job", [
    ("kill:rank=0:step=1:gen=1", {}),
    ("kill:rank=0:step=0:gen=1:at=recovery.reconstruct", {}),
    ("kill:rank=0:step=0:attempt=1:at=recovery.localize", {"max_restarts": 1}),
    ("pages:rank=0:tier=device:count=32:step=1", {"data_pages": 32}),
    ("pages:rank=0:tier=host:part=p1:first=15:count=1:step=1", {}),
    ("pages:rank=0:tier=host:part=p2:count=1:after=1s", {}),
    ("kill:rank=0:step=3:at=rmu.load:group=2", {}),
    ("kill:rank=0:step=3:at=rmu.delta:group=0:chunk=1:garbage=1", {}),
    ("hang:rank=0:step=4", {"hang_timeout": 5.0}),
    ("kill:rank=0:after=1s:attempt=2", {"mode": "restart", "max_restarts": 2}),
    ("kill:rank=0:step=3:at=rmu.update", {"mode": "restart"}),     # the plain runtime has RMU
    ("kill:rank=1:after=1s", {"nproc_per_node": "2"}),
])
def test_specs_that_can_fire_are_accepted(spec, job):
    la = {k: v for k, v in job.items() if k in ("max_restarts", "nproc_per_node")}
    rc = {k: v for k, v in job.items() if k not in la}
    JobConfig(launch=LaunchConfig(**la), recovery=RecoveryConfig(**rc),
              inject=(parse_inject(spec),))


def test_refusal_names_the_spec_and_its_index():
    with pytest.raises(ConfigError) as ei:
        JobConfig(recovery=RecoveryConfig(mode="restart"),
                  inject=(parse_inject("kill:rank=0:after=1s"),
                          parse_inject("pages:rank=0:tier=host:count=1:step=2")))
    assert ei.value.key == "inject[1]" and "'pages:rank=0:step=2:count=1:tier=host'" in \
        str(ei.value) and ei.value.fix
