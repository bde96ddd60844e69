"""Pure decision functions and the slot state machine (no processes)."""
import pytest

from leto_run.decisions import (STALL_SHARE, Action, decide_group, guardian_verdict, hang_verdict,
                                linger_verdict, stall_verdict)
from leto_run.slot import IllegalTransition, ProcState, SlotProcess, SlotRole

R, S, F = ProcState.RUNNING, ProcState.SUCCEEDED, ProcState.FAILED


def test_success_needs_every_worker():
    assert decide_group([S, S], [], 0, 0).action == Action.SUCCEED
    assert decide_group([S, R], [], 0, 0).action == Action.CONTINUE


def test_failure_restarts_while_budget_remains():
    d = decide_group([F, R], [1], remaining_restarts=2, max_restarts=3)
    assert d.action == Action.RESTART and d.counts_as_restart
    assert "rank 1 failed" in d.reason and "restart 2 of 3" in d.reason


def test_failure_gives_up_with_reason():
    d = decide_group([F, R], [0], remaining_restarts=0, max_restarts=0)
    assert d.action == Action.GIVE_UP and "--max-restarts 0" in d.reason
    d = decide_group([F, R], [0], remaining_restarts=0, max_restarts=2)
    assert d.action == Action.GIVE_UP and "all 2 restarts used" in d.reason


def test_waiting_nodes_restart_without_counting():
    d = decide_group([R, R], [], 0, 0, nodes_waiting=1)
    assert d.action == Action.RESTART and not d.counts_as_restart


def test_failure_wins_over_success_of_others():
    assert decide_group([S, F], [1], 0, 0).action == Action.GIVE_UP


def test_hang_verdict():
    assert hang_verdict(10.0, None, None, 5.0)[0] is False        # no heartbeat yet
    assert hang_verdict(10.0, 12.0, 7.0, 5.0)[0] is False
    hung, why = hang_verdict(12.5, 12.0, 7.0, 5.0)
    assert hung and "5.5 s" in why
    assert hang_verdict(100.0, 12.0, 7.0, 0.0)[0] is False       # disabled


def test_hang_verdict_names_what_a_waited_for_process_owes():
    hung, why = hang_verdict(14.5, 14.0, 10.0, 4.0, "promoted, then silent")
    assert hung and why == "promoted, then silent for 4.5 s (--hang-timeout 4 s)"
    assert hang_verdict(13.9, 14.0, 10.0, 4.0, "promoted, then silent")[0] is False


def test_a_promoted_process_is_due_within_the_hang_timeout_of_its_promotion():
    """SlotProcess.expect: a promotion starts a hang clock where a shadow had none; its first
    sign of life (a beat) ends what it owed; new_role clears both, and the collective flag."""
    sp = _sp()
    sp.in_collective = True                       # demoted while it waited in a collective
    sp.new_role(SlotRole.ACTIVE, 1)
    assert (sp.hang_deadline, sp.awaiting, sp.in_collective) == (None, None, False)
    sp.expect(100.0, 4.0, "promoted, then silent")
    hung, why = hang_verdict(104.0, sp.hang_deadline, sp.last_beat, 4.0, sp.awaiting)
    assert hung and why.startswith("promoted, then silent for 4.0 s")
    sp.on_beat(None, now=103.0, hang_timeout=4.0)
    assert sp.awaiting is None and sp.hang_deadline == 107.0
    off = _sp()
    off.expect(100.0, 0.0, "promoted")            # --hang-timeout 0: never judged
    assert off.hang_deadline is None


def test_stall_verdict_gives_a_grace_only_when_the_agent_was_away():
    assert stall_verdict(1.0, 1.0, 10.0)[0] is False                 # on time
    assert stall_verdict(1.0 + STALL_SHARE * 10.0, 1.0, 10.0)[0] is False
    stalled, why = stall_verdict(14.0, 1.0, 10.0)                    # a 13 s stop
    assert stalled and "14.0 s" in why and "grace" in why and "--hang-timeout 10 s" in why
    assert stall_verdict(14.0, -0.5, 10.0)[0] is True                # a deadline already past
    assert stall_verdict(100.0, 1.0, 0.0)[0] is False                # hang detection off


def test_guardian_verdict_restarts_it_a_bounded_number_of_times():
    ok, why = guardian_verdict([], 100.0, 2, 60.0)
    assert ok and "death 1 of at most 2" in why
    assert guardian_verdict([50.0], 100.0, 2, 60.0)[0] is True
    ok, why = guardian_verdict([50.0, 90.0], 100.0, 2, 60.0)
    assert not ok and "3 times within 60 s" in why and "run directory" in why
    assert guardian_verdict([10.0, 20.0], 100.0, 2, 60.0)[0] is True   # outside the window


def test_linger_verdict_counts_from_the_later_of_its_bye_and_every_peer_past_its_loop():
    assert linger_verdict(50.0, None, 1.0, 5.0)[0] is False       # still in its loop
    assert linger_verdict(50.0, 1.0, None, 5.0)[0] is False       # a peer still in its loop
    assert linger_verdict(50.0, 1.0, 1.0, 0.0)[0] is False        # hang detection off
    assert linger_verdict(14.9, 2.0, 10.0, 5.0)[0] is False       # peers past since 10: 4.9 s
    slow, why = linger_verdict(15.5, 2.0, 10.0, 5.0)
    assert slow and "13.5 s ago" in why and "5.5 s after" in why
    assert linger_verdict(15.5, 10.0, 2.0, 5.0)[0] is True        # its bye came last
    assert linger_verdict(14.0, 10.0, 2.0, 5.0)[0] is False


class _P:
    pid = 1


def _sp():
    return SlotProcess(role=SlotRole.ACTIVE, generation=0, attempt=0, proc=_P(), error_file="")


def test_transitions_and_illegal_moves():
    sp = _sp()
    sp.on_beat(3, now=1.0, hang_timeout=5.0)
    assert sp.state == R and sp.step == 3 and sp.hang_deadline == 6.0
    sp.move(ProcState.STOPPING)
    sp.move(ProcState.STOPPED)
    with pytest.raises(IllegalTransition):
        sp.move(R)
    sp2 = _sp()
    sp2.move(F)
    with pytest.raises(IllegalTransition):
        sp2.move(S)
