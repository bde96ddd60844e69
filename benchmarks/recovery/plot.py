"""The figure of the recovery benchmark, from its JSON: throughput over time per system.

    python -m benchmarks.recovery.plot results.json [--png results.png]

Like the paper's Fig. 11: one panel per system (the reference first), tokens per second over
time since the first step, binned; shading marks recovery (the kill to the restart of training,
I), hatching the recomputation that follows (to iteration i+1 done again, R), dashed lines the
kills and ticks at the top the checkpoints.  A separate step from the harness on purpose: the
GPU machine may have no matplotlib; the JSON carries everything the figure needs.

Exit status 0 with the PNG written, 3 when matplotlib is not installed (a message says how to
get it), 2 on usage errors.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

MISSING_MATPLOTLIB = 3


def bins(timeline: list[list], tokens_per_step: int, width: float) -> tuple[list, list]:
    """Tokens per second in bins of `width` s from rank 0's step completions."""
    if not timeline:
        return [], []
    end = max(t1 for _, _, t1, _, _ in timeline)
    n = int(end // width) + 1
    count = [0] * n
    for _, _, t1, _, _ in timeline:
        if t1 >= 0:
            count[int(t1 // width)] += 1
    xs = [(i + 0.5) * width for i in range(n)]
    return xs, [c * tokens_per_step / width for c in count]


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = res["reference"]
    runs = [("reference", ref)] + list(res["systems"].items())
    tps = ref["tokens_per_step"]
    span = max((r["timeline"][-1][2] for _, r in runs if r.get("timeline")), default=1.0)
    width = max(span / 150.0, 4 * (ref.get("t_iter") or 0.01))
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.9 * len(runs) + 0.6), sharex=True,
                             squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs):
        xs, ys = bins(r.get("timeline") or [], tps, width)
        ax.plot(xs, [y / 1e3 for y in ys], lw=1.0, color="C0")
        for f in r.get("failures", []):
            if f.get("at_s") is None:
                continue
            ax.axvline(f["at_s"], color="k", ls="--", lw=0.8)
            if f.get("resume_at_s") is not None:
                ax.axvspan(f["at_s"], f["resume_at_s"], color="C3", alpha=0.25, lw=0)
            if f.get("done_at_s") is not None and f["done_at_s"] > f["resume_at_s"]:
                ax.axvspan(f["resume_at_s"], f["done_at_s"], facecolor="none", edgecolor="C1",
                           hatch="///", lw=0)
        ck = [t1 for _, _, t1, kind, _ in r.get("timeline") or [] if kind]
        if ck:
            top = ax.get_ylim()[1]
            ax.plot(ck, [top] * len(ck), "|", color="C2", ms=8)
        label = r.get("label", name)
        if r.get("ettr") is not None:
            label += f"  (ETTR {100 * r['ettr']:.1f}%)"
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_ylabel("K tok/s", fontsize=8)
        ax.set_ylim(bottom=0)
    axes[-1, 0].set_xlabel("time since the first step (s)")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color="C3", alpha=0.25, label="recovery (I)"),
                        Patch(facecolor="none", edgecolor="C1", hatch="///",
                              label="recomputation (R)"),
                        plt.Line2D([], [], color="k", ls="--", label="SIGKILL"),
                        plt.Line2D([], [], color="C2", marker="|", ls="", label="checkpoint")],
               loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(f"Throughput over time, preset {res['preset']['name']} "
                 f"({res['date_utc']})", fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="the harness's --json output")
    p.add_argument("--png", help="output file (default: the JSON's name with .png)")
    a = p.parse_args(argv)
    png = a.png or (a.json[:-5] if a.json.endswith(".json") else a.json) + ".png"
    with open(a.json, encoding="utf-8") as f:
        res = json.load(f)
    try:                                # checked first, to say so plainly (plot() needs it)
        importlib.import_module("matplotlib")
    except ImportError:
        print("plot: matplotlib is not installed (pip install matplotlib); the JSON has every "
              "figure, the PNG can be made on any machine that has it", file=sys.stderr)
        return MISSING_MATPLOTLIB
    plot(res, png)
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
