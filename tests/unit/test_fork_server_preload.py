"""The fork server's preload decision (`leto_run.fork_server.preload`) against what scripts really
import: each script runs in a fresh fork of an interpreter that imported torch only (as a worker
of a server with nothing preloaded), and every module of `ALL` it ended up importing must be in
its plan -- a plan that leaves out what a script imports costs every worker that import again.
Scripts the decision cannot see through must get everything."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from leto_run.fork_server.preload import ALL, DCP, DYNAMO, MAX_BYTES, plan

SCRIPTS = {
    "plain.py": """
        import torch, torch.nn as nn
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        m(torch.randn(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    """,
    "optim_attr.py": """
        import torch
        m = torch.nn.Linear(2, 2)
        torch.optim.SGD(m.parameters(), lr=0.1)
    """,
    "optim_alias.py": """
        from torch import optim as o
        import torch
        o.AdamW(torch.nn.Linear(2, 2).parameters())
    """,
    "via_helper.py": """
        import torch
        import helper
        helper.make(torch.nn.Linear(2, 2))
    """,
    "helper.py": """
        from torch.optim import Adam
        def make(m):
            return Adam(m.parameters())
    """,
    "via_package.py": """
        import torch
        from pkg import train
        train.go()
    """,
    "pkg/__init__.py": "",
    "pkg/train.py": """
        import torch
        from . import opts
        def go():
            opts.sgd(torch.nn.Linear(2, 2))
    """,
    "pkg/opts.py": """
        import torch.optim as topt
        def sgd(m):
            return topt.SGD(m.parameters(), lr=1.0)
    """,
    "activation_ckpt.py": """
        import torch
        from torch.utils.checkpoint import checkpoint
        m = torch.nn.Linear(2, 2)
        checkpoint(m, torch.randn(1, 2, requires_grad=True), use_reentrant=False).sum().backward()
    """,
    "dcp.py": """
        import torch.distributed.checkpoint as dcp
    """,
    "by_string.py": """
        import importlib
        importlib.import_module("torch.distributed.checkpoint")
    """,
}
EXPECTED = {"plain.py": (), "optim_attr.py": (DYNAMO,), "optim_alias.py": (DYNAMO,),
            "via_helper.py": (DYNAMO,), "via_package.py": (DYNAMO,),
            "activation_ckpt.py": (DYNAMO,), "dcp.py": (DYNAMO, DCP), "by_string.py": (DYNAMO, DCP)}

# A script's child records each module of ALL as its import starts; dynamo's import (~1.7 CPU-s)
# ends the child there, which is all the check needs.
RUNNER = """
import json, os, runpy, sys
import torch
out = {}
wanted = json.loads(sys.argv[1])
for script in sys.argv[2:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        seen = [m for m in wanted if m in sys.modules]
        class Spy:
            def find_spec(self, name, path=None, target=None):
                if name in wanted and name not in seen:
                    seen.append(name)
                    if name == "torch._dynamo":
                        os.write(w, json.dumps(seen).encode())
                        os._exit(0)
                return None
        sys.meta_path.insert(0, Spy())
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
        os.write(w, json.dumps(seen).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    out[os.path.basename(script)] = json.loads(got) if status == 0 else None
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripts")
    for name, text in SCRIPTS.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(textwrap.dedent(text))
    return d


def test_every_module_a_script_imports_is_in_its_plan(scripts):
    names = list(EXPECTED)
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(ALL),
                        *[str(scripts / n) for n in names]],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    imported = json.loads(p.stdout)
    for name in names:
        got = plan([sys.executable, "-u", name], str(scripts), False)
        assert imported[name] is not None, f"{name} failed to run"
        assert set(imported[name]) <= set(got.modules), (name, imported[name], got)
        assert got.modules == EXPECTED[name], (name, got)
    assert imported["plain.py"] == [] and imported["optim_attr.py"] == [DYNAMO]


def test_what_cannot_be_seen_through_preloads_everything(scripts, tmp_path):
    (tmp_path / "third_party.py").write_text("import somewhere_else\n")
    os.mkfifo(tmp_path / "fifo.py")           # never opened for a blocking read
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_BYTES // 6 + 1))
    (tmp_path / "broken.py").write_text("def (:\n")
    for argv, why in (([sys.executable, "-u", "-m", "plain"], "-m"),
                      ([sys.executable, "-u", "third_party.py"], "not beside it"),
                      ([sys.executable, "-u", "broken.py"], "cannot be read"),
                      ([sys.executable, "-u", "fifo.py"], "not a regular file"),
                      ([sys.executable, "-u", "big.py"], "larger than"),
                      ([sys.executable, "-u", "missing.py"], "cannot be read")):
        got = plan(argv, str(tmp_path), False)
        assert got.modules == ALL and why in got.reason, (argv, got)


def test_leto_runtime_with_checkpoints_preloads_dcp(tmp_path):
    (tmp_path / "t.py").write_text("import leto_runtime\njob = leto_runtime.init()\n")
    assert plan([sys.executable, "-u", "t.py"], str(tmp_path), False).modules == ()
    got = plan([sys.executable, "-u", "t.py"], str(tmp_path), True)
    assert got.modules == (DCP,) and "checkpoints" in got.reason
    (tmp_path / "c.py").write_text("import torch\nm = torch.nn.Linear(2, 2)\nm.compile()\n")
    assert plan([sys.executable, "-u", "c.py"], str(tmp_path), False).modules == (DYNAMO,)


def test_the_review_s_cases(tmp_path):
    """A namespace subpackage, a local file with a library module's name, a symlinked script,
    a * import, dynamic imports and code: each either followed or opaque (never a plan that
    misses dynamo); arguments the file system refuses never raise."""
    opt = "import torch.optim as o\ndef make(m):\n    return o.SGD(m.parameters(), lr=1)\n"
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text(opt)
    (tmp_path / "ns.py").write_text("import torch\nfrom pkg.sub import mod\n")
    (tmp_path / "sched.py").write_text(opt)                   # shadows the library's sched
    (tmp_path / "shadow.py").write_text("import sched\n")
    real = tmp_path / "real"
    real.mkdir()
    (real / "helper.py").write_text(opt)
    (real / "train.py").write_text("import helper\n")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "helper.py").write_text("x = 1\n")
    (tmp_path / "link" / "train.py").symlink_to(real / "train.py")
    for name in ("ns.py", "shadow.py", "link/train.py"):
        assert DYNAMO in plan([sys.executable, "-u", name], str(tmp_path), False).modules, name
    for code, why in (("from pkg import *\n", "imports *"),
                      ("import importlib\nimportlib.import_module('x')\n", "import_module"),
                      ("exec(open('x').read())\n", "exec"),
                      ("import runpy\nrunpy.run_path('x')\n", "runpy"),
                      ("import torch\nopt = getattr(torch, 'op' + 'tim')\n", "getattr")):
        (tmp_path / "dyn.py").write_text(code)
        got = plan([sys.executable, "-u", "dyn.py"], str(tmp_path), False)
        assert got.modules == ALL and why in got.reason, (code, got)
    for bad in ("a\0b.py", "\udcff.py"):
        assert plan([sys.executable, "-u", bad], str(tmp_path), False).modules == ALL
