"""Config validation (leto_sim/config.py): durations, and every bad value raising a
SimConfigError that names its field."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from leto_sim.config import SimConfigError, load_config, parse_config, parse_duration

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "configs/sim/small.yaml").read_text())


@pytest.mark.parametrize("text,secs", [("10m", 600), ("30s", 30), ("1h", 3600), ("2d", 172800),
                                       ("500ms", 0.5), ("50us", 5e-5), (45, 45), (1.5, 1.5),
                                       ("1.5h", 5400), ("10min", 600)])
def test_durations(text, secs):
    assert parse_duration(text, "x") == pytest.approx(secs)


@pytest.mark.parametrize("bad", ["-5m", "ten minutes", "5 parsecs", True, [], None, -1])
def test_bad_durations(bad):
    with pytest.raises(SimConfigError) as e:
        parse_duration(bad, "failures.mttf")
    assert e.value.field == "failures.mttf"


def with_change(path: str, value, delete: bool = False) -> dict:
    raw = copy.deepcopy(BASE)
    keys = path.split(".")
    node = raw
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if delete:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return raw


@pytest.mark.parametrize("path,value,field", [
    ("failures.mttf", "-10m", "failures.mttf"),
    ("failures.mttf", 0, "failures.mttf"),
    ("failures.hof_ratio", 1.5, "failures.hof_ratio"),
    ("failures.hof_ratio", -0.1, "failures.hof_ratio"),
    ("failures.seeds", 1, "failures.seeds"),
    ("failures.horizon", "0s", "failures.horizon"),
    ("failures.mttff", "10m", "failures.mttff"),
    ("systems.torchelastic", {}, "systems.torchelastic"),
    ("systems.leto.ff_fallback", "jit_ckpt", "systems.leto.ff_fallback"),
    ("systems.gemini_plus.checkpoint_cost", -0.5, "systems.gemini_plus.checkpoint_cost"),
    ("systems.gemini_plus.interval", 0, "systems.gemini_plus.interval"),
    ("systems.leto.max_ff_interval", 2.5, "systems.leto.max_ff_interval"),
    ("workload.pipeline.microbatches", 0, "workload.pipeline.microbatches"),
    ("workload.pipeline.stages", [], "workload.pipeline.stages"),
    ("workload.pipeline.stages.0.brackets", [[1, 2, 3]], "workload.pipeline.stages[0].brackets[0]"),
    ("workload.pipeline.stages.0.brackets", "fast", "workload.pipeline.stages[0].brackets"),
    ("workload.sync.collective.bandwidth_gbps", 0, "workload.sync.collective.bandwidth_gbps"),
    ("workload.sync.collective.algorithm", "tree", "workload.sync.collective.algorithm"),
    ("workload.sync.interference", {"kind": "moe", "f": 2}, "workload.sync.interference.f"),
    ("workload.sync.concurrency_penalty", 0.5, "workload.sync.concurrency_penalty"),
])
def test_bad_values_name_their_field(path, value, field):
    with pytest.raises(SimConfigError) as e:
        parse_config(with_change(path, value))
    assert e.value.field == field
    assert e.value.fix                              # every error says how to fix it


def test_missing_required_field():
    with pytest.raises(SimConfigError) as e:
        parse_config(with_change("failures.mttf", None, delete=True))
    assert e.value.field == "failures.mttf" and "missing" in e.value.problem


def test_repeat_expands_stages_and_configs_load():
    cfg = parse_config(BASE)
    assert len(cfg.workload.stages) == 4 and cfg.system_names == (
        "leto", "gemini_plus", "checkpoint_restart")
    for name in ("deepseek_v2", "deepseek_v3", "deepseek_v4"):
        c = load_config(ROOT / f"configs/sim/{name}.yaml")
        assert len(c.workload.stages) == 16 and c.workload.virtual == 2   # PP 16 (Table 5)
        assert c.failures.mttf == 600.0
    assert [load_config(ROOT / f"configs/sim/deepseek_v{k}.yaml").workload.dp
            for k in (2, 3, 4)] == [8, 128, 1024]                        # DP of Table 5
