"""Reward workers and overlap vs inline scoring: a reward that takes 20 ms per sample, 128 samples a step.

The long-tail GRPO workload (examples/longtail_grpo.flow: 16 prompts x 8 samples, responses of 1..64 tokens)
with its reward replaced by `bench/slow_rewards.slow_length` (20 ms a sample), on the local backend, same seed:
- inline: `reward length = "slow_rewards.slow_length"` (called on the controller, sample by sample);
- workers: `{ workers = 4 }` with `--no-pass fuse-gen-inference` (4 processes, after generation);
- workers + overlap: `{ workers = 4 }` with the default passes (each chunk scored as it finishes).
Configurations alternate within each round, so the machine's load drifts onto all alike. Reported: the median
step time over measured steps (after one warm-up step) per round, and the ratios inline / other.

    python bench/rewards.py --rounds 3 --steps 5

`--verifiers` instead measures the shipped verifiers' own cost per call (no run): `math_equal` in its helper
process against math-verify called in this process (what it did before the helper), on the math example's
answers, and `code_tests` per row (3 assert tests, 500 assert tests, 500 stdin/stdout tests, a solution that
loops until the row's limit), in the strict sandbox where this machine gives one.

    python bench/rewards.py --verifiers --repeat 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import flowrl  # noqa: E402

CONFIGS = {  # name -> (reward block, passes switched off)
    "inline": ("", []),
    "workers=4": ("{ workers = 4 }", ["fuse-gen-inference"]),
    "workers=4 + overlap": ("{ workers = 4 }", []),
}


def flow_text(block: str) -> str:
    text = (ROOT / "examples" / "longtail_grpo.flow").read_text()
    text = text.replace('reward length = "flowrl.rewards.length_target"',
                        f'import "slow_rewards"\nreward length = "slow_rewards.slow_length" {block}')
    return text.replace('jsonl("data/', f'jsonl("{ROOT}/examples/data/')


def measure(name: str, steps: int, work: Path) -> tuple[float, float]:
    block, off = CONFIGS[name]
    path = work / f"{name.replace(' ', '').replace('+', '_').replace('=', '')}.flow"
    path.write_text(flow_text(block))
    graph = flowrl.load(str(path), no_pass=off)
    rows = flowrl.run(graph, out_dir=work / "runs" / path.stem, steps=steps + 1, overwrite=True).metrics
    measured = rows[1:]  # the first step warms up caches (and, with workers, their first samples)
    return (statistics.median(r["step_time_s"] for r in measured),
            statistics.median(r.get("time/scores", 0.0) for r in measured))


def _per_call(fn: object, args: list[tuple[object, ...]]) -> float:
    t0 = time.perf_counter()
    for a in args:
        fn(*a)  # type: ignore[operator]
    return (time.perf_counter() - t0) / len(args)


def verifiers(repeat: int) -> None:
    from math_verify import parse, verify

    from flowrl.rewards import code, math, sandbox

    rows = [json.loads(line) for line in (ROOT / "examples/data/math_word.jsonl").read_text().splitlines()]
    calls = [(f"so the answer is {r['answer']}.", str(r["answer"])) for r in rows] * max(1, repeat // len(rows))

    def in_process(response: str, answer: str) -> bool:
        return bool(verify(parse(answer, parsing_timeout=None), parse(response, parsing_timeout=None),
                           timeout_seconds=None))

    in_process(*calls[0])
    math.math_equal("", "1", answer="1")  # the helper started (its start-up is not a call's)
    print(f"math_equal: {len(calls)} calls")
    print(f"  math-verify in this process: {_per_call(in_process, calls) * 1e3:.2f} ms a call")
    print(f"  math_equal (helper process): "
          f"{_per_call(lambda r, a: math.math_equal('', r, answer=a), calls) * 1e3:.2f} ms a call")
    add = "def add(a, b):\n    return a + b\n"
    cases = {
        "3 assert tests": (add, ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]),
        "500 assert tests": (add, [f"assert add({i}, 1) == {i + 1}" for i in range(500)]),
        "500 stdin/stdout tests": ("print(int(input()) + 1)\n",
                                   [{"input": str(i), "output": str(i + 1)} for i in range(500)]),
    }
    print(f"code_tests ({sandbox.isolation().describe()[:60]}...), {max(3, repeat // 20)} rows each:")
    for name, (solution, tests) in cases.items():
        each = _per_call(lambda s, t: code.run_tests(s, t), [(solution, tests)] * max(3, repeat // 20))
        print(f"  {name}: {each * 1e3:.0f} ms a row")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifiers", action="store_true", help="the shipped verifiers' cost per call instead")
    p.add_argument("--repeat", type=int, default=200, help="--verifiers: math calls (code rows: a twentieth)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="measured steps per run (after one warm-up step)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if args.verifiers:
        verifiers(args.repeat)
        return
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sys.path.insert(0, str(work))
        for r in range(args.rounds):
            names = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                step, score = measure(name, args.steps, work)
                rows.append({"round": r + 1, "config": name, "step_s": step, "scores_s": score})
                print(f"round {r + 1} {name:>20}: step {step:.3f} s, reward node {score:.3f} s", flush=True)
    print("\n| config | step (median of rounds) | rounds | inline / this |")
    print("| --- | ---: | --- | ---: |")
    med = {n: statistics.median(float(str(x["step_s"])) for x in rows if x["config"] == n) for n in CONFIGS}
    for n in CONFIGS:
        each = ", ".join(f"{float(str(x['step_s'])):.3f}" for x in rows if x["config"] == n)
        print(f"| {n} | {med[n]:.3f} s | {each} | {med['inline'] / med[n]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
