"""drop-reference on vs off: the memory and the step time a KL-free graph saves by not building its reference.

    .venv/bin/python bench/passes_drop_reference.py --runs 3 --steps 4

Each run is a `flowrl run` in a process of its own, on a GSPO flow (kl_coef = 0: nothing reads the reference's
log-probs) with a GPT-2 shaped policy (8 layers, width 512: 25.2M parameters, 101 MB in float32) on the local
backend (4 prompts x 4 samples of exactly 8 tokens a step by default), alternately with the default passes ("on")
and with `--no-pass drop-reference` ("off"), so the machine's load drifts onto both alike. Memory is the child process's peak resident set as the kernel counts it
(`getrusage(RUSAGE_CHILDREN).ru_maxrss`, read here after the child exits: an observer outside flowrl), set against
the reference's own weights (its parameter count x 4 bytes). Time is the median `step_time_s` of the steps after the
first, the `ref_logp` node's own time (`time/ref_logp`, off only) and the child's wall time on this script's clock.
Both sides must train the same numbers (every metric but the timings and kl_mean, which only "off" has).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLOW = """flow drop_reference_bench
model actor : policy {{ source = "tiny:gpt2", layers = {layers}, dim = {dim}, heads = 8, charset = "0123456789+=",
                       lr = 1e-5 }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("{data}") {{ batch = {batch}, shuffle = true }}
use gspo(reward = correct, group = {group}, max_tokens = {tokens}, min_tokens = {tokens})
run {{ seed = 0 }}
"""
HOW_IT_RAN = ("time/", "cost/", "step_time_s", "tokens_per_s", "kl_mean", "actor/kl_mean")


def one_run(flow: Path, out: Path, steps: int, off: bool) -> dict[str, Any]:
    """A child `flowrl run`; its peak RSS from the kernel (the children's maximum grows only when this child's
    peak exceeds every earlier child's, so each run is measured in a fresh grandchild: `measure_child`)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(flow), str(out), str(steps),
           "off" if off else "on"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    peak_kb = int(done.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    return {"peak_mb": peak_kb / 1024, "wall_s": wall, "rows": rows,
            "step_s": statistics.median(r["step_time_s"] for r in later),
            "ref_s": statistics.median(r.get("time/ref_logp", 0.0) for r in later)}


def measure_child(flow: str, out: str, steps: str, side: str) -> None:
    """Run the flow in a grandchild and print its peak RSS in KiB (ru_maxrss of RUSAGE_CHILDREN: only it ran)."""
    cmd = [sys.executable, "-m", "flowrl", "run", flow, "--steps", steps, "--out", out, "--overwrite", "--quiet",
           "--backend", "local"] + (["--no-pass", "drop-reference"] if side == "off" else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def same_numbers(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(HOW_IT_RAN) and k not in HOW_IT_RAN}
        assert keys == {k for k in rb if not k.startswith(HOW_IT_RAN) and k not in HOW_IT_RAN}, keys
        worst = max([worst, *(abs(float(ra[k]) - float(rb[k])) for k in keys)])
    return worst


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        measure_child(*sys.argv[2:6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="pairs of runs (on, off), alternating which goes first")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=8, help="response tokens (min_tokens = max_tokens)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        flow = folder / "flow.flow"
        flow.write_text(FLOW.format(layers=args.layers, dim=args.dim, batch=args.batch, group=args.group,
                                    tokens=args.tokens, data=ROOT / "examples/data/arith.jsonl"))
        sides: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for i in range(args.runs):
            for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
                r = one_run(flow, folder / f"{side}{i}", args.steps, side == "off")
                sides[side].append(r)
                print(f"run {i} {side}: peak {r['peak_mb']:.0f} MB, step {r['step_s']:.3f} s, "
                      f"ref forward {r['ref_s']:.3f} s, wall {r['wall_s']:.1f} s", flush=True)
        diff = max(same_numbers(a["rows"], b["rows"]) for a, b in zip(sides["on"], sides["off"], strict=True))
    sys.path.insert(0, str(ROOT))
    from flowrl.models.build import ModelSpec, build_model

    ref = build_model(ModelSpec(source="tiny:gpt2", config={"layers": args.layers, "dim": args.dim, "heads": 8,
                                                            "charset": "0123456789+="}, role="reference"), 0)
    ref_params = sum(p.numel() for p in ref.module.parameters())
    ref_mb = sum(p.numel() * p.element_size() for p in ref.module.parameters()) / 2**20
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("peak_mb", "step_s", "ref_s", "wall_s")}
           for s, rs in sides.items()}
    saved = [b["peak_mb"] - a["peak_mb"] for a, b in zip(sides["on"], sides["off"], strict=True)]
    step_x = [b["step_s"] / a["step_s"] for a, b in zip(sides["on"], sides["off"], strict=True)]
    report = {"runs": args.runs, "steps": args.steps, "samples": args.batch * args.group, "tokens": args.tokens, "ref_params": ref_params, "ref_weights_mb": ref_mb,
              "peak_on_mb": med["on"]["peak_mb"], "peak_off_mb": med["off"]["peak_mb"],
              "saved_mb": statistics.median(saved), "saved_mb_range": [min(saved), max(saved)],
              "step_on_s": med["on"]["step_s"], "step_off_s": med["off"]["step_s"],
              "step_x": statistics.median(step_x), "step_x_range": [min(step_x), max(step_x)],
              "ref_forward_off_s": med["off"]["ref_s"], "max_metric_diff": diff}
    print(json.dumps(report, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
