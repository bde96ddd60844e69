"""benchmarks/ckpt_stall.py's pure parts: every checkpointing system gets the same interval,
Leto's two writers differ only in --checkpoint-writer, and an overhead is a system's mean step
against its own "off" run."""
from __future__ import annotations

from benchmarks import ckpt_stall as B
from benchmarks.recovery import presets as P


def test_the_systems_checkpoint_at_the_same_interval_and_differ_only_in_the_writer(tmp_path):
    preset = P.get("cpu-smoke")
    cmds = {n: B.command(n, preset, str(tmp_path / n), 90, 30) for n in B.SYSTEMS}
    shadow, trainer = cmds["leto-shadow"], cmds["leto-trainer"]
    i = shadow.index("--checkpoint-writer")
    assert (shadow[i + 1], trainer[trainer.index("--checkpoint-writer") + 1]) == ("auto",
                                                                                 "trainer")
    assert shadow[shadow.index("--checkpoint-every") + 1] == "30"
    assert cmds["dcp-async"][cmds["dcp-async"].index("--ckpt-every") + 1] == "30"
    assert "--checkpoint-dir" not in cmds["leto-off"] and "--ckpt-every" not in cmds["torch-off"]
    for n in ("leto-off", "leto-shadow", "leto-trainer"):
        assert cmds[n][cmds[n].index("--opt") + 1] == "torch"      # one optimizer for all three


def test_an_overhead_is_against_the_system_s_own_off_run():
    runs = {"leto-off": {"mean_s": 0.2, "max_s": 0.21},
            "leto-shadow": {"mean_s": 0.201, "max_s": 0.3, "checkpoints": [1, 2]},
            "torch-off": {"mean_s": 0.1, "max_s": 0.1},
            "dcp-async": {"mean_s": 0.15, "max_s": 9.0, "checkpoints": [1]}}
    t = B.overheads(runs)
    assert set(t) == {"leto-shadow", "dcp-async"}           # leto-trainer did not run
    assert round(t["leto-shadow"]["overhead_pct"], 6) == 0.5
    assert round(t["dcp-async"]["overhead_pct"], 6) == 50.0
    assert t["dcp-async"]["baseline"] == "torch-off" and t["leto-shadow"]["checkpoints"] == 2
