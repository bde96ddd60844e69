"""Every example in configs/ loads, and means what its comments say."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from leto_run import config as C
from leto_run.config_load import OPTIONS, build_config
from leto_run.inject import InjectKind

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str, env=None):
    return build_config({}, set(), env or {}, str(CONFIGS / name), new_id=lambda: "RID")


def test_every_example_is_tested():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == \
        ["full.yaml", "inplace_demo.yaml", "minimal.yaml", "multinode_c10d.yaml",
         "restart_demo.yaml"]


def test_minimal():
    c = load("minimal.yaml")
    assert c.launch.training_script == "train.py" and c.launch.script_args == ("--epochs", "1")
    assert c.launch.nproc_per_node == "2" and c.max_world_size == 2
    assert (c.rendezvous.backend, c.rendezvous.endpoint, c.rendezvous.auto_c10d) == \
        ("c10d", "localhost:0", True)
    assert c.recovery == C.RecoveryConfig() and c.inject == ()


def test_full_lists_every_key_at_its_default():
    raw = yaml.safe_load((CONFIGS / "full.yaml").read_text())
    keys = {f"{s}.{k}" for s, body in raw.items() if isinstance(body, dict) for k in body}
    assert keys == {o.key for o in OPTIONS}                  # every YAML key, nothing else
    assert raw["inject"] == []
    c = load("full.yaml")
    ref = build_config({"training_script": "train.py"}, {"training_script"}, {}, None,
                       new_id=lambda: "RID")
    assert c.launch == ref.launch and c.logs == ref.logs and c.recovery == ref.recovery
    assert c.checkpoint == ref.checkpoint
    assert c.rendezvous == ref.rendezvous                    # incl. the single-node auto-c10d
    assert c.warnings == ()                                  # defaults given explicitly: no noise


def test_restart_demo():
    c = load("restart_demo.yaml")
    la = c.launch
    assert la.nproc_int == 2 and la.max_restarts == 2 and la.shutdown_timeout == 5.0
    assert c.recovery.mode == "restart" and c.recovery.hang_timeout == 30.0
    assert c.rendezvous.standalone and c.rendezvous.backend == "c10d"
    assert c.logs.tee == "3"
    (spec,) = c.inject
    assert (spec.kind, spec.rank, spec.step, spec.after_s, spec.attempt, spec.signal) == \
        (InjectKind.KILL, 1, 23, None, 0, 9)


def test_inplace_demo():
    c = load("inplace_demo.yaml")
    assert c.launch.training_script == "examples/gpt_inplace.py" and c.launch.nproc_int == 2
    r = c.recovery
    assert (r.mode, r.hang_timeout, r.page_bytes, r.data_pages, r.tier1, r.tier2, r.chunk_pages) \
        == ("inplace", 10.0, 16384, 64, 16, 1, 8)
    kinds = [(s.kind, s.rank, s.step, s.at, s.gen) for s in c.inject]
    assert kinds[2] == (InjectKind.KILL, 1, 15, "rmu.update", 0)
    assert [k[0] for k in kinds] == [InjectKind.PAGES, InjectKind.PAGES, InjectKind.KILL,
                                     InjectKind.KILL, InjectKind.HANG]
    assert [k[4] for k in kinds] == [0, 0, 0, 1, 2]


def test_restart_demo_cli_overrides(tmp_path):
    c = build_config({"max_restarts": "0", "inject": ("hang:rank=0:step=3",)},
                     {"max_restarts", "inject"}, {}, str(CONFIGS / "restart_demo.yaml"))
    assert c.launch.max_restarts == 0 and [s.text for s in c.inject] == ["hang:rank=0:step=3"]


def test_multinode_c10d():
    c = load("multinode_c10d.yaml")
    la, rz = c.launch, c.rendezvous
    assert (la.min_nodes, la.max_nodes, la.nproc_per_node, la.max_restarts) == (2, 4, "gpu", 3)
    assert (rz.backend, rz.endpoint, rz.id, rz.auto_c10d) == \
        ("c10d", "node0.cluster:29400", "leto-multinode-demo", False)
    assert rz.conf_dict() == {"join_timeout": "900", "last_call_timeout": "30",
                              "close_timeout": "30"}
    assert c.logs.log_dir == "/tmp/leto-logs" and c.logs.local_ranks_filter == (0,)
    assert c.recovery.hang_timeout == 120.0 and c.max_world_size is None


@pytest.mark.parametrize("name", ["minimal.yaml", "full.yaml", "restart_demo.yaml",
                                  "multinode_c10d.yaml"])
def test_examples_are_commented(name):
    text = (CONFIGS / name).read_text()
    assert text.startswith("#") and text.count("#") >= 5
