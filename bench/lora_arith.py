"""LoRA against full fine-tuning on the arithmetic example: reward, trainable parameters, peak memory and the bytes a
weight sync moves (issue 35 items 5-6; figures in bench/RESULTS_lora.md and README.md's LoRA section).

    python bench/lora_arith.py [--steps 300] [--base-steps 100] [--tune-steps 150] [--seeds 0 1] [--wide-reps 2]
                               [--out runs/bench_lora]

Arms, alternated (full, LoRA, full, LoRA, ...) so that load from other work on the machine falls on both alike:

- from scratch: examples/grpo_arith.flow (full fine-tuning) and examples/grpo_arith_lora.flow (the same flow, the
  policy training rank-8 adapters at a higher lr, its reference the policy's base with the adapters off), `--steps`
  steps, seed 0;
- on a trained base, LoRA's regime (a pretrained model adapted): grpo_arith.flow trained `--base-steps` steps and
  exported (`flowrl export`), then both flows from that directory (`source = "hf:BASE"`), `--tune-steps` steps per
  seed of `--seeds`;
- memory where the weights dominate: both flows at 4 layers of dim 512 (12.6M parameters), 3 steps, `--wide-reps`
  times each.

Each run is a child `python -m flowrl run` process. Its peak resident memory is the kernel's count: the child reads
`VmHWM` from its own /proc/self/status at exit (an atexit hook set before flowrl is imported), and the parent checks
it against `ru_maxrss` of `os.wait4` for that child (both the kernel's, by two routes). Trainable parameters are
counted on the policy as a worker builds it (`requires_grad`) and checked against the tensors the run's last
checkpoint holds for it (for LoRA, the adapters alone). The bytes a weight sync moves per update (a serverless
instance's new version, a Ray group's pull) are `ModelWorker.weights(packed=True)`, what the backends ship, checked
against pickle's length of the same object. Writes OUT/results.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import flowrl  # noqa: E402
from flowrl.runtime.worker import ModelWorker  # noqa: E402

FLOWS = {"full": ROOT / "examples" / "grpo_arith.flow", "lora": ROOT / "examples" / "grpo_arith_lora.flow"}
WIDE = {"actor.layers": "4", "actor.dim": "512", "actor.heads": "8"}
LAST = 20  # steps the final reward is the mean of
TARGET = 0.5  # reward whose first crossing (moving mean of 10 steps) is reported
# runs in the child before flowrl: at exit, write the process's peak RSS as the kernel counts it
HOOK = ("import atexit, os, runpy, sys\n"
        "def hwm():\n"
        "    kib = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "    open(os.environ['BENCH_HWM'], 'w').write(kib)\n"
        "atexit.register(hwm)\n"
        "sys.argv = ['flowrl'] + sys.argv[1:]\n"
        "runpy.run_module('flowrl', run_name='__main__', alter_sys=True)\n")


def child_run(flow: Path, out: Path, sets: dict[str, str], steps: int) -> dict[str, Any]:
    """`flowrl run` in a child process: its metrics, wall time and peak RSS (the kernel's, for that child alone)."""
    cmd = [sys.executable, "-c", HOOK, "run", str(flow), "--out", str(out), "--overwrite", "--steps", str(steps)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    hwm = out.with_suffix(".hwm")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_HWM": str(hwm)}
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err.decode()[-3000:]}")
    vm_hwm = int(hwm.read_text()) / 1024
    maxrss = usage.ru_maxrss / 1024
    # two routes to the kernel's count: they agree but for what the interpreter touches after the atexit hook
    assert abs(vm_hwm - maxrss) < 0.05 * maxrss, (vm_hwm, maxrss)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [float(r["reward_mean"]) for r in rows]
    smooth = [statistics.mean(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
    return {"final": statistics.mean(rewards[-LAST:]), "first": rewards[0],
            "steps_to_target": next((i + 1 for i, r in enumerate(smooth) if r >= TARGET), None),
            "wall_s": wall, "peak_rss_mib": vm_hwm, "ru_maxrss_mib": maxrss, "rewards": rewards}


def trainable(flow: Path, sets: dict[str, str], run_dir: Path | None = None) -> dict[str, Any]:
    """The policy's parameters as a worker builds it, trained and all, with the bytes one update's sync moves; and
    (given a run) the numbers of values the run's last checkpoint holds for it."""
    graph = flowrl.load(str(flow), overrides=sets)
    worker = ModelWorker(graph.models, graph.models, seed=0)
    module = worker.models["actor"].module
    packed = worker.weights("actor", packed=True)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in module.parameters()),
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "sync_bytes": sum(a.data.nbytes for a in packed.values()),
        "sync_pickled": len(pickle.dumps(packed, protocol=5)),
    }
    assert abs(out["sync_pickled"] - out["sync_bytes"]) < 0.05 * out["sync_bytes"] + 65536, out
    if run_dir is not None:
        last = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
        saved = torch.load(last, map_location="cpu", weights_only=False)
        held = next(g["actor"]["module"] for g in saved["groups"].values() if "actor" in g)
        out["checkpoint_values"] = sum(t.numel() for t in held.values())
    return out


def on_base(flow: Path, base: Path, out: Path) -> Path:
    """`flow` with its policy built from the Hugging Face directory `base` (its shape comes from there), written into
    `out` with its data path made absolute."""
    keep = [line for line in flow.read_text().splitlines()
            if line.split("=")[0].strip() not in ("layers", "dim", "heads", "charset")]
    text = "\n".join(keep).replace('"tiny:gpt2"', f'"hf:{base}"')
    text = text.replace('"data/arith.jsonl"', f'"{flow.parent / "data" / "arith.jsonl"}"')
    path = out / f"based_{flow.name}"
    path.write_text(text + "\n")
    return path


def spread(values: list[float], fmt: str) -> str:
    """`mean (min-max)` of `values`, or the one value."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def table(r: dict[str, Any]) -> str:
    def runs(arm: str, prefix: str) -> list[dict[str, Any]]:
        return [v for k, v in r.items() if k.startswith(f"{prefix}/{arm}/")]

    def cell(arm: str, prefix: str, key: str, fmt: str, scale: float = 1.0) -> str:
        return spread([x[key] * scale for x in runs(arm, prefix)], fmt)

    def reach(arm: str, prefix: str) -> str:
        got = [x["steps_to_target"] for x in runs(arm, prefix)]
        return ", ".join(str(s) if s else "never" for s in got)

    info = r["params"]
    lines = ["| | full fine-tuning | LoRA (rank 8, α 16) |", "| --- | --- | --- |",
             f"| trainable parameters, 2×64 (of {info['full']['params']:,}) | {info['full']['trainable']:,} | "
             f"{info['lora']['trainable']:,} |",
             f"| from scratch (seed 0): reward at step 1 → last {LAST} | "
             f"{cell('full', 'arith', 'first', '.2f')} → {cell('full', 'arith', 'final', '.2f')} | "
             f"{cell('lora', 'arith', 'first', '.2f')} → {cell('lora', 'arith', 'final', '.2f')} |",
             f"| from scratch: step where the 10-step mean reaches {TARGET} | {reach('full', 'arith')} | "
             f"{reach('lora', 'arith')} |",
             f"| on a trained base: reward at step 1 → last {LAST}, mean (min–max) over seeds | "
             f"{cell('full', 'based', 'first', '.2f')} → {cell('full', 'based', 'final', '.2f')} | "
             f"{cell('lora', 'based', 'first', '.2f')} → {cell('lora', 'based', 'final', '.2f')} |",
             f"| on a trained base: step where the 10-step mean reaches {TARGET} (per seed) | {reach('full', 'based')} | "
             f"{reach('lora', 'based')} |",
             f"| peak RSS, 2×64 | {cell('full', 'arith', 'peak_rss_mib', '.0f')} MiB | "
             f"{cell('lora', 'arith', 'peak_rss_mib', '.0f')} MiB |",
             f"| wall time, 2×64 | {cell('full', 'arith', 'wall_s', '.0f')} s | {cell('lora', 'arith', 'wall_s', '.0f')} s |",
             f"| trainable parameters, 4×512 (of {info['wide/full']['params']:,}) | {info['wide/full']['trainable']:,} | "
             f"{info['wide/lora']['trainable']:,} |",
             f"| peak RSS, 4×512 (3 steps) | {cell('full', 'wide', 'peak_rss_mib', '.0f')} MiB | "
             f"{cell('lora', 'wide', 'peak_rss_mib', '.0f')} MiB |",
             f"| bytes one weight sync moves, 2×64 | {info['full']['sync_bytes'] / 2**10:.0f} KiB | "
             f"{info['lora']['sync_bytes'] / 2**10:.0f} KiB |",
             f"| bytes one weight sync moves, 4×512 | {info['wide/full']['sync_bytes'] / 2**20:.1f} MiB | "
             f"{info['wide/lora']['sync_bytes'] / 2**20:.2f} MiB |"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--base-steps", type=int, default=100)
    ap.add_argument("--tune-steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--wide-reps", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_lora")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"params": {}}
    for arm, flow in FLOWS.items():
        results[f"arith/{arm}/0"] = got = child_run(flow, out / f"{arm}_scratch", {}, args.steps)
        print(arm, "from scratch", {k: v for k, v in got.items() if k != "rewards"}, flush=True)
    child_run(FLOWS["full"], out / "base", {}, args.base_steps)
    base = out / "base_hf"
    subprocess.run([sys.executable, "-m", "flowrl", "export", str(out / "base"), "-o", str(base), "--overwrite"],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    based = {arm: on_base(flow, base, out) for arm, flow in FLOWS.items()}
    for seed in args.seeds:
        for arm, flow in based.items():
            run_dir = out / f"{arm}_based_s{seed}"
            results[f"based/{arm}/{seed}"] = got = child_run(flow, run_dir, {"run.seed": str(seed)}, args.tune_steps)
            print(arm, "on the base, seed", seed, {k: v for k, v in got.items() if k != "rewards"}, flush=True)
    for arm, flow in FLOWS.items():
        results["params"][arm] = trainable(flow, {}, out / f"{arm}_scratch")
        results["params"][f"wide/{arm}"] = trainable(flow, WIDE)
        print(arm, results["params"][arm], results["params"][f"wide/{arm}"], flush=True)
    for rep in range(args.wide_reps):
        for arm, flow in FLOWS.items():
            results[f"wide/{arm}/{rep}"] = got = child_run(flow, out / f"wide_{arm}_{rep}", WIDE, 3)
            print(arm, "wide", rep, {k: v for k, v in got.items() if k != "rewards"}, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
