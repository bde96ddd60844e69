"""Mixed HOF/FF schedules of the recovery benchmark (benchmarks/recovery/mixed.py): the pure
parts, no processes -- the kinds of a schedule, the page-loss spec of an FF (leto-run's own
grammar and checks), leto-ckpt's checkpoint interval at the FF-only MTBF, the systems' command
lines, and the metrics of an FF on synthetic step records and events."""
from __future__ import annotations

import math
import sys

import pytest

from leto_testing import ROOT

if str(ROOT) not in sys.path:      # benchmarks/ is imported from the repository root
    sys.path.insert(0, str(ROOT))
from benchmarks.recovery import metrics as M  # noqa: E402
from benchmarks.recovery import mixed as X  # noqa: E402
from benchmarks.recovery import presets as P  # noqa: E402
from benchmarks.recovery import report, run, systems  # noqa: E402

CPU = ("--page-bytes", "16384", "--data-pages", "64", "--tier1", "16", "--tier2", "1")


def test_schedule_kinds():
    p = P.get("cpu", kills=4)
    assert p.kill_kinds() == ["hof"] * 4 and p.ff_fraction == 0.0
    m = P.mixed(p)
    assert m.kill_kinds() == ["hof", "ff", "hof", "ff"] and m.ff_fraction == 0.5
    assert m.schedule() == p.schedule()               # same times and victims, kinds added
    assert P.get("cpu", kinds=("ff",), kills=3).kill_kinds() == ["ff"] * 3
    with pytest.raises(ValueError, match="kinds"):
        P.get("cpu", kinds=("hof", "oops"))


def test_page_loss_spec_is_leto_runs_canonical_form_beyond_the_tolerance():
    s = X.page_loss_spec(1, 434, 1, 0, CPU)
    assert s == "pages:rank=1:step=434:gen=1:count=17:tier=device"
    assert X.page_loss_spec(0, 869, 1, 1, CPU) == \
        "pages:rank=0:step=869:attempt=1:gen=1:count=17:tier=device"
    # leto-run's defaults (1024 data pages, 16 tier-1 pages) when the preset sets none: h200.
    h = P.get("h200")
    assert X.geometry(h.leto_args) == {"data_pages": 1024, "tier1": 16}
    assert ":count=17:" in X.page_loss_spec(0, 157, 1, 0, h.leto_args)
    assert X.geometry(("--tier1=4", "--data-pages", "8"))["tier1"] == 4
    with pytest.raises(ValueError, match="data pages"):
        X.page_loss_spec(0, 5, 0, 0, ("--data-pages", "8", "--tier1", "16"))


def test_ff_specs_count_generations_and_attempts_along_the_schedule():
    sched = [(20.0, 1), (40.0, 0), (60.0, 1), (80.0, 0), (100.0, 1)]
    specs = X.ff_specs(sched, ["hof", "ff", "hof", "hof", "ff"], 0.1, CPU)
    assert specs[0] is None and specs[2] is None and specs[3] is None
    # 1 HOF before the first FF (gen 1 of attempt 0); 2 HOFs since that fallback (attempt 1)
    assert specs[1] == "pages:rank=0:step=400:gen=1:count=17:tier=device"
    assert specs[4] == "pages:rank=1:step=1000:attempt=1:gen=2:count=17:tier=device"
    assert X.ff_step(40.0, 0.092) == 434 and X.ff_step(0.05, 0.1) == 0
    assert X.first_ff_margin(specs, 30) == 370 and X.first_ff_margin([None], 30) is None


def test_ff_interval_uses_the_ff_only_mtbf():
    assert X.ff_mtbf(20.0, 0.5) == 40.0 and math.isinf(X.ff_mtbf(20.0, 0.0))
    # sqrt(2 * 0.1 * 40) / 0.1 = 28.28 -> 28; all failures (MTBF 20): 20
    assert X.ff_interval(0.1, 20.0, 0.5, 0.1) == 28
    assert M.young_interval(0.1, 20.0, 0.1) == 20
    with pytest.raises(ValueError):
        X.ff_interval(0.1, 20.0, 0.0, 0.1)


def test_leto_ckpt_command_line_and_schedule_rules(tmp_path):
    p = P.mixed(P.get("cpu", kills=4))
    specs = X.ff_specs(p.schedule(), p.kill_kinds(), 0.092, p.leto_args)
    argv = systems.argv(systems.LETO_CKPT, p, str(tmp_path), steps=1000, interval=28,
                        injects=tuple(s for s in specs if s))
    i = argv.index("--checkpoint-dir")
    assert argv[i + 1] == str(tmp_path / "ckpt")
    assert argv[i + 2:i + 4] == ["--checkpoint-every", "28"]
    assert [argv[j + 1] for j, a in enumerate(argv) if a == "--inject"] == [s for s in specs if s]
    assert argv[argv.index("--opt") + 1] == "torch" and argv[argv.index("--mode") + 1] == "leto"
    assert argv.index("--inject") < argv.index(systems.TRAIN)       # leto-run's, not train.py's
    with pytest.raises(ValueError, match="interval"):
        systems.argv(systems.LETO_CKPT, p, str(tmp_path), steps=10)
    with pytest.raises(ValueError, match="leto-ckpt"):
        systems.argv(systems.LETO_INPLACE, p, str(tmp_path), steps=10, injects=("x",))
    assert systems.schedule_problem(systems.LETO_CKPT, ["hof"]) is not None
    assert systems.schedule_problem(systems.LETO_INPLACE, ["hof", "ff"]) is not None
    assert systems.schedule_problem(systems.TORCHRUN_ASYNC, ["hof", "ff"]) is None
    a = run.parse_args(["--mixed"])
    assert [s.name for s in a.system_list] == ["leto-ckpt", "torchrun-dcp-async"]
    assert run.main(["--preset", "cpu", "--systems", "leto-ckpt"]) == 2     # no FF: refused


def test_schedule_of_injects_only_leto_ckpt_s_ffs():
    p = P.mixed(P.get("cpu"))
    sched, specs = run._schedule_of(systems.LETO_CKPT, p, 0.1, 28)
    assert [(k, s is not None) for _, _, k, s in sched] == [("hof", False), ("ff", True)]
    sched, specs = run._schedule_of(systems.TORCHRUN_ASYNC, p, 0.1, 20)
    assert [(k, s) for _, _, k, s in sched] == [("hof", None), ("ff", None)] and specs == [None] * 2


def _steps(rank, pid, steps, t0, dt, gen=0, attempt=0):
    return [{"ev": "step", "rank": rank, "pid": pid, "gen": gen, "attempt": attempt, "step": s,
             "t0": t0 + k * dt, "t1": t0 + (k + 1) * dt, "ckpt": None}
            for k, s in enumerate(steps)]


def test_metrics_of_an_ff_that_falls_back():
    # 1 s steps; the pages of rank 1 are lost at the top of step 10 (t=10.0, just after step 9
    # ended); the new attempt resumes from the checkpoint of step 6 at t=20 and redoes 6..
    pre = _steps(0, 100, range(0, 10), 0.0, 1.0) + _steps(1, 101, range(0, 10), 0.0, 1.0)
    post = (_steps(0, 200, range(6, 20), 20.0, 1.0, gen=2, attempt=1)
            + _steps(1, 201, range(6, 20), 20.0, 1.0, gen=2, attempt=1))
    spec = "pages:rank=1:step=10:gen=1:count=17:tier=device"
    events = [{"event": "inject", "mono": 10.001, "spec": spec, "by": "runtime", "pid": 101},
              {"event": "failure_detected", "mono": 10.1, "pid": 101},
              {"event": "fallback", "mono": 10.2, "step": 6, "failed_step": 10, "path": "/c/6"}]
    ev = X.inject_event(events, spec)
    assert ev["pid"] == 101 and X.inject_event(events, spec + "x") is None
    f = M.failure(pre + post, ev["mono"], 1.0)
    assert f["interrupted_step"] == 10 and f["resume"] == "rollback" and f["resumed_step"] == 6
    assert f["I"] == pytest.approx(20.0 - 10.001)
    # step 10 done again at t=25; the interrupted step had not begun (t_remain = t_iter - 0.001)
    assert f["R"] == pytest.approx(25.0 - 20.0 - 0.999)
    X.ff_fallback(f, X.fallback_after(events, ev["mono"]))
    assert f["recomputed_steps"] == 4 and f["recomputed_steps_records"] == 4
    assert f["fallback"]["step"] == 6 and X.fallback_after(events, 11.0) is None
    assert run.leto_detect_s(events, 101, ev["mono"]) == pytest.approx(0.099)


def test_report_names_the_kind_of_each_failure():
    assert report._kind({"kind": "ff", "inject": "pages:..."}) == "FF (page loss)"
    assert report._kind({"kind": "ff", "inject": None}) == "FF (SIGKILL)"
    assert report._kind({}) == "HOF"
    assert report._kinds({"schedule": [[1, 0], [2, 1]]}) == ["hof", "hof"]


def test_torch_optimizer_lr_schedule_is_lr_at_bit_for_bit():
    import torch

    from benchmarks.recovery import train
    a = train.parse_args(["--mode", "leto", "--out", "/nonexistent", "--steps", "3",
                          "--opt", "torch"])
    cfg = train.adamw_config(a)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=cfg.lr, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, train.warmup_factor(cfg))
    for t in range(cfg.warmup_steps + 5):
        assert opt.param_groups[0]["lr"] == train.lr_at(cfg, t), t
        opt.step()
        sched.step()
    assert train.parse_args(["--mode", "leto", "--out", "d", "--steps", "1"]).opt == "rmu"
