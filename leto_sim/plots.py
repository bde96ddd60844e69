"""The simulator's PNG figures, in the style of the paper's Figures 14 and 15.

Role: run the sweeps a figure needs and draw them -- ETTR against the HOF ratio for one config
(:func:`hof_sweep`), ETTR against the MTTF per system at HOF ratios 0, 50 and 100%
(:func:`mttf_sweep`, Figure 15's axis), and the three DeepSeek scales side by side with the
paper's published bars (:func:`figure14_plot`).

Calling contract: each function writes one PNG at `path` (matplotlib's headless Agg backend;
matplotlib is imported only here, only when a figure is asked for) and returns the JSON-ready
summaries of the runs it drew, so a caller can add them to its JSON.
"""
from __future__ import annotations

from pathlib import Path

from .config import SimConfig
from .ettr import SimResult, simulate

#: HOF ratios of the --plot sweep (the paper's Figure 14 uses 0, 0.5 and 1).
HOF_SWEEP = (0.0, 0.25, 0.5, 0.75, 1.0)
#: MTTFs of the --plot-mttf sweep, seconds: the paper's 10 min, 30 min and 1 h (Figures 14,
#: 15) and points around them.
MTTF_SWEEP = (300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0)
#: HOF ratios drawn as separate panels of the MTTF sweep (Figure 15's bars).
MTTF_PANELS = (0.0, 0.5, 1.0)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")     # headless: CI machines have no display
    import matplotlib.pyplot as plt
    return plt


def _errorbar(ax, xs, results: list[SimResult], k: int, **kw) -> None:
    """System k of each result, at xs, with its CI as error bars."""
    pts = [r.systems[k] for r in results]
    means = [100 * p.mean for p in pts]
    err = [[100 * (p.mean - p.ci_low) for p in pts], [100 * (p.ci_high - p.mean) for p in pts]]
    ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=pts[0].name, **kw)


def hof_sweep(cfg: SimConfig, base: dict, path: Path, summarize) -> list[dict]:
    """ETTR vs. HOF ratio per system, with CI bars; `summarize` turns a SimResult into JSON."""
    plt = _pyplot()
    sweep = [simulate(cfg, **{**base, "hof_ratio": h}) for h in HOF_SWEEP]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for k in range(len(sweep[0].systems)):
        _errorbar(ax, [100 * h for h in HOF_SWEEP], sweep, k)
    ax.set_xlabel("HOF ratio (%)")
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"{cfg.name}: MTTF {sweep[0].mttf / 60:g} min")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [summarize(r) for r in sweep]


def mttf_sweep(cfg: SimConfig, base: dict, path: Path, summarize) -> list[dict]:
    """ETTR vs. MTTF (log axis) per system, one panel per HOF ratio in MTTF_PANELS."""
    plt = _pyplot()
    base = {k: v for k, v in base.items() if k not in ("mttf", "hof_ratio")}
    fig, axes = plt.subplots(1, len(MTTF_PANELS), figsize=(11, 3.6), sharey=True)
    out = []
    for ax, h in zip(axes, MTTF_PANELS):
        runs = [simulate(cfg, **base, mttf=m, hof_ratio=h) for m in MTTF_SWEEP]
        out += [summarize(r) for r in runs]
        for k in range(len(runs[0].systems)):
            _errorbar(ax, [m / 60 for m in MTTF_SWEEP], runs, k)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([m / 60 for m in MTTF_SWEEP])
        ax.set_xticklabels([f"{m / 60:g}" for m in MTTF_SWEEP])
        ax.set_xlabel("MTTF (min)")
        ax.set_title(f"HOF ratio {100 * h:g}%")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ETTR (%)")
    axes[0].legend()
    fig.suptitle(f"{cfg.name}: ETTR vs. MTTF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return out


def figure14_plot(rows: list[dict], path: Path, mttf: float) -> None:
    """Grouped bars per scale and HOF ratio: the simulator's Leto and Gemini+ (with their
    CIs), the paper's published values as black ticks and, where present, the simulator with
    the checkpoint cost fitted to the paper's Gemini+ bar as open circles."""
    plt = _pyplot()
    scales = list(dict.fromkeys(r["config"] for r in rows))
    hofs = sorted({r["hof_ratio"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width, x = 0.38, 0.0
    ticks, labels = [], []
    for scale in scales:
        for h in hofs:
            r = next(r for r in rows if r["config"] == scale and r["hof_ratio"] == h)
            for j, (system, color) in enumerate((("leto", "tab:blue"),
                                                 ("gemini_plus", "tab:orange"))):
                s = r["systems"][system]
                xc = x + (j - 0.5) * width
                ax.bar(xc, s["sim"], width, color=color, alpha=0.8,
                       yerr=[[s["sim"] - s["ci"][0]], [s["ci"][1] - s["sim"]]], capsize=2,
                       label=f"{system} (simulator)" if x == 0 else None)
                if s.get("paper") is not None:
                    ax.plot([xc - width / 2, xc + width / 2], [s["paper"]] * 2, color="k",
                            lw=2, label="paper" if x == 0 and j == 0 else None)
                if s.get("fitted") is not None:
                    ax.plot(xc, s["fitted"], "o", mfc="none", mec="k", ms=5,
                            label="simulator, p fitted to the paper's Gemini+"
                            if x == 0 and j == 0 else None)
            ticks.append(x)
            labels.append(f"{100 * h:g}%\n{scale.replace('deepseek_', 'DS-')}")
            x += 1.0
        x += 0.5
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylim(50, 107)     # headroom above 100% for the legend
    ax.set_ylabel("ETTR (%)")
    ax.set_title(f"Simulated ETTR, MTTF {mttf / 60:g} min, HOF ratio per scale")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
