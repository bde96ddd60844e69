"""Failure-injection spec grammar, validation, canonical text and JSON wire form (no processes)."""
from __future__ import annotations

import json
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leto_run import inject as I
from leto_run.errors import ConfigError
from leto_run.inject import InjectKind, InjectSpec, parse_inject, parse_inject_mapping


@pytest.mark.parametrize("text, kind, rank, after, step, sig, attempt, canon", [
    ("kill:rank=1:after=5s", InjectKind.KILL, 1, 5.0, None, 9, 0, "kill:rank=1:after=5s"),
    ("hang:rank=0:step=20", InjectKind.HANG, 0, None, 20, 0, 0, "hang:rank=0:step=20"),
    ("signal=SIGSEGV:rank=3:after=500ms:attempt=1", InjectKind.SIGNAL, 3, 0.5, None, 11, 1,
     "signal=SIGSEGV:rank=3:after=0.5s:attempt=1"),
    ("signal=11:rank=0:after=2.5", InjectKind.SIGNAL, 0, 2.5, None, 11, 0,
     "signal=SIGSEGV:rank=0:after=2.5s"),
    ("signal=segv:rank=0:step=0", InjectKind.SIGNAL, 0, None, 0, 11, 0, "signal=SIGSEGV:rank=0:step=0"),
    ("signal=ABRT:rank=2:after=1m", InjectKind.SIGNAL, 2, 60.0, None, int(signal.SIGABRT), 0,
     "signal=SIGABRT:rank=2:after=60s"),
    (" KILL : rank=7 : after=0 : attempt=0 : role=active ", InjectKind.KILL, 7, 0.0, None, 9, 0,
     "kill:rank=7:after=0s"),
    ("kill:attempt=2:after=1e-3:rank=4", InjectKind.KILL, 4, 0.001, None, 9, 2,
     "kill:rank=4:after=0.001s:attempt=2"),
])
def test_parse_valid(text, kind, rank, after, step, sig, attempt, canon):
    s = parse_inject(text)
    assert (s.kind, s.rank, s.after_s, s.step, s.signal, s.attempt, s.role) == \
        (kind, rank, after, step, sig, attempt, "active")
    assert s.text == canon
    assert parse_inject(s.text) == s                 # canonical text parses back to the same spec
    assert s.trigger == ("after" if after is not None else "step")


def test_json_roundtrip_is_plain_and_self_describing():
    s = parse_inject("signal=SIGBUS:rank=1:step=3:attempt=1")
    d = s.to_json()
    assert json.loads(json.dumps(d)) == d            # only JSON types
    assert d["kind"] == "signal" and d["signal"] == int(signal.SIGBUS)
    assert d["signal_name"] == "SIGBUS" and d["text"] == s.text and d["step"] == 3
    assert InjectSpec.from_json(d) == s
    assert InjectSpec.from_json(json.loads(json.dumps(d))) == s


@pytest.mark.parametrize("bad", [{"kind": "kill"}, {"kind": "kill", "rank": 0, "after_s": 1, "x": 1},
                                 {"kind": "bogus", "rank": 0, "after_s": 1}, [1, 2],
                                 {"kind": "kill", "rank": 0}])
def test_from_json_rejects(bad):
    with pytest.raises(ConfigError):
        InjectSpec.from_json(bad)


def test_direct_construction_defaults_and_checks():
    assert InjectSpec(kind=InjectKind.HANG, rank=0, step=1).signal == 0    # arg-less kind's own signal
    assert InjectSpec(kind="kill", rank=2, after_s=1).kind is InjectKind.KILL
    assert InjectSpec(kind="kill", rank=2, after_s=1, text="junk").text == "kill:rank=2:after=1s"
    for kw in (dict(rank=-1, after_s=1), dict(rank=0), dict(rank=0, after_s=1, step=2),
               dict(rank=0, after_s=float("inf")), dict(rank=0, after_s=-1),
               dict(rank=0, step=-3), dict(rank=0, after_s=1, role="shadow"),
               dict(rank=True, after_s=1), dict(rank=0, after_s=1, attempt=-1),
               dict(rank=0, after_s=1, signal=11)):
        with pytest.raises(ConfigError):
            InjectSpec(kind=InjectKind.KILL, **kw)
    with pytest.raises(ConfigError):
        InjectSpec(kind=InjectKind.SIGNAL, rank=0, after_s=1, signal=int(signal.SIGCHLD))


@pytest.mark.parametrize("text, words", [
    ("", ["empty"]),
    ("kil:rank=1:after=5s", ["unknown kind", "did you mean 'kill'"]),
    ("kill:rank=1", ["exactly one trigger", "none"]),
    ("kill:rank=1:after=5s:step=3", ["exactly one trigger", "after and step"]),
    ("kill:after=5s", ["missing rank"]),
    ("signal:rank=1:after=1", ["needs an argument"]),
    ("signal=:rank=1:after=1", ["needs an argument"]),
    ("signal=SIGFOO:rank=1:after=1", ["not a signal"]),
    ("signal=SIGCHLD:rank=1:after=1", ["does not stop or fail"]),
    ("signal=0:rank=1:after=1", ["not a signal"]),
    ("kill=9:rank=1:after=1", ["takes no argument"]),
    ("hang=1:rank=1:after=1", ["takes no argument"]),
    ("kill:rnak=1:after=1", ["unknown key 'rnak'", "did you mean 'rank'"]),
    ("kill:rank=-1:after=1", ["rank", "non-negative"]),
    ("kill:rank=x:after=1", ["rank"]),
    ("kill:rank=1:after=xs", ["after", "not a duration"]),
    ("kill:rank=1:after=-2s", ["after", "not a duration"]),
    ("kill:rank=1:step=1.5", ["step"]),
    ("kill:rank=1:after=1:attempt=-1", ["attempt"]),
    ("kill:rank=1:after=1:role=shadow", ["role 'shadow'"]),
    ("kill:rank=1:rank=2:after=1", ["given twice"]),
    ("kill:rank=1:after=5s:", ["empty field"]),
    ("kill::rank=1:after=5s", ["empty field"]),
    ("kill:rank:after=5s", ["needs a value"]),
    ("kill:rank=:after=5s", ["needs a value"]),
])
def test_parse_rejects_with_key_source_and_fix(text, words):
    with pytest.raises(ConfigError) as ei:
        parse_inject(text, "--inject", key="inject[3]")
    e = ei.value
    assert e.key == "inject[3]" and e.source == "--inject" and e.fix
    msg = str(e)
    assert msg.startswith("inject[3] (--inject): ")
    for w in words:
        assert w in msg, msg


def test_mapping_form_matches_string_form():
    m = parse_inject_mapping({"kind": "signal", "signal": "SIGSEGV", "rank": 1, "after": "500ms",
                              "attempt": 1})
    assert m == parse_inject("signal=SIGSEGV:rank=1:after=500ms:attempt=1")
    assert parse_inject_mapping({"kind": "kill", "rank": 0, "after": 5}) == \
        parse_inject("kill:rank=0:after=5s")
    assert parse_inject_mapping({"kind": "hang", "rank": 2, "step": 20}).step == 20


@pytest.mark.parametrize("bad, words", [
    ({"rank": 1, "after": 1}, ["no 'kind'"]),
    ({"kind": "kill", "rank": 1, "after": 1, "rnak": 2}, ["did you mean 'rank'"]),
    ({"kind": "kill", "rank": [1], "after": 1}, ["not a scalar"]),
    ({"kind": "kill", "rank": 1, "after": None}, ["not a scalar"]),
])
def test_mapping_form_rejects(bad, words):
    with pytest.raises(ConfigError) as ei:
        parse_inject_mapping(bad, "job.yaml:9", key="inject[0]")
    assert ei.value.source == "job.yaml:9"
    for w in words:
        assert w in str(ei.value)


def test_registry_grows_without_changing_the_spec_shape(monkeypatch):
    """A later kind (e.g. pages) is one registry entry; its extra keys land in params."""
    monkeypatch.setattr(I, "KINDS", {**I.KINDS, "kill": I.KindRule(
        InjectKind.KILL, "test kind with extras", 9,
        extra_keys={"lane": I.KeyRule(I.COMMON_KEYS["step"].parse, "lane=L"),   # an int >= 0
                    "tier": I.KeyRule(str, "tier=device|host")},
        required_extra=frozenset({"lane"}))})
    s = parse_inject("kill:rank=0:step=1:tier=device:lane=3")
    assert s.params == (("lane", 3), ("tier", "device"))
    assert s.text == "kill:rank=0:step=1:lane=3:tier=device"
    assert InjectSpec.from_json(s.to_json()) == s
    with pytest.raises(ConfigError, match="needs lane"):
        parse_inject("kill:rank=0:step=1")


def test_for_rank_selects_rank_and_attempt():
    specs = [parse_inject(t) for t in ("kill:rank=1:after=1", "hang:rank=1:step=2:attempt=1",
                                       "kill:rank=0:after=1")]
    assert I.for_rank(specs, 1, 0) == (specs[0],)
    assert I.for_rank(specs, 1, 1) == (specs[1],)
    assert I.for_rank(specs, 2, 0) == ()


def test_signal_helpers():
    assert I.signal_number("term") == I.signal_number("SIGTERM") == I.signal_number("15") == 15
    assert I.signal_number(10) == 10
    assert I.signal_name(15) == "SIGTERM"
    for bad in ("SIGFOO", "SIG_DFL", "999", True):
        with pytest.raises(ValueError):
            I.signal_number(bad)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["kill", "hang", "signal=SIGSEGV", "signal=SIGUSR1", "signal=6"]),
       rank=st.integers(0, 10_000), attempt=st.integers(0, 50),
       trigger=st.one_of(
           st.integers(0, 10**6).map(lambda n: f"step={n}"),
           st.integers(0, 10**6).map(lambda n: f"after={n}ms"),
           st.floats(0, 1e6, allow_nan=False, allow_infinity=False).map(lambda x: f"after={x!r}")))
def test_property_canonical_text_and_json_are_fixed_points(kind, rank, attempt, trigger):
    s = parse_inject(f"{kind}:{trigger}:attempt={attempt}:rank={rank}")
    assert parse_inject(s.text) == s
    assert InjectSpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert s.rank == rank and s.attempt == attempt
