"""The recovery report names the injection that caused a failure, says how a job ended and
why in-place recovery was not used (synthetic event lists; the integration tests in
tests/integration/test_failure_policy.py check the same on real runs)."""
from leto_run.report import format_report, recoveries


def ev(event, gen, mono, **kw):
    return {"event": event, "generation": gen, "mono": mono, **kw}


def test_detection_is_timed_from_the_injection_that_caused_the_failure():
    evs = [ev("inject", 0, 1.0, rank=1, spec="pages:rank=1:tier=host:count=1:step=2", step=2),
           ev("inject", 0, 2.7, rank=0, spec="kill:rank=0:step=4", step=4),   # another rank
           ev("inject", 0, 2.9, rank=1, spec="kill:rank=1:step=4", step=4),
           ev("failure_detected", 0, 2.905, rank=1, how="Signal 9 (SIGKILL)", step=4),
           ev("promote", 1, 2.91, rank=1)]
    [r] = recoveries(evs)
    assert r.injected == "kill:rank=1:step=4" and abs(r.detect_s - 0.005) < 1e-9


def test_lost_pages_name_the_failure_only_when_they_struck_in_its_step():
    trap = [ev("inject", 0, 3.0, rank=1, spec="pages:rank=1:step=4:tier=device:count=2", step=4),
            ev("failure_detected", 0, 3.002, rank=1, how="Signal 7 (SIGBUS)", step=4)]
    assert recoveries(trap)[0].injected.startswith("pages:rank=1:step=4")
    earlier = [ev("inject", 0, 1.0, rank=1, spec="pages:rank=1:step=2:tier=host:count=1", step=2),
               ev("failure_detected", 0, 2.7, rank=1, how="exit code 1", step=6)]
    [r] = recoveries(earlier)
    assert r.injected is None and r.detect_s is None


def test_an_end_of_the_job_is_its_own_section():
    """An unrecoverable end printed `respawned +-2474.5 ms | back at step None`: the shadows of
    the next generation were spawned before the failure."""
    evs = [ev("spawn", 1, 1.0, rank=0, role="shadow"), ev("spawn", 1, 1.0, rank=1, role="shadow"),
           ev("failure_detected", 0, 3.5, rank=1, how="Signal 9 (SIGKILL)"),
           ev("decision", 0, 3.5, action="unrecoverable",
              reason="rank 1 failed (Signal 9 (SIGKILL)); the state manager of slot 1 is gone"),
           ev("stop", 0, 3.5), ev("exit", 0, 3.52, rank=0),
           ev("job_end", 0, 3.6, exit_code=4, reason="...")]
    [r] = recoveries(evs)
    assert r.generation_to is None and r.exit_code == 4 and r.spawn_s is None
    text = format_report(evs)
    assert "#1 generation 0->end: rank 1 Signal 9 (SIGKILL)\n" in text
    assert "group stopped +20.0 ms | job ended with exit code 4" in text
    assert "why: rank 1 failed (Signal 9 (SIGKILL)); the state manager of slot 1 is gone" in text
    assert "respawned" not in text and "None" not in text


def test_a_restart_section_says_why_inplace_recovery_was_not_used():
    evs = [ev("spawn", 1, 0.5, rank=0, role="shadow"),
           ev("failure_detected", 0, 1.0, rank=0, how="exit code 1", step=3),
           ev("inplace_fallback", 0, 1.0, reason="rank 0 failed again at step 3 the same way"),
           ev("decision", 0, 1.0, action="restart", reason="rank 0 failed; restarting"),
           ev("stop", 0, 1.001), ev("exit", 0, 1.01, rank=1),
           ev("rendezvous", 1, 1.2, seconds=0.15), ev("spawn", 1, 1.21, rank=0, role="active"),
           ev("resumed", 1, 2.0, rank=0, step=0)]
    [r] = recoveries(evs)
    assert r.generation_to == 1 and abs(r.spawn_s - 0.21) < 1e-9
    text = format_report(evs)
    assert "respawned +210.0 ms" in text
    assert "no in-place recovery: rank 0 failed again at step 3 the same way" in text
