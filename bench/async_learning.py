"""Does an asynchronous run learn as well? The GRPO arithmetic example at K = 1 vs synchronously, several seeds.

examples/grpo_arith_async.flow (grpo_arith.flow on split pools at half its learning rate, `run { max_staleness = 1 }`, so each sample is one
update old and the update applies AReaL's decoupled correction) against the same file with
`--set run.max_staleness=0` (the synchronous step; `is_correction = "auto"` is then no correction), on the process
backend, 400 steps of 128 samples each way: the same number of samples. Reported per seed: the final reward (the
mean of the last 50 steps' mean reward), the difference, and the wall time; the two mean reward curves (over the
seeds, moving mean of 15 steps) are drawn into docs/img/async_arith.svg.

    python bench/async_learning.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flowrl  # noqa: E402

FLOW = ROOT / "examples" / "grpo_arith_async.flow"
LAST = 50  # steps the final reward is the mean of
SMOOTH = 15


def run(k: int, seed: int, out: Path) -> dict[str, Any]:
    graph = flowrl.load(str(FLOW), overrides={"run.max_staleness": str(k), "run.seed": str(seed)})
    began = time.perf_counter()
    rows = flowrl.run(graph, out_dir=out, backend="process", overwrite=True).metrics
    rewards = [r["reward_mean"] for r in rows]
    return {"k": k, "seed": seed, "final": statistics.mean(rewards[-LAST:]), "wall_s": time.perf_counter() - began,
            "rewards": rewards}


def smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    for k, label, colour in ((0, "synchronous (K = 0)", "#1c7ed6"), (1, "asynchronous (K = 1)", "#e8590c")):
        mine = [r["rewards"] for r in runs if r["k"] == k]
        mean = [statistics.mean(step) for step in zip(*mine, strict=True)]
        ax.plot(range(1, len(mean) + 1), smooth(mean), lw=2, color=colour, label=label)
        for rewards in mine:
            ax.plot(range(1, len(rewards) + 1), smooth(rewards), lw=0.6, alpha=0.35, color=colour)
    seeds = len({r["seed"] for r in runs})
    ax.set_xlabel("step (128 samples each)")
    ax.set_ylabel(f"mean reward (moving mean of {SMOOTH})")
    ax.set_title(f"grpo_arith, {seeds} seeds: thin lines one seed each, thick their mean", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "async_learning"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "async_arith.svg"))
    args = p.parse_args()
    out = Path(args.out)
    runs = []
    for seed in args.seeds:
        for k in ((0, 1) if seed % 2 == 0 else (1, 0)):  # alternate which goes first
            r = run(k, seed, out / f"k{k}_seed{seed}")
            runs.append(r)
            print(json.dumps({key: v for key, v in r.items() if key != "rewards"}), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(runs))
    plot(runs, Path(args.plot))
    print("\n| seed | final reward, synchronous | final reward, K = 1 | K = 1 - sync | wall s, sync / K = 1 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for seed in args.seeds:
        sync = next(r for r in runs if r["k"] == 0 and r["seed"] == seed)
        ahead = next(r for r in runs if r["k"] == 1 and r["seed"] == seed)
        print(f"| {seed} | {sync['final']:.3f} | {ahead['final']:.3f} | {ahead['final'] - sync['final']:+.3f} | "
              f"{sync['wall_s']:.0f} / {ahead['wall_s']:.0f} |")
    mean = {k: statistics.mean(r["final"] for r in runs if r["k"] == k) for k in (0, 1)}
    print(f"| mean | {mean[0]:.3f} | {mean[1]:.3f} | **{mean[1] - mean[0]:+.3f}** | |")


if __name__ == "__main__":
    main()
