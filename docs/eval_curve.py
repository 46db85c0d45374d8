"""Draws a run's held-out evaluation curve (`python docs/eval_curve.py RUN_DIR... -o docs/img/math_eval.svg`): each
`eval` block's greedy `mean@1` and sampled `pass@k` (its largest k) against the step, from the runs' metrics.jsonl,
with the training reward (mean of the last 25 steps) faint behind them; one line style per run (seed). The README's
picture of examples/math_eval.flow is this script on two seeds' runs."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLES = ("-", "--", ":", "-.")
MEAN_AT_1 = re.compile(r"^eval/([^/]+)/mean@1$")
PASS_AT = re.compile(r"^eval/([^/]+)/pass@(\d+)$")


def read(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]


def curves(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """label -> (step, value): each block's mean@1 where it answers once, and its pass@k at its largest k."""
    keys = {k for r in rows for k in r}
    largest: dict[str, int] = {}
    for key in keys:
        m = PASS_AT.match(key)
        if m and int(m[2]) > 1:
            largest[m[1]] = max(largest.get(m[1], 0), int(m[2]))
    wanted = {k: f"{MEAN_AT_1.match(k)[1]} mean@1" for k in keys if MEAN_AT_1.match(k)}  # type: ignore[index]
    wanted |= {f"eval/{name}/pass@{k}": f"{name} pass@{k}" for name, k in largest.items()}
    return {label: [(int(r["step"]), float(r[key])) for r in rows if key in r]
            for key, label in sorted(wanted.items(), key=lambda kv: kv[1])}


def trained(rows: list[dict[str, Any]], window: int = 25) -> list[tuple[int, float]]:
    """The training reward, averaged over the last `window` steps."""
    steps = [(int(r["step"]), float(r["reward_mean"])) for r in rows if "reward_mean" in r]
    return [(s, sum(v for _, v in steps[max(0, i - window + 1):i + 1]) / len(steps[max(0, i - window + 1):i + 1]))
            for i, (s, _) in enumerate(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (one line style each)")
    p.add_argument("-o", "--out", type=Path, required=True, help="the picture (svg or png)")
    p.add_argument("--label", action="append", default=[], help="a name per run for the legend (default: its folder)")
    p.add_argument("--title", default="")
    args = p.parse_args()
    plt.rcParams["svg.fonttype"] = "none"  # text as text: a small svg
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colours: dict[str, str] = {}
    for i, run in enumerate(args.runs):
        rows = read(run)
        name = args.label[i] if i < len(args.label) else run.name
        style = STYLES[i % len(STYLES)]
        steps, values = zip(*trained(rows), strict=True)
        ax.plot(steps, values, style, color="0.75", linewidth=1,
                label=f"training reward (mean of 25 steps), {name}")
        for label, points in curves(rows).items():
            xs, ys = zip(*points, strict=True)
            line = ax.plot(xs, ys, style, marker="o", markersize=3, label=f"held-out {label}, {name}",
                           color=colours.get(label))
            colours[label] = line[0].get_color()
    ax.set_xlabel("step")
    ax.set_ylabel("fraction right")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if args.title:
        ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, **({"metadata": {"Date": None}} if args.out.suffix == ".svg" else {}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
