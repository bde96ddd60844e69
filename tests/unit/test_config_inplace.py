"""recovery.* keys of in-place recovery: defaults, the three sources, and typed errors."""
from __future__ import annotations

import pytest

from leto_run.cli import load_config
from leto_run.config import RecoveryConfig
from leto_run.errors import ConfigError


def load(argv, env=None):
    return load_config(list(argv), env or {})


def test_defaults_match_design():
    r = RecoveryConfig()
    assert (r.page_bytes, r.data_pages, r.tier1, r.tier2) == (2 << 20, 1024, 16, 1)
    assert (r.chunk_pages, r.pg_timeout, r.demote) == (0, 600.0, "release")
    g = r.geometry
    assert (g.page_bytes, g.data_pages, g.tier1, g.tier2) == (2 << 20, 1024, 16, 1)
    assert g.problems() == []


@pytest.mark.parametrize("field, flag, env, value, want", [
    ("page_bytes", "--page-bytes", "PET_PAGE_BYTES", "65536", 65536),
    ("data_pages", "--data-pages", "PET_DATA_PAGES", "8", 8),
    ("tier1", "--tier1", "PET_TIER1", "4", 4),
    ("tier2", "--tier2", "PET_TIER2", "2", 2),
    ("chunk_pages", "--chunk-pages", "PET_CHUNK_PAGES", "2", 2),
    ("pg_timeout", "--pg-timeout", "PET_PG_TIMEOUT", "30", 30.0),
    ("demote", "--demote", "PET_DEMOTE", "replace", "replace"),
    ("demote", "--demote", "PET_DEMOTE", "release", "release"),
])
def test_cli_env_yaml(tmp_path, field, flag, env, value, want):
    assert getattr(load([flag, value, "t.py"]).recovery, field) == want
    assert getattr(load(["t.py"], {env: value}).recovery, field) == want
    p = tmp_path / "j.yaml"
    p.write_text(f"recovery:\n  {field}: {value}\n")
    assert getattr(load(["--config", str(p), "t.py"]).recovery, field) == want


@pytest.mark.parametrize("kw, key, text", [
    (dict(page_bytes=5000), "recovery.page_bytes", "multiple of 4096"),
    (dict(page_bytes=1024), "recovery.page_bytes", ">= 4096"),
    (dict(data_pages=0), "recovery.data_pages", ">= 1"),
    (dict(tier1=17), "recovery.tier1", "above 16"),
    (dict(tier1=0), "recovery.tier1", ">= 1"),
    (dict(tier1=2, tier2=3), "recovery.tier2", "at most tier1"),
    (dict(data_pages=65530), "recovery.data_pages", "65535"),
    (dict(chunk_pages=-1), "recovery.chunk_pages", ">= 0"),
    (dict(pg_timeout=0), "recovery.pg_timeout", "> 0"),
    (dict(demote="inprocess"), "recovery.demote", "not a demotion mode"),
])
def test_typed_errors_name_the_fix(kw, key, text):
    with pytest.raises(ConfigError) as ei:
        RecoveryConfig(**kw)
    assert ei.value.key == key and text in str(ei.value) and ei.value.fix


def test_cli_error_names_the_source():
    with pytest.raises(ConfigError) as ei:
        load(["--demote", "keep", "t.py"])
    assert ei.value.key == "recovery.demote" and "--demote" in str(ei.value)
