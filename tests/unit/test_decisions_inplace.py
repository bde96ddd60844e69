"""decide_inplace: when a HOF is recovered in place, when the job ends, when it falls back."""
from leto_run.decisions import Action, Failure, SlotView, decide_inplace
from leto_runtime.wire.contract import UNRECOVERABLE_EXIT

KILL = Failure(rank=1, exitcode=-9, how="Signal 9 (SIGKILL)")


def ready(g=1):
    return [SlotView(0, True, g), SlotView(1, True, g)]


def test_inplace_when_every_slot_has_a_shadow_of_the_next_generation():
    d = decide_inplace("inplace", 0, [KILL], ready(1))
    assert d.action == Action.INPLACE and "rank 1 failed" in d.reason
    assert "generation 1" in d.reason and not d.counts_as_restart


def test_remote_hof_alone_is_recovered_in_place():
    d = decide_inplace("inplace", 3, [], ready(4), remote_hof="node b (rank 5)")
    assert d.action == Action.INPLACE and "node b" in d.reason


def test_nothing_happened():
    assert decide_inplace("inplace", 0, [], ready()).action == Action.CONTINUE


def test_unrecoverable_exit_ends_the_job_even_with_shadows():
    lost = Failure(rank=0, exitcode=UNRECOVERABLE_EXIT, how="exit code 86")
    d = decide_inplace("inplace", 0, [KILL, lost], ready())
    assert d.action == Action.UNRECOVERABLE and "rank 0" in d.reason


def test_unrecoverable_exit_means_nothing_in_restart_mode():
    lost = Failure(rank=0, exitcode=UNRECOVERABLE_EXIT, how="exit code 86")
    assert decide_inplace("restart", 0, [lost], []).action == Action.FALL_BACK


def test_fallbacks_say_why():
    cases = [
        (dict(slots=[SlotView(0, True, 1), SlotView(1, False, None)]), "does not run in place"),
        (dict(slots=[SlotView(0, True, 1), SlotView(1, True, None)]), "no live shadow"),
        (dict(slots=[SlotView(0, True, 2), SlotView(1, True, 1)]), "shadow of generation 2"),
        (dict(slots=ready(), shadows_unusable="a shadow died on node b"), "a shadow died"),
        (dict(slots=[]), "no local slots"),
    ]
    for kw, words in cases:
        d = decide_inplace("inplace", 0, [KILL], **kw)
        assert d.action == Action.FALL_BACK and words in d.reason, (kw, d)
    d = decide_inplace("restart", 0, [KILL], ready())
    assert d.action == Action.FALL_BACK and "restart" in d.reason


def test_blame_hangs_spares_ranks_waiting_in_a_collective():
    from leto_run.decisions import blame_hangs
    # rank 0 hung at the start of a step; rank 1 waits for it in the gradient all-reduce
    blamed, why = blame_hangs({100: False, 101: True})
    assert blamed == {100} and "collective" in why
    # both stuck inside collectives (a collective that hangs by itself): both are blamed
    assert blame_hangs({100: True, 101: True})[0] == {100, 101}
    # both silent outside collectives, and the lone silent rank
    assert blame_hangs({100: False, 101: False})[0] == {100, 101}
    assert blame_hangs({101: True})[0] == {101}
    assert blame_hangs({})[0] == set()
    # rank 0 waits in the first agreement for rank 1, which is slow but beating: not a hang
    assert blame_hangs({100: True}, others_progressing=True)[0] == set()
    assert blame_hangs({100: True, 101: False}, others_progressing=True)[0] == {101}
    assert blame_hangs({100: False}, others_progressing=True)[0] == {100}
