"""flowrl's DPO and reward-model steps against TRL's DPOTrainer and RewardTrainer (bench/), same model, data, batch.

    python bench/preference_vs_trl.py [--rounds 3] [--steps 8]

Writes the inputs (bench/preference_shape.py), then alternates, each round: flowrl's DPO steps (share-prefix on,
then off), TRL's DPOTrainer (bench/.venv-trl, `make bench` creates it), flowrl's reward-model steps, TRL's
RewardTrainer. A step is one optimizer step on BATCH pairs: for DPO the policy's forward and backward over chosen
and rejected and the frozen reference's forward; for the reward model its forward and backward over both.

flowrl runs what a flow's step runs: the flow of `flow_text` (the stdlib `dpo` / `reward_model` template in the
bench's shape) compiled by flowrl.compile_flow, a ModelWorker on its model declarations, and per step the calls
the controller makes on a data batch of rows: `ref.logprobs(pairs)` then `actor.update(pairs, loss = "dpo",
ref_logp = ...)`, or `rm.update(pairs, loss = "bradley_terry")`, with the compiled nodes' attrs (the update
tokenises the rows, shuffles by pair, steps TrainEngine). Share-prefix as the pass decides (it marks both nodes:
each pair's ~135-token prompt runs once) and with the pass switched off. The worker is driven here rather than
through flowrl.run so that a step is timed as TRL's is, in this process's CPU seconds, and the reward model can
start from TRL's seeded score head; the controller's own work between nodes (moving batches) is not timed.

Reported: the median step after WARMUP steps (wall and this process's CPU seconds: both sides run torch with
THREADS threads, so on a machine others are using the CPU seconds are the fairer figure), the speed-up, and the
first step's loss on each side.
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


def flow_text(kind: str) -> str:
    """The bench's shape as a flow: the stdlib `dpo` (policy + its frozen step-0 reference) or `reward_model`
    template on the pairs file, with the bench's checkpoint, learning rate, beta and batch."""
    data = f'data pairs = jsonl("{shape.PAIRS_FILE}") {{ batch = {shape.BATCH}, shuffle = false }}'
    if kind == "dpo":
        return (f'flow bench_dpo\nmodel actor : policy {{ source = "hf:{shape.CKPT}"\n lr = {shape.LR} }}\n'
                f"model ref : reference {{ source = actor }}\n{data}\n"
                f"use dpo(beta = {shape.BETA}, max_grad_norm = {shape.MAX_GRAD_NORM})\nrun {{ seed = 0 }}\n")
    return (f'flow bench_rm\nmodel rm : reward_model {{ source = "hf:{shape.CKPT}"\n lr = {shape.LR} }}\n{data}\n'
            f"use reward_model(max_grad_norm = {shape.MAX_GRAD_NORM})\nrun {{ seed = 0 }}\n")


def data_batch(rows: list[dict[str, str]], first: int) -> Any:
    """Rows as the controller's data node hands them on (flowrl.runtime.controller._prompt_batch)."""
    from flowrl.runtime.batch import Batch

    return Batch(len(rows), {}, {"prompt": [r["prompt"] for r in rows], "row": rows,
                                 "prompt_id": list(range(first, first + len(rows))),
                                 "prompt_slot": list(range(len(rows)))})


def flowrl_run(kind: str, steps: int, share: bool) -> dict[str, Any]:
    """`steps` steps of the flow's DPO (kind "dpo": `ref.logprobs(pairs)` then `actor.update(pairs, loss =
    "dpo", ...)`) or reward-model (kind "rm": `rm.update(pairs, loss = "bradley_terry")`) update, as the local
    backend's controller calls them: the compiled graph's nodes and attrs (share-prefix as the pass decides, or
    the pass switched off), a ModelWorker on its model declarations, a data batch of rows per step. Step times
    (wall, CPU), first losses, and whether share-prefix marked the nodes."""
    import torch

    import flowrl
    from flowrl.runtime.batch import training_batch
    from flowrl.runtime.worker import ModelWorker

    torch.set_num_threads(shape.THREADS)
    graph = flowrl.compile_flow(flow_text(kind), "bench.flow", no_pass=() if share else ("share-prefix",))
    worker = ModelWorker(graph.models, graph.models, seed=0)
    update = next(n for n in graph.nodes if n.op == "update")
    forward = next((n for n in graph.nodes if n.op == "logprobs"), None)
    model = str(update.model)
    if kind == "rm":  # TRL's seeded score head, so both sides start from the same weights
        from transformers import GPT2ForSequenceClassification

        head = GPT2ForSequenceClassification.from_pretrained(shape.RM_CKPT).score.weight
        value_head = worker.models[model].module.get_submodule("value_head")
        assert isinstance(value_head, torch.nn.Linear)
        with torch.no_grad():
            value_head.weight.copy_(head)
            value_head.bias.zero_()
    marked = all(bool(n.attrs.get("share_prefix")) for n in (update, forward) if n is not None)
    rows = shape.read_pairs()
    times, cpu, losses = [], [], []
    for step in range(steps):
        data = data_batch(rows[step * shape.BATCH:(step + 1) * shape.BATCH], step * shape.BATCH)
        start, start_cpu = time.perf_counter(), time.process_time()
        inputs = {"rollout": data}
        if forward is not None:
            inputs["ref_logp"] = worker.logprobs(str(forward.model), data, dict(forward.attrs))
        out = worker.update(model, training_batch(inputs), dict(update.attrs), step_seed=step)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(out["dpo_loss" if kind == "dpo" else "rm_loss"])
    return {"times": times, "cpu": cpu, "losses": losses, "share_prefix": marked}


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
            ours = flowrl_run(kind, args.steps, share=True)
            plain = flowrl_run(kind, args.steps, share=False)
            trl = trl_run(kind, args.steps)
            if not ours["share_prefix"] or plain["share_prefix"]:
                raise SystemExit(f"{kind}: share-prefix should mark the flow's nodes, and not with the pass off")
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
