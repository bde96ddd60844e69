"""Injections that can never fire are reported, never silently ignored: the agent's ledger
(leto_run.unfired) and the runtime's own check (leto_runtime.faults, in a real trainer-side
process sending real datagrams to a real heartbeat socket)."""
import json
import os
import subprocess
import sys

from leto_run.heartbeat import HeartbeatServer
from leto_run.inject import parse_inject
from leto_run.unfired import InjectLedger, unfired_reason
from leto_runtime.wire import contract as C


def spec(text):
    return parse_inject(text)


def test_unfired_reasons():
    ran = {(0, 0, 0): None, (1, 0, 0): 7, (1, 0, 1): 12}
    cases = [
        ("kill:rank=0:step=3", "never reported a training step"),
        ("kill:rank=1:step=9", "reported step 7 at most, never step 9"),
        ("kill:rank=1:step=3:attempt=2", "restart attempt 2 never started"),
        ("kill:rank=1:step=3:gen=2", "generation 2 of attempt 0 never ran"),
        ("kill:rank=1:after=30s:gen=1", "ended before after=30s"),
        ("kill:rank=1:step=4:at=rmu.writeback.drop", "never the point at=rmu.writeback.drop"),
    ]
    for text, words in cases:
        assert words in unfired_reason(spec(text), ran, last_attempt=0), text


def test_the_ledger_reports_what_neither_fired_nor_was_reported():
    specs = [spec("kill:rank=0:step=3"), spec("kill:rank=0:step=3"), spec("hang:rank=1:step=2"),
             spec("kill:rank=1:step=4:at=rmu.update:group=9"), spec("kill:rank=2:step=1")]
    led = InjectLedger()
    led.ran(0, 0, 0)
    led.ran(1, 0, 0)
    led.stepped(1, 0, 0, 5)
    led.fired("kill:rank=0:step=3")                  # one of the two identical specs
    led.fired("hang:rank=1:step=2")
    led.reported("kill:rank=1:step=4:at=rmu.update:group=9")     # the runtime said why
    left = led.unfired(specs, ranks={0, 1})          # rank 2 lives on another node
    assert [(s.text, "never reported a training step" in why) for s, why in left] == [
        ("kill:rank=0:step=3", True)]


RUNTIME = r"""
import json, os, sys
from leto_runtime.context import Context
from leto_runtime.faults import Faults
f = Faults(Context.from_env())
for step in (0, 1):
    f.fire("step", step=step)
    for g in (0, 1):
        f.fire("rmu.load", step=step, group=g)
        for c in (0, 1, 2):
            f.fire("rmu.update", step=step, group=g, chunk=c)
    f.fire("rmu.done", step=step)
    f.fire("rmu.settle", step=step)
print("alive", flush=True)
"""


def test_the_runtime_reports_rmu_injections_that_name_what_the_model_lacks(tmp_path):
    plan = [spec(t).to_json() for t in (
        "kill:rank=0:step=0:at=rmu.update:group=7:chunk=0",     # no group 7
        "kill:rank=0:step=0:at=rmu.update:group=1:chunk=6",     # group 1 has chunks 0..2
        "kill:rank=0:step=0:at=rmu.writeback.drop",             # a point step 0 never reaches
        "kill:rank=0:step=1:at=recovery.localize",              # generation 0 never recovers
        "kill:rank=0:step=5:at=rmu.load",                       # a step not reached: the agent's
        "kill:rank=0:step=1:at=rmu.lookahead:group=0:chunk=0")]  # no wait there (CPU: none at all)
    server = HeartbeatServer(str(tmp_path / "hb.sock"))
    env = {**os.environ, C.LETO_CONTRACT_VERSION: str(C.CONTRACT_VERSION),
           C.LETO_HEARTBEAT_SOCKET: server.path, C.LETO_INJECT_PLAN: json.dumps(plan),
           C.LETO_RECOVERY: "inplace", C.LETO_GENERATION: "0", "RANK": "0"}
    try:
        p = subprocess.Popen([sys.executable, "-c", RUNTIME], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "alive" in out, err
        beats = [b for b in server.drain({p.pid}) if b.kind == "unfired"]
    finally:
        server.close()
    got = {json.loads(b.detail)["spec"]: (b.step, json.loads(b.detail)["reason"]) for b in beats}
    assert got[plan[0]["text"]] == (0, "the model has no protection group 7: at=rmu.update of "
                                       "step 0 ran for group(s) 0..1")
    assert got[plan[1]["text"]] == (0, "protection group 1 has no chunk 6: at=rmu.update of "
                                       "step 0 ran for its chunk(s) 0..2")
    assert got[plan[2]["text"]] == (0, "step 0 passed without reaching at=rmu.writeback.drop")
    assert "never reached at=recovery.localize" in got[plan[3]["text"]][1]
    assert plan[4]["text"] not in got
    step, why = got[plan[5]["text"]]
    assert step == 1 and "LETO_RMU_LOOKAHEAD" in why and "no chunk" not in why, why
    assert len(got) == 5
