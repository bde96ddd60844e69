"""The tuning knobs (leto_runtime/wire/settings.py): one typed reader, the only one; a bad value stops
leto-run with exit 2 naming the variable and the fix, before anything starts."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from leto_runtime.wire import settings as S

ROOT = Path(__file__).resolve().parents[2]
# The modules that may read the environment: the contract's reader, the knobs' reader, and the
# agent's config loader (torchrun's PET_* and Leto's options).
READERS = {"leto_runtime/context.py", "leto_runtime/wire/settings.py", "leto_run/config_load.py"}


def test_defaults_without_any_knob():
    s = S.Settings.from_env({})
    assert (s.rmu_fused, s.rmu_wb_overlap, s.rmu_undo_pipeline, s.lend) == (True, True, False, True)
    assert (s.rmp_map, s.rmp_map_threads, s.rmp_map_batch, s.rmp_grant_once) == ("native", 1, 1024, False)
    assert (s.parity_delta, s.rmu_stream_marker, s.sm_fault_emulation) == ("auto", "kernel", "truncate")
    assert s.ext_dir is None and s.sm_idle_timeout is None and s.rmu_fused_variant is None


@pytest.mark.parametrize("var, raw, field, want", [
    ("LETO_RMU_FUSED", "0", "rmu_fused", False),
    ("LETO_RMU_WB_OVERLAP", "off", "rmu_wb_overlap", False),
    ("LETO_RMU_UNDO_PIPELINE", "1", "rmu_undo_pipeline", True),
    ("LETO_RMU_STREAM_MARKER", "hostfunc", "rmu_stream_marker", "hostfunc"),
    ("LETO_RMU_FUSED_VARIANT", "8", "rmu_fused_variant", 8),
    ("LETO_LEND_WARMUP", "3", "lend_warmup", 3),
    ("LETO_RMP_MAP", "python", "rmp_map", "python"),
    ("LETO_RMP_MAP_THREADS", "4", "rmp_map_threads", 4),
    ("LETO_SM_IDLE_TIMEOUT", "2", "sm_idle_timeout", 2.0),
    ("LETO_EXT_DIR", "/x/y", "ext_dir", "/x/y"),
    ("LETO_WARMUP_MIB", "4096", "warmup_mib", 4096),
    ("LETO_WARMUP_MIB", "auto", "warmup_mib", None),
    ("LETO_FORK_SERVER", "1", "fork_server", "auto"), ("LETO_FORK_SERVER", "off", "fork_server", "off"),
    ("LETO_FORK_SERVER", "exec", "fork_server", "exec"),
    ("LETO_FORK_PRELOAD", "all", "fork_preload", "all"),
])
def test_a_knob_is_read_and_typed(var, raw, field, want):
    assert getattr(S.Settings.from_env({var: raw}), field) == want


@pytest.mark.parametrize("var, raw", [
    ("LETO_RMU_FUSED", "maybe"), ("LETO_RMP_MAP", "fast"), ("LETO_RMP_MAP_THREADS", "0"),
    ("LETO_RMP_MAP_BATCH", "many"), ("LETO_PARITY_DELTA", "both"), ("LETO_SM_IDLE_TIMEOUT", "-1"),
    ("LETO_RMU_STREAM_MARKER", "device"), ("LETO_SM_FAULT_EMULATION", "burn"),
    ("LETO_WARMUP_MIB", "0"), ("LETO_WARMUP_MIB", "lots"), ("LETO_FORK_SERVER", "sometimes"),
    ("LETO_FORK_PRELOAD", "some"),
])
def test_a_bad_knob_is_a_typed_error_naming_it_and_the_fix(var, raw):
    with pytest.raises(S.SettingsError) as ei:
        S.Settings.from_env({var: raw})
    assert ei.value.var == var and var in str(ei.value) and ei.value.fix
    assert S.problems({var: raw, "LETO_RMU_FUSED_SYNDROME": "1"}) == [str(ei.value)]


def test_get_follows_the_environment(monkeypatch):
    monkeypatch.setenv("LETO_RMP_MAP_BATCH", "64")
    assert S.get().rmp_map_batch == 64
    monkeypatch.setenv("LETO_RMP_MAP_BATCH", "32")
    assert S.get().rmp_map_batch == 32
    assert S.raw()["LETO_RMP_MAP_BATCH"] == "32"


def _env_reads(path: Path) -> list[int]:
    """Lines of `path` that read os.environ / os.getenv (copies and writes are not reads)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        is_environ = lambda n: (isinstance(n, ast.Attribute) and n.attr == "environ"  # noqa: E731
                                and isinstance(n.value, ast.Name) and n.value.id == "os")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                out.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            out.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            out.append(node.lineno)
    return out


def test_the_reader_finds_a_read(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\n"
                 "d = os.getenv('W')\nos.environ['V'] = '1'\ne = dict(os.environ)\n")
    assert _env_reads(f) == [2, 3, 4, 5]


def test_no_environment_read_outside_the_readers():
    files = [p for d in ("leto_runtime", "leto_run") for p in (ROOT / d).rglob("*.py")
             if "__pycache__" not in p.parts]
    found = {str(p.relative_to(ROOT)): _env_reads(p) for p in files}
    assert {k: v for k, v in found.items() if v and k not in READERS} == {}


def test_leto_run_refuses_a_bad_knob_before_anything_starts(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(0)\n")
    env = {"PATH": "/usr/bin:/bin", "LETO_RMP_MAP_THREADS": "lots"}
    p = subprocess.run([sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", "1",
                        "--log-dir", str(tmp_path / "logs"), str(script)], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "LETO_RMP_MAP_THREADS" in p.stderr and "fix" in p.stderr, p.stderr
    assert not (tmp_path / "logs").exists()


def test_the_architecture_document_lists_every_knob():
    import re
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    sec = doc[doc.index("## Tuning knobs"):]
    sec = sec[:sec.index("\n## ", 5)]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", sec, re.M)
    assert listed == list(S.VARIABLES)
