"""Every fault a GPU test injects is one leto-run accepts for that test's job: the GPU tests'
`CASES` (tests/gpu/test_inplace_gpu.py, test_multigpu.py) go through the real CLI and config
path (`leto-run --print-config` with the test's own options: grammar, keys per point, and the
checks that need the job -- world size, recovery mode, geometry).  A spec that could never fire
would make its GPU test pass without its fault, and a typo would cost device time to find; both
are caught here, on CPU.  The GPU modules are read with `ast` (they import torch and skip at
collection on CPU)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from leto_run.cli import cli

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("test_inplace_gpu.py", "test_multigpu.py")


def _constants(path: Path) -> dict:
    """The module-level literals of a test module (CASES, GEOM, MODEL, WORLD ...)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue                       # not a literal (paths, markers)
    return out


def _cases():
    for mod in MODULES:
        c = _constants(ROOT / "tests" / "gpu" / mod)
        for name, case in c["CASES"].items():
            world = case[0] if isinstance(case[0], int) else c["WORLD"]
            injects = case[1] if isinstance(case[0], int) else case[0]
            extra = (case[2] if isinstance(case[0], int) else case[1]) \
                if len(case) > (2 if isinstance(case[0], int) else 1) else []
            yield pytest.param(world, injects, extra, c["GEOM"], id=f"{mod[:-3]}:{name}")


@pytest.mark.parametrize("world,injects,extra,geom", list(_cases()))
def test_each_gpu_case_s_injections_are_accepted_for_its_job(world, injects, extra, geom):
    args = ["--print-config", "--standalone", "--nproc-per-node", str(world), *geom,
            "--hang-timeout", "15", *extra]
    for s in injects:
        args += ["--inject", s]
    r = CliRunner().invoke(cli, [*args, "examples/gpt_inplace.py"], obj={"env": {}})
    assert r.exit_code == 0, r.output
    printed = yaml.safe_load(r.stdout)
    assert len(printed["inject"]) == len(injects), printed["inject"]


def test_a_spec_that_cannot_fire_is_refused_here():
    r = CliRunner().invoke(cli, ["--print-config", "--standalone", "--nproc-per-node", "2",
                                 "--inject", "kill:rank=2:step=3", "examples/gpt_inplace.py"],
                           obj={"env": {}})
    assert r.exit_code == 2, r.output
