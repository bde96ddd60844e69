"""The `pages` injection kind: grammar, defaults, canonical text and JSON wire form."""
from __future__ import annotations

import json

import pytest

from leto_run.errors import ConfigError
from leto_run.inject import InjectKind, InjectSpec, parse_inject, parse_inject_mapping


@pytest.mark.parametrize("text, params, canon", [
    ("pages:rank=0:group=3:count=16:tier=device:after=5s",
     {"group": 3, "count": 16, "tier": "device"}, "pages:rank=0:after=5s:count=16:group=3:tier=device"),
    ("pages:rank=1:tier=host:count=1:step=20", {"tier": "host", "count": 1},
     "pages:rank=1:step=20:count=1:tier=host"),
    ("PAGES:rank=2:tier=HOST:part=p2:group=0:after=1", {"tier": "host", "part": "p2", "group": 0},
     "pages:rank=2:after=1s:group=0:part=p2:tier=host"),
    ("pages:rank=0:tier=device:first=100:count=16:after=0", {"tier": "device", "first": 100, "count": 16},
     "pages:rank=0:after=0s:count=16:first=100:tier=device"),
])
def test_parse_pages(text, params, canon):
    s = parse_inject(text)
    assert s.kind is InjectKind.PAGES and dict(s.params) == params and s.text == canon
    assert s.signal == 0                              # nothing is delivered to the process
    assert parse_inject(s.text) == s
    d = json.loads(json.dumps(s.to_json()))
    assert d["params"] == params and InjectSpec.from_json(d) == s


@pytest.mark.parametrize("text, words", [
    ("pages:rank=0:after=1s", ["needs tier"]),
    ("pages:rank=0:tier=gpu:after=1s", ["tier", "device, host"]),
    ("pages:rank=0:tier=device:count=0:after=1s", ["count", ">= 1"]),
    ("pages:rank=0:tier=device:group=-1:after=1s", ["group"]),
    ("pages:rank=0:tier=host:part=p3:after=1s", ["part"]),
    ("pages:rank=0:tier=device:pages=3:after=1s", ["unknown key 'pages'"]),
    ("pages=SIGKILL:rank=0:tier=device:after=1s", ["takes no argument"]),
    ("pages:rank=0:tier=device", ["exactly one trigger"]),
    ("kill:rank=0:tier=device:after=1s", ["unknown key 'tier'"]),
])
def test_pages_errors(text, words):
    with pytest.raises(ConfigError) as ei:
        parse_inject(text)
    msg = str(ei.value)
    for w in words:
        assert w in msg, msg


def test_pages_yaml_mapping_and_direct_construction():
    s = parse_inject_mapping({"kind": "pages", "rank": 1, "tier": "device", "group": 2,
                              "count": 16, "after": "3s"})
    assert s == parse_inject("pages:rank=1:tier=device:group=2:count=16:after=3s")
    with pytest.raises(ConfigError):
        InjectSpec(kind="pages", rank=0, after_s=1, params=(("count", 2),))   # tier missing
    with pytest.raises(ConfigError):
        InjectSpec(kind="pages", rank=0, after_s=1, params=(("tier", "device"), ("x", 1)))
