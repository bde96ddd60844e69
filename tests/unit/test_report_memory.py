"""The recovery report's retained-memory section (leto_run/report.py `memory_lines`): boundary
repairs and scrub findings as the runtime's `phase` events describe them."""
from leto_run.report import format_report


def _ev(**f):
    return {"event": "phase", "generation": 0, "rank": 0, "mono": 1.0, **f}


REPAIR = _ev(phase="repair", step=3, pages=1, reencoded=[["leto/params", 1]], decoded=[],
             seconds=0.0129)
DECODE = _ev(phase="repair", rank=1, step=4, pages=5, reencoded=[],
             decoded=[["leto/exp_avg", 2, 5]], seconds=0.0158)
FOUND = _ev(phase="scrub", step=4, state="leto/params", group=1, action="reencode",
            reason="tier-1 parity row(s) [1] are stale or corrupted")
SUMMARY = _ev(phase="scrub", action="summary", slices=13, bytes=3 << 20, passes=2, repaired=1,
              seconds=0.009)


def test_repairs_and_findings_are_reported_without_any_failure():
    text = format_report([REPAIR, DECODE, FOUND, SUMMARY])
    lines = text.splitlines()
    assert lines[1] == "Retained memory (losses repaired at step boundaries, the scrub)"
    assert lines[2] == ("  rank 0 gen 0 step 3: 1 lost page(s) repaired before any use: parity "
                        "recomputed from the data for leto/params group 1 (12.9 ms)")
    assert "5 data page(s) of leto/exp_avg group 2 decoded from parity (15.8 ms)" in lines[3]
    assert lines[4].endswith("scrub: leto/params group 1: tier-1 parity row(s) [1] are stale "
                             "or corrupted -> reencode")
    assert "13 slice(s), 3.0 MiB checked (2 full pass(es))" in lines[5]


def test_a_clean_run_has_no_report():
    assert format_report([SUMMARY, _ev(phase="attach", seconds=0.1)]) == ""
