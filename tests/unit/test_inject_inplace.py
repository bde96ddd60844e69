"""Injection keys of in-place recovery: gen=, at=POINT, group/chunk/garbage, and the plans."""
from __future__ import annotations

import pytest

from leto_run.errors import ConfigError
from leto_run.inject import (InjectSpec, parse_inject, parse_inject_mapping, timed_for_generation,
                             trainer_plan)


@pytest.mark.parametrize("text, canon", [
    ("kill:rank=1:step=5:gen=1", "kill:rank=1:step=5:gen=1"),
    ("kill:rank=1:step=5:gen=0:at=step", "kill:rank=1:step=5"),
    ("hang:rank=0:step=4:at=sync", "hang:rank=0:step=4:at=sync"),
    ("kill:garbage=1:chunk=2:group=0:at=rmu.update:step=3:rank=0",
     "kill:rank=0:step=3:at=rmu.update:chunk=2:garbage=1:group=0"),
    ("signal=SIGSEGV:rank=0:step=3:at=rmu.commit:group=1", "signal=SIGSEGV:rank=0:step=3:at=rmu.commit:group=1"),
    ("pages:rank=0:tier=device:step=2:at=rmu.load:group=1",
     "pages:rank=0:step=2:at=rmu.load:group=1:tier=device"),
    ("kill:rank=0:after=2s:gen=1", "kill:rank=0:after=2s:gen=1"),
])
def test_canonical_and_json_round_trip(text, canon):
    s = parse_inject(text)
    assert s.text == canon
    assert parse_inject(s.text) == s
    assert InjectSpec.from_json(s.to_json()) == s


def test_json_carries_what_the_runtime_reads():
    j = parse_inject("kill:rank=0:step=3:at=rmu.update:group=2:chunk=1:garbage=1:gen=2").to_json()
    assert (j["gen"], j["at"], j["group"], j["chunk"], j["garbage"], j["step"]) == \
        (2, "rmu.update", 2, 1, 1, 3)
    plain = parse_inject("kill:rank=0:step=3").to_json()
    assert (plain["gen"], plain["at"], plain["group"], plain["chunk"], plain["garbage"]) == \
        (0, "step", None, None, 0)
    pages = parse_inject("pages:rank=0:tier=device:group=3:step=1").to_json()
    assert pages["group"] is None and pages["params"]["group"] == 3


@pytest.mark.parametrize("text, words", [
    ("kill:rank=0:step=1:at=nowhere", ["not an injection point"]),
    ("kill:rank=0:step=1:at=rmu.updte", ["did you mean 'rmu.update'"]),
    ("kill:rank=0:after=1s:at=sync", ["needs a step trigger"]),
    ("kill:rank=0:step=1:group=1", ["rmu.* point"]),
    ("kill:rank=0:step=1:at=sync:garbage=1", ["rmu.* point"]),
    ("kill:rank=0:step=1:at=rmu.update:garbage=2", ["not 0 or 1"]),
    ("hang:rank=0:step=1:at=rmu.update:chunk=1", ["unknown key 'chunk'"]),
    ("kill:rank=0:step=1:gen=-1", ["gen"]),
])
def test_errors(text, words):
    with pytest.raises(ConfigError) as ei:
        parse_inject(text)
    for w in words:
        assert w in str(ei.value)


def test_yaml_mapping():
    m = parse_inject_mapping({"kind": "kill", "rank": 1, "step": 5, "gen": 1, "at": "rmu.update",
                              "chunk": 0})
    assert m == parse_inject("kill:rank=1:step=5:gen=1:at=rmu.update:chunk=0")


def test_plans_every_trainer_gets_all_generations_step_specs():
    specs = [parse_inject(t) for t in ("kill:rank=1:step=5", "kill:rank=1:step=3:gen=1",
                                       "kill:rank=1:after=2s", "kill:rank=0:step=1",
                                       "kill:rank=1:step=9:attempt=1")]
    plan = trainer_plan(specs, rank=1, attempt=0)
    assert [p["text"] for p in plan] == ["kill:rank=1:step=5", "kill:rank=1:step=3:gen=1"]
    assert trainer_plan(specs, rank=1, attempt=1)[0]["step"] == 9
    timed = [parse_inject(t) for t in ("kill:rank=1:after=1s", "kill:rank=1:after=1s:gen=1",
                                       "kill:rank=3:after=1s:gen=1")]
    assert [s.text for s in timed_for_generation(timed, {0, 1}, 0, 1)] == \
        ["kill:rank=1:after=1s:gen=1"]
    assert [s.text for s in timed_for_generation(timed, {0, 1}, 0, 0)] == ["kill:rank=1:after=1s"]
