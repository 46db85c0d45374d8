"""GRPO step time side by side (bench/): flowrl vs TRL's GRPOTrainer vs the bare-torch floor, same shape.

Writes the shared checkpoint and prompts (bench/grpo_shape.py), then runs each system in its own process,
one at a time, interleaved round by round (flowrl, TRL, floor, flowrl, TRL, floor, ...) so background load
hits all three alike: flowrl and the floor in this venv, TRL in bench/.venv-trl (`make bench` creates it).
Each run does STEPS steps and the first WARMUP are dropped. Every step also records how many cores *other*
processes used meanwhile (from /proc/stat); before each run the harness waits (up to --wait s) for the
machine to go quiet. The table reports, per system: the median of the quiet steps alone (others used
< QUIET cores) pooled over rounds, the median over rounds of each run's median step, the fastest and slowest
run median, the best step and the median CPU seconds per step; the ratios follow, pooled and paired by round.
On a busy machine the all-steps figures mostly measure the neighbours: read the quiet-step column.
Run: `python bench/grpo_vs_trl.py [--rounds 3] [--threads 1]`; writes bench/out/grpo_vs_trl[_threadsN].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if "--shape" in sys.argv[:-1]:  # before grpo_shape is imported: it (and every child process) reads the shape
    os.environ["FLOWRL_BENCH_SHAPE"] = sys.argv[sys.argv.index("--shape") + 1]

import grpo_shape as shape  # noqa: E402

MAIN_PY = sys.executable
TRL_PY = shape.BENCH / ".venv-trl" / "bin" / "python"
SYSTEMS = {
    "flowrl": (MAIN_PY, "run_flowrl.py"),
    "trl": (TRL_PY, "run_trl.py"),
    "floor": (MAIN_PY, "floor.py"),
}
LABELS = {"flowrl": "flowrl (grpo template)", "trl": "TRL GRPOTrainer", "floor": "bare-torch floor"}


def wait_quiet(limit_s: float) -> float:
    """Wait until other processes use < QUIET cores over a 2 s window (at most `limit_s`); returns the last use."""
    deadline = time.perf_counter() + limit_s
    while True:
        a = shape.cpu_mark()
        time.sleep(2.0)
        used = shape.others_cores([a, shape.cpu_mark()])[0]
        if not used >= shape.QUIET or time.perf_counter() > deadline:  # `not >=`: nan (no /proc) passes
            return used


def run_one(system: str, round_no: int, wait_s: float, threads: int, extra: list[str]) -> dict[str, Any]:
    python, script = SYSTEMS[system]
    out = shape.OUT / f"result_{system}_{round_no}.json"
    out.unlink(missing_ok=True)
    idle = wait_quiet(wait_s)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))  # torch's intra-op pool
    proc = subprocess.run([str(python), str(shape.BENCH / script), "--json", str(out), *extra], cwd=shape.BENCH,
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{script} failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    result.update(load_before=load, others_before=idle, wall_s=time.perf_counter() - start)
    steady = shape.steady(result["step_s"])
    print(f"  round {round_no} {system:7s} median {shape.median(steady):6.3f} s  min {min(steady):6.3f} s  "
          f"quiet steps {len(quiet_steps(result))}/{len(steady)}  "
          f"(load {load:.2f}, process {result['wall_s']:.0f} s)", flush=True)
    return result


def quiet_steps(result: dict[str, Any]) -> list[float]:
    """Steady-state steps during which other processes used < QUIET cores."""
    pairs = zip(shape.steady(result["step_s"]), shape.steady(result["others_cores"]), strict=True)
    return [t for t, others in pairs if not others >= shape.QUIET]


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    table = {}
    for system, results in runs.items():
        medians = [shape.median(shape.steady(r["step_s"])) for r in results]
        quiet = [t for r in results for t in quiet_steps(r)]
        table[system] = {
            "quiet": shape.median(quiet),
            "quiet_n": len(quiet),
            "steps_n": sum(len(shape.steady(r["step_s"])) for r in results),
            "median": statistics.median(medians),
            "min_run": min(medians),
            "max_run": max(medians),
            "best": min(min(shape.steady(r["step_s"])) for r in results),
            "cpu": shape.median([c for r in results for c in shape.steady(r["cpu_s"])]),
            "others": shape.median([o for r in results for o in shape.steady(r["others_cores"])]),
        }
    return table


def phases(results: list[dict[str, Any]]) -> tuple[dict[str, float], str]:
    """Median time of each phase over the quiet steady steps of every run (all steady steps if none was quiet)."""
    def pick(r: dict[str, Any], values: list[float]) -> list[float]:
        pairs = zip(shape.steady(values), shape.steady(r["others_cores"]), strict=True)
        return [v for v, others in pairs if not others >= shape.QUIET]

    quiet = any(pick(r, r["step_s"]) for r in results)
    out = {}
    for name in results[0]["phases"]:
        values = [v for r in results for v in (pick(r, r["phases"][name]) if quiet else shape.steady(r["phases"][name]))]
        out[name] = shape.median(values)
    return out, "quiet steps" if quiet else "all steps (none was quiet)"


def ratio(a: dict[str, float], b: dict[str, float]) -> str:
    """a / b on each statistic, as one line."""
    return (f"{a['quiet'] / b['quiet']:.2f}x quiet steps, {a['median'] / b['median']:.2f}x all steps, "
            f"{a['best'] / b['best']:.2f}x best step, {a['cpu'] / b['cpu']:.2f}x CPU s")  # fmt: skip


def paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> str:
    """a / b within each round where both had >= 3 quiet steps: neighbours change over minutes, so a ratio of
    two runs minutes apart is fairer than a ratio of pooled medians."""
    ratios = [shape.median(quiet_steps(ra)) / shape.median(quiet_steps(rb))
              for ra, rb in zip(runs[a], runs[b], strict=True)
              if len(quiet_steps(ra)) >= 3 and len(quiet_steps(rb)) >= 3]  # fmt: skip
    if not ratios:
        return "no round had both quiet"
    return f"{shape.median(ratios):.2f}x paired by round ({min(ratios):.2f}..{max(ratios):.2f}, {len(ratios)} rounds)"


def prompt_tokens() -> str:
    """Prompt length in tokens (characters + BOS) over the prompt file: "9" or "130..134"."""
    sizes = sorted({len(r["prompt"]) + 1 for r in shape.prompt_rows()})
    return str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"


def render(table: dict[str, dict[str, float]], runs: dict[str, list[dict[str, Any]]], loads: list[float]) -> str:
    fl, trl, floor = table["flowrl"], table["trl"], table["floor"]
    threads = sorted({r["torch_threads"] for results in runs.values() for r in results})
    passes = "; ".join(runs["flowrl"][0].get("passes", [])) or "none"
    lines = [
        f"GRPO step, shape {shape.SHAPE!r}, tiny GPT-2 (L{shape.LAYERS} d{shape.DIM} h{shape.HEADS}, vocab 17), "
        f"{shape.PROMPTS_PER_STEP} prompts ({prompt_tokens()} tokens) x {shape.GROUP} samples x {shape.COMPLETION} tokens, fp32 CPU, "
        f"torch threads {'/'.join(map(str, threads))}, {len(runs['flowrl'])} rounds x "
        f"{shape.STEPS - shape.WARMUP} steps (after {shape.WARMUP} warm-up)",
        f"flowrl passes: {passes}",
        f"load average (1 min) before each run: {min(loads):.2f} .. {max(loads):.2f}; quiet step = other processes "
        f"used < {shape.QUIET} of the {os.cpu_count()} cores during it",
        "",
        "| system | quiet steps: median s (n) | all steps: median s | fastest run | slowest run | best step s "
        "| CPU s / step | others' cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system, row in table.items():
        lines.append(
            f"| {LABELS[system]} | {row['quiet']:.3f} ({row['quiet_n']:.0f}/{row['steps_n']:.0f}) | "
            f"{row['median']:.3f} | {row['min_run']:.3f} | {row['max_run']:.3f} | {row['best']:.3f} | "
            f"{row['cpu']:.2f} | {row['others']:.2f} |"
        )
    lines += [
        "",
        f"TRL / flowrl (target >= 3x): {ratio(trl, fl)}; {paired(runs, 'trl', 'flowrl')}",
        f"flowrl / floor (target <= 1.15x): {ratio(fl, floor)}; {paired(runs, 'flowrl', 'floor')}",
        f"TRL / floor: {ratio(trl, floor)}; {paired(runs, 'trl', 'floor')}",
        f"floor sampler: {', '.join(sorted({r['floor_sampler'] for r in runs['floor']}))}",
        "",
        "Where the time goes (seconds per step, median of each phase over the quiet steps):",
    ]
    for system in runs:
        parts, over = phases(runs[system])
        lines.append(f"- {LABELS[system]} ({over}): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=shape.SHAPES, default=shape.SHAPE,
                        help="prompt shape (grpo_shape.py): short 9-token or fewshot ~134-token prompts")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process (OMP_NUM_THREADS); 0 = torch's default (one per core)")
    parser.add_argument("--wait", type=float, default=30.0, help="max seconds to wait for a quiet machine per run")
    parser.add_argument("--no-pass", action="append", default=[], metavar="NAME",
                        help="switch a flowrl pass off (default: the passes `flowrl run` applies)")
    parser.add_argument("--only", nargs="*", choices=list(SYSTEMS), help="run only these systems")
    args = parser.parse_args()
    if not TRL_PY.exists():
        raise SystemExit(f"no TRL venv at {TRL_PY.parent.parent}; `make bench` creates it")
    shape.write_inputs()
    systems = args.only or list(SYSTEMS)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    print(f"load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    for round_no in range(args.rounds):
        for system in systems:
            extra = [f"--no-pass={name}" for name in args.no_pass] if system == "flowrl" else []
            runs[system].append(run_one(system, round_no, args.wait, args.threads, extra))
    loads = [r["load_before"] for results in runs.values() for r in results]
    tag = f"_threads{args.threads}" if args.threads else ""
    (shape.OUT / f"grpo_vs_trl{tag}.json").write_text(json.dumps(runs, indent=1), encoding="utf-8")
    if set(systems) == set(SYSTEMS):
        text = render(summarize(runs), runs, loads)
        Path(shape.OUT / f"grpo_vs_trl{tag}.md").write_text(text, encoding="utf-8")
        print("\n" + text)


if __name__ == "__main__":
    main()
