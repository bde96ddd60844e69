"""The failure policy's pure functions (leto_run.decisions), its bookkeeping
(leto_run.recovery_policy) and the error-file identity (leto_run.failures), case by case."""
import json

import pytest

from leto_run.decisions import (Action, Budget, Failure, FailureKind, PastFailure, SlotView,
                                Verdict, classify_failure, decide_inplace, inplace_budget)
from leto_run.failures import error_identity, failure_from_exit
from leto_run.recovery_policy import FailurePolicy
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_run.worker_env import WorkerIdentity
from leto_runtime.wire.contract import UNRECOVERABLE_EXIT

TB = "ValueError at /job/train.py:42 in step_fn"


def f(exitcode=1, step=5, error=None, hang=False, injected=None, progressed=True, rank=1,
      script_error=False):
    how = f"Signal {-exitcode}" if exitcode < 0 else f"exit code {exitcode}"
    return Failure(rank, exitcode, how, step=step, error=error, hang=hang, injected=injected,
                   progressed=progressed, script_error=script_error)


def past(failure, generation=0, mono=0.0, inplace=True):
    return PastFailure.of(failure, generation, mono, inplace)


# (failure, the last recovered failure, verdict, kind, words in the reason)
CASES = [
    (f(UNRECOVERABLE_EXIT), None, Verdict.LOST_STATE, FailureKind.LOST_STATE, "retained state"),
    (f(1), None, Verdict.TRANSIENT, FailureKind.EXIT, "the first failure"),
    (f(1), past(f(1)), Verdict.DETERMINISTIC, FailureKind.EXIT, "again at step 5 the same way"),
    (f(1, step=9), past(f(1)), Verdict.TRANSIENT, FailureKind.EXIT, "not a repeat"),
    # the same way one step later: a promoted trainer redid step 5 and failed right after it
    (f(1, step=6), past(f(1)), Verdict.DETERMINISTIC, FailureKind.EXIT, "one step after"),
    (f(-9, step=6), past(f(1)), Verdict.TRANSIENT, FailureKind.SIGNAL, "not a repeat"),
    (f(1, step=7), past(f(1)), Verdict.TRANSIENT, FailureKind.EXIT, "not a repeat"),
    (f(2), past(f(1)), Verdict.TRANSIENT, FailureKind.EXIT, "not a repeat"),
    (f(1, error=TB), past(f(1, error=TB)), Verdict.DETERMINISTIC, FailureKind.EXCEPTION, TB),
    (f(1, error=TB), past(f(1, error="KeyError at /job/train.py:42 in step_fn")),
     Verdict.TRANSIENT, FailureKind.EXCEPTION, "not a repeat"),
    (f(-11), past(f(-11)), Verdict.DETERMINISTIC, FailureKind.SIGNAL, "SIGSEGV"),
    (f(-9), past(f(-11)), Verdict.TRANSIENT, FailureKind.SIGNAL, "SIGKILL"),
    (f(-9, injected="kill:rank=1:step=5"), past(f(-9)), Verdict.TRANSIENT,
     FailureKind.SIGNAL, "injected fault"),
    (f(-9, hang=True), past(f(-9, hang=True)), Verdict.DETERMINISTIC, FailureKind.HANG, "hang"),
    (f(-9, hang=True), past(f(-9)), Verdict.TRANSIENT, FailureKind.HANG, "not a repeat"),
    # no step completed since the last recovery, the same way: recovery cannot get past it
    (f(1, step=None, progressed=False), past(f(1, step=7)), Verdict.DETERMINISTIC,
     FailureKind.EXIT, "before its generation completed a step"),
    (f(1, step=None, progressed=False), past(f(1, step=None)), Verdict.DETERMINISTIC,
     FailureKind.EXIT, "before its first step"),
    (f(1, step=None, progressed=False), past(f(-9, step=7)), Verdict.TRANSIENT,
     FailureKind.EXIT, "not a repeat"),
    # two generations in a row without a completed step, whatever the ways
    (f(1, step=None, progressed=False), past(f(-11, step=None, progressed=False)),
     Verdict.DETERMINISTIC, FailureKind.EXIT, "no progress since two failures"),
    (f(1, step=8, progressed=True), past(f(-11, step=None, progressed=False)),
     Verdict.TRANSIENT, FailureKind.EXIT, "not a repeat"),
    (f(-9, step=None, progressed=False, injected="kill:rank=1:step=0:gen=1:at=recovery.finish"),
     past(f(-9, step=None, progressed=False)), Verdict.TRANSIENT, FailureKind.SIGNAL,
     "injected fault"),
    # an error of the script the runtime marked: never a HOF, first failure or not, injected
    # fault or not (at a new step each time: a promoted trainer meets it one step later)
    (f(1, error=TB, script_error=True), None, Verdict.DETERMINISTIC, FailureKind.EXCEPTION,
     "an error of the script"),
    (f(1, step=6, error=TB, script_error=True), past(f(1, step=5, error=TB)),
     Verdict.DETERMINISTIC, FailureKind.EXCEPTION, "every generation would meet again"),
    (f(1, error=TB, script_error=True, injected="kill:rank=1:step=9"), None,
     Verdict.DETERMINISTIC, FailureKind.EXCEPTION, "not a HOF"),
    # a HOF another node declared says nothing about the way a local failure fails
    (f(1), past(None), Verdict.TRANSIENT, FailureKind.EXIT, "the first failure"),
]


@pytest.mark.parametrize("failure,last,verdict,kind,words", CASES)
def test_classify_failure(failure, last, verdict, kind, words):
    c = classify_failure(failure, last)
    assert (c.verdict, c.kind) == (verdict, kind) and words in c.reason, c
    assert c.fields()["verdict"] == verdict.value


def ready(g=1):
    return [SlotView(0, True, g), SlotView(1, True, g)]


def test_a_deterministic_failure_falls_back_even_with_shadows_ready():
    d = decide_inplace("inplace", 1, [f(1)], ready(2), history=(past(f(1)),))
    assert d.action == Action.FALL_BACK and "not a HOF" in d.reason
    assert d.classification.verdict == Verdict.DETERMINISTIC
    d = decide_inplace("inplace", 1, [f(1, step=8)], ready(2), history=(past(f(1)),))
    assert d.action == Action.INPLACE and d.classification.verdict == Verdict.TRANSIENT


def test_the_budget_counts_inplace_recoveries_in_a_sliding_window():
    hist = (past(f(1, step=1), mono=0.0), past(f(1, step=2), mono=50.0),
            past(f(1, step=3), mono=60.0, inplace=False))       # a restart: not counted
    b = Budget(max_recoveries=2, window=100.0)
    assert inplace_budget(hist, b, now=99.0)[0] is False
    assert inplace_budget(hist, b, now=100.5)[0] is True          # the first one slid out
    d = decide_inplace("inplace", 3, [f(1, step=9)], ready(4), history=hist, budget=b, now=99.0)
    assert d.action == Action.FALL_BACK and "--max-inplace-recoveries 2" in d.reason
    off = decide_inplace("inplace", 0, [f(-9)], ready(1), budget=Budget(0, 100.0))
    assert off.action == Action.FALL_BACK and "--max-inplace-recoveries 0" in off.reason


def test_a_remote_hof_is_followed_whatever_the_local_budget():
    d = decide_inplace("inplace", 3, [], ready(4), remote_hof="node b (rank 5)",
                       budget=Budget(0, 100.0))
    assert d.action == Action.INPLACE and d.classification is None


def test_a_state_manager_gone_for_good_makes_every_recovery_unrecoverable():
    why = "the state manager of slot 1 is gone for good (it died 6 times within 60 s)"
    d = decide_inplace("inplace", 0, [f(-9)], ready(1), retained_lost=why)
    assert d.action == Action.UNRECOVERABLE and "slot 1 is gone for good" in d.reason
    d = decide_inplace("inplace", 0, [f(-9)], [SlotView(0, False, None)], retained_lost=why)
    assert d.action == Action.UNRECOVERABLE          # a restart could not serve it either
    assert decide_inplace("inplace", 0, [], ready(1), retained_lost=why).action == Action.CONTINUE


def test_a_slot_not_in_place_is_the_reason_before_the_classification():
    d = decide_inplace("inplace", 1, [f(1)], [SlotView(0, True, 2), SlotView(1, False, None)],
                       history=(past(f(1)),))
    assert d.action == Action.FALL_BACK and "does not run in place" in d.reason
    assert d.classification.verdict == Verdict.DETERMINISTIC     # still in the event log


def test_error_identity_is_the_exception_type_and_innermost_frame():
    stack = ('Traceback (most recent call last):\n'
             '  File "/job/train.py", line 90, in <module>\n    main()\n'
             '  File "/job/train.py", line 42, in step_fn\n    raise ValueError(x)\n'
             'ValueError: bad batch 17\n')
    msg = {"message": "ValueError: bad batch 17", "extraInfo": {"py_callstack": stack}}
    assert error_identity(msg) == TB
    other = {"message": "ValueError: bad batch 18", "extraInfo": {"py_callstack": stack}}
    assert error_identity(other) == TB                   # the message text does not count
    assert error_identity({"message": "RuntimeError: x", "extraInfo": {}}) == "RuntimeError: x"
    assert error_identity("custom failure\nmore") == "custom failure"
    assert error_identity("") is None and error_identity({"message": ""}) is None


def record(tmp_path, content, name="error.json"):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    return failure_from_exit(rank=1, local_rank=1, role="active", generation=0, attempt=0,
                             pid=123, exitcode=1, how="exit code 1", error_file=str(p),
                             wall=0.0, mono=0.0, host="h", step=5)


def test_failure_records_carry_the_error_identity_and_survive_a_corrupt_error_file(tmp_path):
    stack = 'File "/job/train.py", line 42, in step_fn\nValueError: x\n'
    rec = record(tmp_path, json.dumps({"message": {
        "message": "ValueError: x", "extraInfo": {"py_callstack": stack, "timestamp": "1"}}}))
    assert rec.error == TB and rec.step == 5 and "ValueError" in rec.message
    assert record(tmp_path, None, "none.json").error is None
    cut = record(tmp_path, '{"message": {"message": "Val', "cut.json")   # killed mid-write
    assert cut.error is None and "unreadable" in cut.message


class _Proc:
    def __init__(self, pid):
        self.pid = pid


def slot_with(rank, pid, steps, generation=1):
    ident = WorkerIdentity(local_rank=rank, global_rank=rank, role_rank=rank, group_rank=0,
                           world_size=2, local_world_size=2, role_world_size=2,
                           group_world_size=1, role_name="default")
    sp = SlotProcess(role=SlotRole.ACTIVE, generation=generation, attempt=0, proc=_Proc(pid),
                     error_file="")
    for s in steps:
        sp.on_beat(s, now=1.0, hang_timeout=0.0)
    return RankSlot(identity=ident, procs={SlotRole.ACTIVE: sp}), sp


def test_policy_facts_read_progress_and_injections_from_the_slots(tmp_path):
    s0, sp0 = slot_with(0, 100, [5])
    s1, sp1 = slot_with(1, 101, [5])
    sp1.move(ProcState.FAILED)
    sp1.injected = "kill:rank=1:step=5:gen=1"
    rec = record(tmp_path, None, "none.json")
    rec = type(rec)(**{**rec.__dict__, "pid": 101, "generation": 1})
    pol = FailurePolicy(20, 3600.0)
    [fact] = pol.facts([s0, s1], 1, [rec])
    assert fact.injected == "kill:rank=1:step=5:gen=1" and fact.progressed is False
    sp0.on_beat(6, now=2.0, hang_timeout=0.0)                     # rank 0 finished step 5
    assert pol.facts([s0, s1], 1, [rec])[0].progressed is True
    assert pol.facts([s0, s1], 2, [rec]) == []                    # another generation's
    pol.record(fact, 1, now=10.0, inplace=True)
    pol.record(None, 2, now=5000.0, inplace=True)                 # the first slid out
    assert [h.generation for h in pol.history] == [2] and pol.history[0].kind is None
    pol.record(fact, 3, now=20000.0, inplace=False)
    assert [h.generation for h in pol.history] == [3]             # the last one always stays


@pytest.mark.parametrize("exc,marked", [("PortingError('kept a view')", True),
                                        ("ValueError('a bug')", False)])
def test_the_runtime_s_excepthook_writes_the_error_file_and_marks_script_errors(
        tmp_path, exc, marked):
    """A real trainer process without @record: the runtime's hook writes torch's error-file
    format (read back by the agent's reader, with the identity of the raising frame) and the
    script-error mark only for a ScriptError; the traceback still reaches stderr."""
    import subprocess
    import sys
    err = tmp_path / "error.json"
    code = ("from leto_runtime import errors\nfrom leto_runtime.errors import PortingError\n"
            f"errors.install(None)\nerrors.install({str(err)!r})\n"
            f"def step_fn():\n    raise {exc}\nstep_fn()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.count("Traceback") == 1, p.stderr
    rec = failure_from_exit(rank=1, local_rank=1, role="active", generation=0, attempt=0,
                            pid=p.returncode, exitcode=1, how="exit code 1", error_file=str(err),
                            wall=0.0, mono=0.0, host="h", step=3)
    assert rec.script_error is marked
    assert rec.error.startswith(exc.split("(")[0] + " at <string>:") and "step_fn" in rec.error
    assert [x for x in tmp_path.iterdir()] == [err]          # no temporary file left
