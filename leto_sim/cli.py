"""Command line of the ETTR simulator: ``python -m leto_sim --config FILE [options]``.

Role: load and validate the config and the overrides, run the simulation, print the table
(system, checkpoint interval, T_eff, mean ETTR with its 95% CI, the closed-form prediction),
and optionally write JSON and a PNG of ETTR vs. HOF ratio per system (in the style of the
paper's Figures 14 and 15).

Calling contract: exit 0 on success; any bad input (config or option) prints one line
``leto_sim: error: field '<field>': <problem>; fix: <fix>`` to stderr and exits 2 before any
simulation runs.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from .config import SimConfig, SimConfigError, parse_number, load_config, parse_duration
from .ettr import SimResult, simulate

#: HOF ratios of the --plot sweep (the paper's Figure 14 uses 0, 0.5 and 1).
SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)


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


def _plot(cfg: SimConfig, base: dict, path: Path) -> list[dict]:
    """ETTR vs. HOF ratio per system, with CI bars; returns the sweep's summaries."""
    import matplotlib
    matplotlib.use("Agg")     # headless: CI machines have no display
    import matplotlib.pyplot as plt

    sweep = [simulate(cfg, **{**base, "hof_ratio": h}) for h in SWEEP]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for k, name in enumerate(s.name for s in sweep[0].systems):
        pts = [r.systems[k] for r in sweep]
        means = [100 * p.mean for p in pts]
        err = [[100 * (p.mean - p.ci_low) for p in pts], [100 * (p.ci_high - p.mean) for p in pts]]
        ax.errorbar([100 * h for h in SWEEP], means, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xlabel("HOF ratio (%)")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"{cfg.name}: MTTF {sweep[0].mttf / 60:g} min")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [result_dict(r) for r in sweep]


@click.command(name="leto_sim")
@click.option("--config", "config_path", required=True, help="simulation config (YAML)")
@click.option("--mttf", default=None, help="override failures.mttf, e.g. 10m")
@click.option("--hof-ratio", default=None, help="override failures.hof_ratio, in [0, 1]")
@click.option("--seeds", default=None, help="override failures.seeds (>= 2)")
@click.option("--json", "json_out", default=None, help="write the results as JSON here")
@click.option("--plot", "plot_out", default=None, help="write ETTR vs. HOF ratio (PNG) here")
def main(config_path, mttf, hof_ratio, seeds, json_out, plot_out):
    """Predict ETTR of Leto and checkpointing baselines under a seeded failure process."""
    try:
        cfg = load_config(config_path)
        base = _overrides(mttf, hof_ratio, seeds)
        json_path = _output_path(json_out, "--json")
        plot_path = _output_path(plot_out, "--plot")
    except SimConfigError as e:
        _fail(e)
    res = simulate(cfg, **base)
    click.echo(format_table(res))
    out = result_dict(res)
    if plot_path is not None:
        out["hof_sweep"] = _plot(cfg, {k: v for k, v in base.items() if k != "hof_ratio"},
                                 plot_path)
        click.echo(f"wrote {plot_path}")
    if json_path is not None:
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
