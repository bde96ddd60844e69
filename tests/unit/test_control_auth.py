"""The job's MAC on control values (leto_runtime.control_auth, leto_runtime.auth_store) against
real TCPStores: what verifies, what is refused, and that torch's process-group formation goes
through the authenticated store (and fails on a forged key instead of using it)."""
import datetime
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from leto_runtime.auth_store import AuthStore
from leto_runtime.control_auth import (KEY_BYTES, ForgedControlKey, derive_job_key,
                                       key_from_hex, key_to_hex, mac_words, sign_value,
                                       verify_value, verify_words)
from leto_testing import ROOT

KEY = bytes(range(KEY_BYTES))
OTHER = bytes(KEY_BYTES)


def test_sign_verify_round_trip_and_every_forgery():
    v = sign_value(KEY, "leto/go/1/0", b'{"mono": 1.5}')
    assert verify_value(KEY, "leto/go/1/0", v) == b'{"mono": 1.5}'
    assert verify_value(KEY, "k", sign_value(KEY, "k", "")) == b""
    forgeries = {
        "plain value": b'{"mono": 1.5}',
        "other key": sign_value(OTHER, "leto/go/1/0", b'{"mono": 1.5}'),
        "replayed from rank 1": sign_value(KEY, "leto/go/1/1", b'{"mono": 1.5}'),
        "replayed from generation 2": sign_value(KEY, "leto/go/2/0", b'{"mono": 1.5}'),
        "payload changed": v[:-1] + b"0",
        "MAC flipped": v[:10] + bytes([v[10] ^ 1]) + v[11:],
        "truncated": v[:20],
        "empty": b"",
    }
    for what, bad in forgeries.items():
        with pytest.raises(ForgedControlKey) as e:
            verify_value(KEY, "leto/go/1/0", bad)
        assert e.value.key == "leto/go/1/0", what


def test_name_and_payload_boundary_is_unambiguous():
    # "ab" + "c" must not verify as "a" + "bc"
    with pytest.raises(ForgedControlKey):
        verify_value(KEY, "a", b"\x00LC1" + sign_value(KEY, "ab", b"c")[4:36] + b"bc")


def test_words_mac_binds_rank_and_values():
    words = [1, 7, 3, -1, 1, -1]
    mac = mac_words(KEY, "leto/agree/1/0/1", words)
    assert len(mac) == 4
    verify_words(KEY, "leto/agree/1/0/1", words, mac)
    for name, w in (("leto/agree/1/0/0", words), ("leto/agree/1/0/1", [1, 6, 3, -1, 1, -1])):
        with pytest.raises(ForgedControlKey):
            verify_words(KEY, name, w, mac)


def test_job_key_derivation_and_hex_form():
    secret = os.urandom(64)
    a, b = derive_job_key(secret, "job-a"), derive_job_key(secret, "job-b")
    assert len(a) == KEY_BYTES and a != b and a == derive_job_key(secret, "job-a")
    assert derive_job_key(os.urandom(64), "job-a") != a
    with pytest.raises(ValueError, match="at least 32"):
        derive_job_key(b"short", "job-a")
    assert key_from_hex(key_to_hex(a)) == a
    for bad in ("", "zz" * 32, "ab" * 31, "ab" * 33):
        with pytest.raises(ValueError, match="64 hex digits"):
            key_from_hex(bad)


@pytest.fixture
def tcp():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server, client


def test_auth_store_over_a_real_tcpstore(tcp):
    server, raw = tcp
    seen = []
    s = AuthStore(raw, KEY, on_forged=lambda k, why: seen.append(k))
    assert KEY.hex() not in repr(s)
    s.set("leto/hof/3", json.dumps({"rank": 1}))
    assert server.get("leto/hof/3") != b'{"rank": 1}'          # what lies in the store is signed
    assert json.loads(s.get("leto/hof/3")) == {"rank": 1}
    s.multi_set(["a", "b"], [b"1", b"2"])
    assert s.multi_get(["a", "b"]) == [b"1", b"2"]
    # compare_set: first writer wins, and the loser reads the winner's verified value
    assert s.compare_set("leto/hof/4", "", "first") == b"first"
    assert s.compare_set("leto/hof/4", "", "second") == b"first"
    assert s.compare_set("leto/hof/4", "first", "third") == b"third"
    # values written without the key, or copied from another key, are refused
    raw.set("leto/go/1/0", b'{"mono": 0}')
    server.set("leto/go/1/1", server.get("leto/hof/3"))
    for k in ("leto/go/1/0", "leto/go/1/1"):
        with pytest.raises(ForgedControlKey):
            s.get(k)
    raw.set("leto/hof/5", b"squatted")
    with pytest.raises(ForgedControlKey):
        s.compare_set("leto/hof/5", "", "mine")
    with pytest.raises(ForgedControlKey):
        s.multi_get(["a", "leto/go/1/0"])
    assert seen == ["leto/go/1/0", "leto/go/1/1", "leto/hof/5", "leto/go/1/0"]
    # existence and counters are the inner store's
    assert s.check(["leto/go/1/0"]) and not s.check(["nope"])
    assert s.add("n", 2) == 2 and s.add("n", 1) == 3
    with pytest.raises(NotImplementedError):
        s.append("a", b"x")
    # a store reached through a PrefixStore (as torch does) verifies under the full name
    p = dist.PrefixStore("leto/g1/e0/pg", s)
    p.set("x", b"v")
    assert s.get("leto/g1/e0/pg/x") == b"v"


_PG = """
import datetime, sys, torch, torch.distributed as dist
from leto_runtime.auth_store import AuthStore
from leto_runtime.control_auth import ForgedControlKey
port, world, forge = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "forge"
raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=20))
auth = AuthStore(raw, bytes(range(32)))   # referenced: torch's C++ holds no Python reference
store = dist.PrefixStore("leto/g1/e0/pg", auth)
try:
    dist.init_process_group("gloo", store=store, rank=0, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
except ForgedControlKey as e:
    print("forged", e.key, flush=True)
    sys.exit(0)
t = torch.ones(1)
dist.all_reduce(t)
print("formed", t.item(), flush=True)
dist.destroy_process_group()
"""


def test_process_group_forms_through_the_authenticated_store_and_refuses_a_forged_peer(tcp):
    """gloo reads every peer's address through the AuthStore: a one-rank group forms; with two
    ranks, a peer address another process wrote without the key makes the formation fail with
    ForgedControlKey (it is never connected to)."""
    server, raw = tcp
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(world, mode):
        return subprocess.run([sys.executable, "-c", _PG, str(server.port), str(world), mode],
                              capture_output=True, text=True, timeout=120, env=env)
    r = run(1, "ok")
    assert r.returncode == 0 and r.stdout.split() == ["formed", "1.0"], r.stderr[-2000:]
    # rank 1's address, as an attacker would write it (gloo's key under the group's prefix)
    raw.set("leto/g1/e0/pg/0//cpu//0/1", b"\x02\x00attacker-address")
    r = run(2, "forge")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["forged", "leto/g1/e0/pg/0//cpu//0/1"], r.stderr[-2000:]
