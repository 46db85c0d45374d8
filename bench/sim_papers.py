"""The simulator in the seed papers' published settings, next to the papers' figures (bench/RESULTS_sim.md).

    python bench/sim_papers.py [--steps 24]

Each setting is a `flowrl simulate` of a shipped flow with the paper's cluster, models, batch and response cap;
what the papers do not disclose (batch sizes, samples per prompt, length distributions) is an assumption, listed
in `SETTINGS` and in RESULTS_sim.md. Lengths are the synthetic long tail (backends/sim/workload.py) with the
prompt set revisited every 4 steps, so RLHFless's per-prompt predictor has history (its paper averages over
epochs); means are over steps 2..N.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from flowrl.backends.sim.costs import CostModel
from flowrl.backends.sim.hardware import load_cluster
from flowrl.backends.sim.policies import Options
from flowrl.backends.sim.shapes import known
from flowrl.backends.sim.simulate import SimResult, simulate
from flowrl.backends.sim.work import flow_work
from flowrl.backends.sim.workload import LongTail, synthetic
from flowrl.compiler import compile_file
from flowrl.ir.printer import to_json


@dataclass(frozen=True)
class Setting:
    name: str
    flow: str
    cluster: str
    models: dict[str, str]
    prompts: int
    samples: int
    max_tokens: int
    median: float
    policies: tuple[str, ...]
    opts: dict[str, Options] = field(default_factory=dict)


LAMBDA_1 = {"rlhfless": Options(cost_weight=1.0)}
SETTINGS = [
    # RLHFless physical testbed: 2 x g6e.48xlarge (16 L40S), Qwen2.5-3B, GRPO on GSM8K, max response 2048.
    # Assumed: 256 prompts x 8 samples a step, median response 300 tokens (GSM8K-like); lambda 0.5 and 1.
    Setting("RLHFless, 16 L40S, Qwen2.5-3B GRPO, lambda 0.5", "examples/longtail_grpo.flow", "l40s:2",
            {"actor": "qwen2.5-3b"}, 256, 8, 2048, 300, ("serverful", "rlhfless")),
    Setting("RLHFless, 16 L40S, Qwen2.5-3B GRPO, lambda 1", "examples/longtail_grpo.flow", "l40s:2",
            {"actor": "qwen2.5-3b"}, 256, 8, 2048, 300, ("serverful", "rlhfless"), LAMBDA_1),
    # RLHFless simulation: 20 nodes x 8 H100, Llama-2-70B. Assumed GRPO, 512 prompts x 8, median 300, cap 2048.
    Setting("RLHFless sim, 160 H100, Llama-2-70B GRPO, lambda 0.5", "examples/longtail_grpo.flow", "h100:20",
            {"actor": "llama-2-70b"}, 512, 8, 2048, 300, ("serverful", "rlhfless")),
    Setting("RLHFless sim, 160 H100, Llama-2-70B GRPO, lambda 1", "examples/longtail_grpo.flow", "h100:20",
            {"actor": "llama-2-70b"}, 512, 8, 2048, 300, ("serverful", "rlhfless"), LAMBDA_1),
    # RLHFuse: 32 nodes x 8 Hopper, LLaMA actor/critic pairs 13B/33B .. 65B/33B PPO, global batch 512, max
    # generation 512 .. 2048. Assumed: one sample a prompt, median a quarter of the cap (HH-RLHF chat answers),
    # the reference the actor's shape and the reward model the critic's.
    Setting("RLHFuse, 256 H800, LLaMA 65B/33B PPO, max 2048", "examples/longtail_ppo.flow", "h800:32",
            {"actor": "llama-65b", "critic": "llama-33b", "rm": "llama-33b"}, 512, 1, 2048, 512,
            ("serverful", "rlhfuse")),
    Setting("RLHFuse, 256 H800, LLaMA 65B/33B PPO, max 512", "examples/longtail_ppo.flow", "h800:32",
            {"actor": "llama-65b", "critic": "llama-33b", "rm": "llama-33b"}, 512, 1, 512, 128,
            ("serverful", "rlhfuse")),
    Setting("RLHFuse, 256 H800, LLaMA 13B/33B PPO, max 2048", "examples/longtail_ppo.flow", "h800:32",
            {"actor": "llama-13b", "critic": "llama-33b", "rm": "llama-33b"}, 512, 1, 2048, 512,
            ("serverful", "rlhfuse")),
    # Pipe-RLHF: setting not disclosed (abstract only). Assumed: 64 A100-80G, Llama-2-7B PPO, 512 prompts,
    # cap 1024, median 250.
    Setting("Pipe-RLHF (setting assumed), 64 A100, Llama-2-7B PPO", "examples/longtail_ppo.flow", "a100-80g:8",
            {"actor": "llama-2-7b"}, 512, 1, 1024, 250, ("serverful", "pipe-rlhf")),
]


def run(s: Setting, steps: int) -> dict[str, SimResult]:
    graph = to_json(compile_file(s.flow))
    work = flow_work(graph, {m: known(v) for m, v in s.models.items()}, s.prompts, s.samples, s.max_tokens)
    cost = CostModel(load_cluster(s.cluster))
    tail = LongTail(prompts=s.prompts, samples=s.samples, max_tokens=s.max_tokens, median=s.median,
                    dataset=4 * s.prompts)
    load = synthetic(tail, steps, seed=0)
    return {p: simulate(p, cost, work, load, s.opts.get(p, Options())) for p in s.policies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    for s in SETTINGS:
        res = run(s, args.steps)
        base = res[s.policies[0]]
        print(f"## {s.name}")
        for p, r in res.items():
            notes = ", ".join(f"{k} {v:.3g}" for k, v in r.summary()["notes"].items())
            print(f"  {p:<10} step {r.step_s:8.2f} s  device-s {r.held_s:10.0f}  ({notes})")
        for p, r in list(res.items())[1:]:
            gen = (base.note("gen_s") + base.note("after_gen_s")) / (r.note("gen_s") + r.note("after_gen_s"))
            print(f"  {p} vs {base.policy}: step {base.step_s / r.step_s:.2f}x faster, "
                  f"{1 - r.held_s / base.held_s:.1%} fewer device-seconds (gen+rest {gen:.2f}x)")
            if p == "rlhfuse":
                print(f"    generation+inference {(base.note('gen_s') + _fwd(base)) / (r.note('gen_s') + _fwd(r)):.2f}x "
                      f"shorter, training {_train(base) / _train(r):.2f}x shorter")
        print()


def _fwd(r: SimResult) -> float:
    return _span_sum(r, ("logprobs", "values", "score"))


def _train(r: SimResult) -> float:
    return _span_sum(r, ("update",), distinct=True)


def _span_sum(r: SimResult, ops: tuple[str, ...], distinct: bool = False) -> float:
    total = 0.0
    for step in r.measured:
        seen = set()
        for sp in step.spans:
            if sp.op in ops and (not distinct or (sp.start, sp.end) not in seen):
                seen.add((sp.start, sp.end))
                total += sp.end - sp.start
    return total / len(r.measured)


if __name__ == "__main__":
    main()
