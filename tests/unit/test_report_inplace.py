"""The recovery report on synthetic event lists: in-place sections, restart sections unchanged."""
from leto_run.report import InplaceRecovery, Recovery, format_report, recoveries


def ev(event, gen, mono, **kw):
    return {"event": event, "generation": gen, "mono": mono, **kw}


def inplace_events():
    return [
        ev("spawn", 0, 0.0, rank=0, role="active"), ev("spawn", 0, 0.0, rank=1, role="active"),
        ev("inject", 0, 10.000, rank=1, spec="kill:rank=1:step=5"),
        ev("failure_detected", 0, 10.002, rank=1, how="Signal 9 (SIGKILL)", step=5),
        ev("hof", 0, 10.003, rank=1), ev("demote", 0, 10.003, rank=0),
        ev("promote", 1, 10.010, rank=0), ev("promote", 1, 10.010, rank=1),
        ev("promoted", 1, 10.011, rank=0), ev("promoted", 1, 10.015, rank=1),
        ev("phase", 1, 10.020, rank=0, phase="attach", seconds=0.004),
        ev("phase", 1, 10.021, rank=1, phase="attach", seconds=0.006),
        ev("phase", 1, 10.022, rank=1, phase="localize", seconds=0.001, probed=3300,
           probe_s=0.0002, sm_s=0.0005, host_scanned=4, host_scan_s=0.0001, host_deferred=150,
           commit_s=0.0, remap_s=0.0, marker_s=0.0003),
        ev("phase", 1, 10.022, rank=0, phase="localize", seconds=0.0008, probed=3300,
           probe_s=0.0001, sm_s=0.0004, remap_s=0.0, marker_s=0.0003),
        ev("phase", 1, 10.023, rank=1, phase="reconstruct", seconds=0.002, pages=3),
        ev("phase", 1, 10.024, rank=0, phase="agree", seconds=0.0005, resume="redo", step=5),
        ev("phase", 1, 10.025, rank=1, phase="resume", seconds=0.02),
        ev("resumed", 1, 10.030, rank=0, step=5),
        ev("caught_up", 1, 10.030, rank=0, step=5),
    ]


def test_inplace_section():
    [r] = recoveries(inplace_events())
    assert isinstance(r, InplaceRecovery)
    assert r.generation_from == 0 and r.rank == 1 and r.failed_step == 5
    assert abs(r.detect_s - 0.002) < 1e-9 and abs(r.promote_s - 0.013) < 1e-9
    assert r.phases["attach"] == 0.006 and r.phases["reconstruct"] == 0.002
    assert (r.resume, r.resume_step, r.recomputed_steps) == ("redo", 5, 0)
    assert abs(r.caught_up_s - 0.028) < 1e-9 and abs(r.total_s - 0.030) < 1e-9
    text = format_report(inplace_events())
    assert "generation 0->1 in place: rank 1 Signal 9 (SIGKILL) at step 5" in text
    assert "promotion +13.0 ms" in text and "agreement 0.5 ms (redo step 5)" in text
    assert "recomputed 0 step(s)" in text and "total 30.0 ms" in text
    assert "finish -" in text
    # the slowest rank's localization, by part (issue 22: where its milliseconds go)
    assert r.localize_parts == {"probed": 3300, "probe_s": 0.0002, "sm_s": 0.0005,
                                "host_scanned": 4, "host_scan_s": 0.0001, "host_deferred": 150,
                                "commit_s": 0.0, "remap_s": 0.0, "marker_s": 0.0003}
    assert ("localization 1.0 ms (probe 0.2 ms for 3,300 pages, state manager 0.5 ms "
            "[host scan 0.1 ms for 4 pages, 150 deferred; commit 0.0 ms], remap 0.0 ms, "
            "marker 0.3 ms)") in text


def test_two_inplace_recoveries_and_no_phases():
    evs = inplace_events() + [
        ev("failure_detected", 1, 20.0, rank=0, how="exit code 1", step=7),
        ev("promote", 2, 20.01, rank=0), ev("resumed", 2, 20.5, rank=0, step=8),
    ]
    a, b = recoveries(evs)
    assert isinstance(b, InplaceRecovery) and b.generation_from == 1
    assert b.phases == {} and b.resume is None and b.recomputed_steps == 0
    assert b.detect_s is None and abs(b.total_s - 0.5) < 1e-9
    assert "#2 generation 1->2 in place: rank 0 exit code 1 at step 7" in format_report(evs)


def test_restart_report_is_unchanged():
    evs = [ev("failure_detected", 0, 1.0, rank=0, how="exit code 1", step=3),
           ev("stop", 0, 1.001), ev("exit", 0, 1.01, rank=1),
           ev("rendezvous", 1, 1.2, seconds=0.15), ev("spawn", 1, 1.21, rank=0),
           ev("resumed", 1, 2.0, rank=0, step=2), ev("caught_up", 1, 2.1, rank=0, step=3)]
    [r] = recoveries(evs)
    assert isinstance(r, Recovery) and r.recomputed_steps == 1
    text = format_report(evs)
    assert "Recovery report (restart mode: stop all, rendezvous, respawn, reload checkpoint)" in text
    assert "in place" not in text
