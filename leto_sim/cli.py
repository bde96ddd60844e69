"""Command line of the ETTR simulator.

    python -m leto_sim --config FILE [--mttf M] [--hof-ratio H] [--seeds N] [--json OUT]
                       [--plot HOF.png] [--plot-mttf MTTF.png]
    python -m leto_sim validate RESULTS.json... [--json OUT] [--step mean|median]
                       [--max-error POINTS]
    python -m leto_sim fig14 [--configs DIR] [--mttf 10m|30m|1h] [--seeds N] [--no-fit]
                       [--json OUT] [--plot OUT.png]

Role: the plain form loads and validates a config and the overrides, runs the simulation,
prints the table (system, checkpoint interval, T_eff, mean ETTR with its 95% CI, the
closed-form prediction) and optionally writes JSON and PNGs of ETTR vs. HOF ratio and vs.
MTTF per system (the styles of the paper's Figures 14 and 15).  ``validate`` replays the
recovery harness's measured runs (profile.py, validate.py); ``fig14`` sets the DeepSeek
configurations beside the paper's Figure 14 (or, with --mttf 30m / 1h, Figure 15; paper.py).

Calling contract: exit 0 on success; any bad input (config, option or results file) prints one
line ``leto_sim: error: field '<field>': <problem>; fix: <fix>`` to stderr and exits 2 before
any simulation runs; ``validate --max-error P`` exits 1 when a prediction of Leto or of
torchrun + DCP async misses its measurement by more than P points.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from .config import SimConfigError, parse_number, load_config, parse_duration
from .ettr import SimResult, simulate


def _fail(err: SimConfigError) -> None:
    click.echo(f"leto_sim: error: {err}", err=True)
    sys.exit(2)


def _overrides(mttf: str | None, hof: str | None, seeds: str | None) -> dict:
    """Validate the command-line overrides with the same rules as the config fields."""
    out: dict = {}
    if mttf is not None:
        out["mttf"] = parse_duration(mttf, "--mttf", allow_zero=False)
    if hof is not None:
        out["hof_ratio"] = parse_number(hof, "--hof-ratio", hi=1.0)
    if seeds is not None:
        if not seeds.isdigit() or int(seeds) < 2:
            raise SimConfigError("--seeds", f"expected an integer >= 2, got {seeds!r}",
                                 "pass e.g. --seeds 20 (a CI needs two seeds or more)")
        out["seeds"] = int(seeds)
    return out


def _output_path(value: str | None, flag: str) -> Path | None:
    if value is None:
        return None
    p = Path(value)
    if not p.parent.is_dir():
        raise SimConfigError(flag, f"directory {p.parent} does not exist",
                             "create it or pass a path in an existing directory")
    return p


def format_table(res: SimResult) -> str:
    """The printed table: one row per system."""
    it = res.iteration
    head = (f"{res.name}: T_iter {it.total:.3f} s (pipeline {it.pipeline:.3f}, sync "
            f"{it.sync:.3f}, update {it.update:.3f}); MTTF {res.mttf:g} s, HOF ratio "
            f"{res.hof_ratio:g}, {res.seeds} seeds over {res.horizon:g} s")
    rows = [f"{'system':<20}{'interval':>9}{'T_eff (s)':>11}{'ETTR %':>9}"
            f"{'95% CI':>17}{'closed form %':>15}"]
    for s in res.systems:
        ci = f"[{100 * s.ci_low:.2f}, {100 * s.ci_high:.2f}]"
        rows.append(f"{s.name:<20}{s.interval:>9}{s.t_eff:>11.3f}{100 * s.mean:>9.2f}"
                    f"{ci:>17}{100 * s.oracle:>15.2f}")
    return "\n".join([head, *rows])


def result_dict(res: SimResult) -> dict:
    """A JSON-ready summary (the per-seed values included, for re-analysis)."""
    d = asdict(res)
    d["iteration"]["total"] = res.iteration.total
    return d


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(data, indent=2) + "\n")
        click.echo(f"wrote {path}")


@click.group(name="leto_sim", invoke_without_command=True)
@click.option("--config", "config_path", default=None, help="simulation config (YAML)")
@click.option("--mttf", default=None, help="override failures.mttf, e.g. 10m")
@click.option("--hof-ratio", default=None, help="override failures.hof_ratio, in [0, 1]")
@click.option("--seeds", default=None, help="override failures.seeds (>= 2)")
@click.option("--json", "json_out", default=None, help="write the results as JSON here")
@click.option("--plot", "plot_out", default=None, help="write ETTR vs. HOF ratio (PNG) here")
@click.option("--plot-mttf", "mttf_out", default=None,
              help="write ETTR vs. MTTF per system (PNG, Figure 15 style) here")
@click.pass_context
def main(ctx, config_path, mttf, hof_ratio, seeds, json_out, plot_out, mttf_out):
    """Predict ETTR of Leto and checkpointing baselines under a seeded failure process."""
    if ctx.invoked_subcommand is not None:
        if config_path is not None:
            _fail(SimConfigError("--config", f"not an option of '{ctx.invoked_subcommand}'",
                                 f"pass the subcommand's own options after "
                                 f"'{ctx.invoked_subcommand}'"))
        return
    from . import plots
    try:
        if config_path is None:
            raise SimConfigError("--config", "missing", "pass --config configs/sim/small.yaml "
                                 "or use a subcommand (validate, fig14)")
        cfg = load_config(config_path)
        base = _overrides(mttf, hof_ratio, seeds)
        json_path = _output_path(json_out, "--json")
        plot_path = _output_path(plot_out, "--plot")
        mttf_path = _output_path(mttf_out, "--plot-mttf")
    except SimConfigError as e:
        _fail(e)
    res = simulate(cfg, **base)
    click.echo(format_table(res))
    out = result_dict(res)
    if plot_path is not None:
        out["hof_sweep"] = plots.hof_sweep(cfg, {k: v for k, v in base.items()
                                                 if k != "hof_ratio"}, plot_path, result_dict)
        click.echo(f"wrote {plot_path}")
    if mttf_path is not None:
        out["mttf_sweep"] = plots.mttf_sweep(cfg, base, mttf_path, result_dict)
        click.echo(f"wrote {mttf_path}")
    _write_json(json_path, out)


@main.command("validate")
@click.argument("files", nargs=-1)
@click.option("--json", "json_out", default=None, help="write every file's validation here")
@click.option("--step", "step", default="mean",
              help="steady iteration time from the measured periods: mean (default) or median")
@click.option("--max-error", "max_error", default=None,
              help="exit 1 if Leto's or torchrun + DCP async's error exceeds this (points)")
def validate_cmd(files, json_out, step, max_error):
    """Replay recovery-harness runs (benchmarks/recovery JSON) and compare ETTR."""
    from .profile import load_profile
    from .validate import PRIMARY, format_validation, validate_profile, validation_dict
    try:
        if not files:
            raise SimConfigError("FILE", "missing", "pass one or more results files, e.g. "
                                 "docs/results/recovery_h200_20261130T0645.json")
        if step not in ("mean", "median"):
            raise SimConfigError("--step", f"expected mean or median, got {step!r}",
                                 "pass --step mean")
        limit = None if max_error is None else parse_number(max_error, "--max-error")
        json_path = _output_path(json_out, "--json")
        profiles = [load_profile(f) for f in files]
    except SimConfigError as e:
        _fail(e)
    out, worst = [], 0.0
    for p in profiles:
        rows = validate_profile(p, step)
        click.echo(format_validation(p, rows))
        out.append(validation_dict(p, rows))
        worst = max([worst] + [abs(v.error_points) for v in rows if v.system in PRIMARY])
    _write_json(json_path, {"step": step, "files": out})
    if limit is not None and worst > limit:
        click.echo(f"largest error {worst:.2f} points exceeds --max-error {limit:g}", err=True)
        sys.exit(1)


def _default_configs() -> Path:
    """configs/sim under the working directory (the repository root), else this tree's."""
    here = Path("configs/sim")
    return here if here.is_dir() else Path(__file__).resolve().parents[1] / "configs" / "sim"


@main.command("fig14")
@click.option("--configs", "config_dir", default=None,
              help="directory of deepseek_v{2,3,4}.yaml (default: configs/sim of this tree)")
@click.option("--mttf", default="10m", help="10m (Figure 14), 30m or 1h (Figure 15)")
@click.option("--seeds", default=None, help="override each config's failures.seeds (>= 2)")
@click.option("--no-fit", "no_fit", is_flag=True,
              help="skip the column with p fitted to the paper's Gemini+ bars")
@click.option("--json", "json_out", default=None, help="write the comparison as JSON here")
@click.option("--plot", "plot_out", default=None, help="write the grouped bars (PNG) here")
def fig14_cmd(config_dir, mttf, seeds, no_fit, json_out, plot_out):
    """The DeepSeek configurations beside the paper's Figure 14 (or 15)."""
    from . import paper, plots
    try:
        d = Path(config_dir) if config_dir else _default_configs()
        for name in paper.CONFIGS:
            try:
                load_config(d / f"{name}.yaml")   # every config valid before any run
            except SimConfigError as e:
                if e.field != "--config":
                    raise
                raise SimConfigError("--configs", e.problem, f"pass the directory that holds "
                                     f"{', '.join(paper.CONFIGS)} (.yaml)") from None
        base = _overrides(mttf, None, seeds)
        json_path = _output_path(json_out, "--json")
        plot_path = _output_path(plot_out, "--plot")
    except SimConfigError as e:
        _fail(e)
    res = paper.compare(d, base["mttf"], base.get("seeds"), fit=not no_fit)
    click.echo(paper.format_comparison(res))
    if plot_path is not None:
        plots.figure14_plot(res["rows"], plot_path, res["mttf"])
        click.echo(f"wrote {plot_path}")
    _write_json(json_path, res)
