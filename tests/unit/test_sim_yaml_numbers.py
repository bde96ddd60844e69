"""The simulator's YAML reads a number as its CLI does (leto_sim/config.py `_Loader`): `010` is
10, not YAML 1.1's octal 8; hex, base 60, `1_000` and `yes` are refused by the field's name."""
from __future__ import annotations

from pathlib import Path

import pytest

from leto_sim.config import SimConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = (ROOT / "configs/sim/small.yaml").read_text()


def _write(tmp_path: Path, old: str, new: str) -> Path:
    assert old in SMALL
    p = tmp_path / "sim.yaml"
    p.write_text(SMALL.replace(old, new, 1))
    return p


def test_leading_zero_is_decimal(tmp_path):
    cfg = load_config(_write(tmp_path, "microbatches: 8 ", "microbatches: 010 "))
    assert cfg.workload.microbatches == 10          # YAML 1.1 would give 8
    cfg = load_config(_write(tmp_path, "seeds: 10", "seeds: 012"))
    assert cfg.failures.seeds == 12


def test_explicit_int_tag_is_decimal(tmp_path):
    cfg = load_config(_write(tmp_path, "microbatches: 8 ", "microbatches: !!int 010 "))
    assert cfg.workload.microbatches == 10


@pytest.mark.parametrize("text", ["0x10", "1_0", "1:4", "0o10", "0b10"])
def test_non_decimal_integers_are_refused_by_field(tmp_path, text):
    with pytest.raises(SimConfigError) as e:
        load_config(_write(tmp_path, "microbatches: 8 ", f"microbatches: {text} "))
    assert e.value.field == "workload.pipeline.microbatches"
    assert text in str(e.value)


def test_yes_is_not_a_boolean(tmp_path):
    with pytest.raises(SimConfigError) as e:
        load_config(_write(tmp_path, "overlap: true", "overlap: yes"))
    assert e.value.field == "workload.sync.overlap"


def test_floats_and_durations_still_read(tmp_path):
    cfg = load_config(_write(tmp_path, "hof_ratio: 0.5", "hof_ratio: 5e-1"))
    assert cfg.failures.hof_ratio == 0.5
    with pytest.raises(SimConfigError) as e:
        load_config(_write(tmp_path, "hof_ratio: 0.5", "hof_ratio: 0_5"))
    assert e.value.field == "failures.hof_ratio"
    cfg = load_config(ROOT / "configs/sim/small.yaml")
    assert cfg.workload.microbatches == 8 and cfg.failures.mttf == 600
