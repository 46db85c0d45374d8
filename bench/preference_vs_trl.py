"""flowrl's DPO and reward-model steps against TRL's DPOTrainer and RewardTrainer (bench/), same model, data, batch.

    python bench/preference_vs_trl.py [--rounds 3] [--steps 8]

Writes the inputs (bench/preference_shape.py), then alternates, each round: flowrl's DPO steps, TRL's DPOTrainer
(bench/.venv-trl, `make bench` creates it), flowrl's reward-model steps, TRL's RewardTrainer. A step is one
optimizer step on BATCH pairs: for DPO the policy's forward and backward over chosen and rejected and the frozen
reference's forward; for the reward model its forward and backward over both. flowrl runs what a worker's update
runs (flowrl.runtime.pairs, flowrl.runtime.preference, TrainEngine) with share-prefix on (each pair's prompt once)
and off. Reported: the median step after WARMUP steps (wall and this process's CPU seconds: both sides run torch
with THREADS threads, so on a machine others are using the CPU seconds are the fairer figure), the speed-up, and
the first step's loss on each side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import preference_shape as shape  # noqa: E402

TRL_PY = BENCH / ".venv-trl" / "bin" / "python"


def _batch(rows: list[dict[str, str]]) -> Any:
    from flowrl.runtime.batch import Batch

    return Batch(len(rows), {}, {"prompt": [r["prompt"] for r in rows], "row": rows})


def flowrl_run(kind: str, steps: int, share: int) -> dict[str, Any]:
    """`steps` optimizer steps of flowrl's DPO (kind "dpo") or reward-model ("rm") update; step times and losses."""
    import torch

    from flowrl.engines.forward import forward_logprobs
    from flowrl.engines.prefix import shared_logprobs
    from flowrl.engines.training import TrainEngine
    from flowrl.models.build import ModelSpec, build_model
    from flowrl.runtime.pairs import pair_batch
    from flowrl.runtime.preference import dpo_micro_loss, reward_micro_loss

    torch.set_num_threads(shape.THREADS)
    rows = shape.read_pairs()
    source = f"hf:{shape.CKPT}"
    if kind == "dpo":
        policy = build_model(ModelSpec(source, role="policy"), seed=0)
        ref = build_model(ModelSpec(source, role="reference"), seed=0)
        module, tok = policy.module, policy.tokenizer
    else:
        rm = build_model(ModelSpec(source, role="reward_model"), seed=0)
        module, tok = rm.module, rm.tokenizer
        from transformers import GPT2ForSequenceClassification

        head = GPT2ForSequenceClassification.from_pretrained(shape.RM_CKPT).score.weight  # TRL's same head
        with torch.no_grad():
            module.value_head.weight.copy_(head)
            module.value_head.bias.zero_()
    engine = TrainEngine(module, lr=shape.LR, max_grad_norm=shape.MAX_GRAD_NORM)
    times, cpu, losses = [], [], []
    for step in range(steps):
        picked = rows[step * shape.BATCH:(step + 1) * shape.BATCH]
        start, start_cpu = time.perf_counter(), time.process_time()
        pairs = pair_batch(_batch(picked), tok, context=256)
        if kind == "dpo":
            inputs = [pairs[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
            with torch.inference_mode():
                ref_logp = (shared_logprobs(ref.module, *inputs, min_len=share, pad=tok.pad_id) if share else None)
                if ref_logp is None:
                    ref_logp = forward_logprobs(ref.module, *inputs)
            ref_logp = ref_logp.clone()
            out = engine.step([pairs], lambda mb, n=shape.BATCH, ref=ref_logp: dpo_micro_loss(
                module, mb, num_pairs=n, ref_logp=ref, beta=shape.BETA, share=share))
            losses.append(out["dpo_loss"])
        else:
            out = engine.step([pairs], lambda mb, n=shape.BATCH: reward_micro_loss(module, mb, num_pairs=n,
                                                                                   share=share))
            losses.append(out["rm_loss"])
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"times": times, "cpu": cpu, "losses": losses}


def trl_run(kind: str, steps: int) -> dict[str, Any]:
    if not TRL_PY.exists():
        raise SystemExit("TRL's venv is missing: run `make bench` once (it creates bench/.venv-trl)")
    out = shape.OUT / f"trl_{kind}.json"
    subprocess.run([str(TRL_PY), str(BENCH / "run_trl_preference.py"), kind, "--steps", str(steps),
                    "--json", str(out)], check=True, cwd=BENCH.parent)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _median(times: list[float]) -> float:
    return statistics.median(times[shape.WARMUP:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=shape.STEPS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    shape.write_inputs()
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for kind in ("dpo", "rm"):
            ours = flowrl_run(kind, args.steps, share=16)
            plain = flowrl_run(kind, args.steps, share=0)
            trl = trl_run(kind, args.steps)
            row = {"round": r + 1, "kind": kind, "flowrl_s": _median(ours["times"]),
                   "flowrl_noshare_s": _median(plain["times"]), "trl_s": _median(trl["times"]),
                   "flowrl_cpu_s": _median(ours["cpu"]), "flowrl_noshare_cpu_s": _median(plain["cpu"]),
                   "trl_cpu_s": _median(trl["cpu"]),
                   "flowrl_loss1": ours["losses"][0], "trl_loss1": trl["losses"][0]}
            row["speedup"] = row["trl_s"] / row["flowrl_s"]
            row["speedup_cpu"] = row["trl_cpu_s"] / row["flowrl_cpu_s"]
            results.append(row)
            print(f"round {r + 1} {kind:3s}: wall flowrl {row['flowrl_s'] * 1e3:6.0f} ms (no share-prefix "
                  f"{row['flowrl_noshare_s'] * 1e3:6.0f}), TRL {row['trl_s'] * 1e3:6.0f} ms, {row['speedup']:.2f}x"
                  f" | CPU flowrl {row['flowrl_cpu_s'] * 1e3:6.0f} ms ({row['flowrl_noshare_cpu_s'] * 1e3:6.0f}), "
                  f"TRL {row['trl_cpu_s'] * 1e3:6.0f} ms, {row['speedup_cpu']:.2f}x"
                  f" | first-step loss {row['flowrl_loss1']:.6f} vs {row['trl_loss1']:.6f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
