"""Multi-turn rollouts with slow environments: the overlapped decode loop against the barrier loop (issue 26).

The same `generate_turns` call (flowrl.engines.turns) on the same tiny policy, prompts and environments, with
`overlap` on (a sample whose environment is pending leaves the decode batch and the others keep decoding) and off
(the barrier loop: every live sample generates its turn, then every environment call is awaited, then the next
turn). The environments are examples/envs/latency.py in the production pool (flowrl.envs.pool.EnvPool, warm
processes): each step waits a lognormal time (p99/p50 = exp(2.326 sigma), 6.4 at sigma 0.8) drawn from the
trajectory's own seeded stream, so both loops wait exactly the same times. The median is set from the measured
decode time of one trajectory's turn (the barrier loop's busy time against environments that answer at once, over
its turns and, with `--decode-batch C`, over the ceil(N / C) decode batches each turn takes), so a step costs about
a turn.

`--decode-batch C` (the env key `decode_batch`, an engine's max_num_seqs): at most C trajectories decode at once,
the others queue with their caches kept, in both loops; a rollout of N > C trajectories is the usual shape (a
step's thousands of samples against a decode batch of hundreds).

With `--forwards` (issue 26 item 4) each rollout is followed by the forwards grpo runs over it, the policy's
old log-probs and the reference's log-probs (`forward_logprobs`, as `ModelWorker.logprobs` runs them), and three
loops are timed: `fused` (fuse-gen-inference: `stream_turns` hands out finished trajectories whenever every live
one waits on its environment, and both forwards run on them then), `overlap` (the overlapped loop, forwards over
the whole rollout after it) and `barrier` (the barrier loop, forwards after). Trajectories/s counts the rollout
and its forwards; idle is the seconds with nothing to decode and nothing to forward while environments are
pending, over the whole (rollout + forwards) wall.

Reported per run: trajectories per second, the generation loop's idle fraction (seconds with nothing to decode
while environments were pending / wall seconds), prefill tokens per trajectory against prompt + observations
(what a token-in/token-out loop must prefill) and against what a loop that re-prefills the history every turn would
(quadratic in turns), and that the loops produced the same tokens (and, with `--forwards`, the same log-probs).
Issue 26's targets: >= 2x trajectories/s with the overlap, idle <= 10%.

    python bench/multiturn.py --rounds 3
    python bench/multiturn.py --rounds 3 --forwards
    python bench/multiturn.py --rounds 5 --batch 256 --decode-batch 64 --forwards
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flowrl.engines.forward import forward_logprobs
from flowrl.engines.turns import TurnChunk, TurnOutput, generate_turns, stream_turns
from flowrl.envs.pool import EnvPool
from flowrl.envs.protocol import EnvSpec
from flowrl.models.build import ModelSpec, build_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CHARSET = "0123456789+=;"
OBS = "12+34=;"  # each step's observation: 7 tokens prefilled onto the kept cache


def build(dim: int) -> Any:
    spec = ModelSpec("tiny:gpt2", {"layers": 2, "dim": dim, "heads": 4, "charset": CHARSET, "context": 512})
    return build_model(spec, seed=0)


def _pool(args: argparse.Namespace, median: float, overlap: bool) -> EnvPool:
    """The latency environments' pool, its processes started before the clock runs."""
    options = {"median": median, "sigma": args.sigma, "seed": args.seed, "obs": OBS, "turns": args.turns}
    spec = EnvSpec(name="lat", target="envs.latency.Latency", max_turns=args.turns, workers=args.workers,
                   timeout=60.0, on_error="raise", folder=str(EXAMPLES), overlap=overlap, options=options)
    pool = EnvPool(spec)
    warm = [pool.reset(("warm", i), {"id": -1}) for i in range(args.workers)]
    for f in warm:
        f.result()
    for i in range(args.workers):
        pool.release(("warm", i))
    return pool


def _inputs(model: Any, args: argparse.Namespace) -> tuple[list[list[int]], list[dict[str, Any]], dict[str, Any]]:
    """Prompts, rows (row `id` keys the latencies) and the sampling arguments of a rollout."""
    tok = model.tokenizer
    prompts = [tok.encode(f"{i % 90 + 10}+{(7 * i) % 90 + 10}=") for i in range(args.batch)]
    rows = [{"id": i} for i in range(args.batch)]
    kw = dict(n=1, max_tokens=args.tokens, min_tokens=args.tokens, max_turns=args.turns, temperature=1.0,
              seed=args.seed, decode_batch=args.decode_batch)
    return prompts, rows, kw


def rollout(model: Any, args: argparse.Namespace, *, median: float, overlap: bool) -> TurnOutput:
    """One `generate_turns` call over `args.batch` trajectories (one per prompt)."""
    prompts, rows, kw = _inputs(model, args)
    pool = _pool(args, median, overlap)
    try:
        return generate_turns(model.module, model.tokenizer, prompts, rows, pool, overlap=overlap, **kw)
    finally:
        pool.close()


def _forwards(models: list[Any], out: TurnOutput) -> list[torch.Tensor]:
    """grpo's forwards over trajectories: the policy's old log-probs and the reference's, (N, T) each."""
    with torch.inference_mode():
        return [forward_logprobs(m.module, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                 temperature=1.0) for m in models]


def with_forwards(models: list[Any], args: argparse.Namespace, *, median: float,
                  loop: str) -> tuple[dict[str, Any], torch.Tensor, list[torch.Tensor]]:
    """A rollout and its forwards as `loop` ("fused" | "overlap" | "barrier") runs them -> (the row reported,
    the response ids and the forwards' outputs, in row order)."""
    prompts, rows, kw = _inputs(models[0], args)
    pool = _pool(args, median, loop != "barrier")
    policy = models[0]
    try:
        began = time.perf_counter()
        if loop != "fused":
            out = generate_turns(policy.module, policy.tokenizer, prompts, rows, pool, overlap=loop == "overlap", **kw)
            gen_s = time.perf_counter() - began
            logps = _forwards(models, out)
            wall, idle, ids, count = time.perf_counter() - began, out.idle_s, out.response_ids, 1
        else:
            chunks: list[TurnChunk] = []
            parts: list[list[torch.Tensor]] = []
            for c in stream_turns(policy.module, policy.tokenizer, prompts, rows, pool, overlap=True, **kw):
                assert isinstance(c, TurnChunk)  # no `park`: never suspended
                chunks.append(c)
                parts.append(_forwards(models, c.out))  # while every live trajectory waits on its environment
            wall = gen_s = time.perf_counter() - began
            idle, count = sum(c.out.idle_s for c in chunks), len(chunks)
            order = torch.argsort(torch.tensor([r for c in chunks for r in c.rows]))
            width = max(c.out.response_ids.shape[1] for c in chunks)

            def cat(tensors: list[torch.Tensor], fill: int = 0) -> torch.Tensor:
                return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)
                                  for t in tensors])[order]

            ids = cat([c.out.response_ids for c in chunks], policy.tokenizer.pad_id)
            logps = [cat([p[k] for p in parts]) for k in range(len(models))]
    finally:
        pool.close()
    row = {"loop": loop, "traj_per_s": round(args.batch / wall, 2), "wall_s": round(wall, 3),
           "idle_frac": round(idle / wall, 3), "gen_s": round(gen_s, 3), "chunks": count}
    return row, ids, logps


def prefill_counts(out: TurnOutput) -> tuple[float, float, float]:
    """Per trajectory, means: prefilled tokens, prompt + observation tokens, and what re-prefilling the whole
    history before every turn would cost (prompt + everything before turn k's first action token, summed on k)."""
    prompt_len = out.prompt_mask.sum(dim=1)  # (N,)
    obs = (out.response_mask.bool() & ~out.loss_mask.bool()).sum(dim=1)  # (N,)
    naive = []
    for i in range(out.response_ids.shape[0]):
        acted = out.loss_mask[i].bool()  # (T,)
        starts = [int(torch.nonzero(acted & (out.turn_index[i] == k))[0]) for k in range(int(out.turns[i]))]
        naive.append(sum(int(prompt_len[i]) + s for s in starts))
    return (float(out.prefill_tokens.float().mean()), float((prompt_len + obs).float().mean()),
            statistics.fmean(naive))


def measure(model: Any, args: argparse.Namespace, median: float, overlap: bool) -> tuple[dict[str, Any], Any]:
    out = rollout(model, args, median=median, overlap=overlap)
    steps = sorted(s for per in out.step_seconds for s in per[1:])  # the steps, not the resets
    prefilled, linear, naive = prefill_counts(out)
    row = {"loop": "overlap" if overlap else "barrier", "traj_per_s": round(len(out.ended) / out.wall_s, 2),
           "wall_s": round(out.wall_s, 3), "idle_frac": round(out.idle_s / out.wall_s, 3),
           "turns_mean": round(float(out.turns.float().mean()), 2),
           "env_step_p50_s": round(steps[len(steps) // 2], 4), "env_step_p99_s": round(steps[int(len(steps) * 0.99)], 4),
           "prefill_per_traj": round(prefilled, 1), "prompt_plus_obs": round(linear, 1),
           "reprefill_per_traj": round(naive, 1), "ended": sorted(set(out.ended))}
    return row, out.response_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="trajectories a rollout (one per prompt)")
    p.add_argument("--turns", type=int, default=6, help="environment steps a trajectory (it ends after them)")
    p.add_argument("--tokens", type=int, default=8, help="tokens a turn (EOS banned until then)")
    p.add_argument("--sigma", type=float, default=0.8, help="the latency's log-space sigma")
    p.add_argument("--median", type=float, default=0.0, help="median env seconds (0: one turn's decode time)")
    p.add_argument("--workers", type=int, default=4, help="environment processes")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the decode loop's)")
    p.add_argument("--decode-batch", type=int, default=0,
                   help="trajectories decoding at once (the engine's max_num_seqs; 0: every one)")
    p.add_argument("--forwards", action="store_true",
                   help="time each rollout with grpo's forwards over it: fused (streamed) vs overlap vs barrier")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.dim)
    median = args.median
    waves = math.ceil(args.batch / args.decode_batch) if args.decode_batch > 0 else 1
    if median <= 0:  # one turn's decode time: the same rollout against environments that answer at once
        quick = [rollout(model, args, median=0.0, overlap=False) for _ in range(2)][-1]
        # Decoding, not the pool's round trips; a trajectory's turn is one of the turn's `waves` decode batches.
        median = (quick.wall_s - quick.idle_s) / (args.turns * waves)
        print(f"decode time of one trajectory's turn ({min(args.batch, args.decode_batch or args.batch)} decoding"
              f" at once of {args.batch}, {args.tokens} tokens): {median * 1000:.1f} ms"
              f" (the barrier loop with environments that answer at once: {quick.wall_s:.2f} s wall,"
              f" {quick.idle_s:.2f} s waiting on the pool)", flush=True)
    print(f"latency: lognormal, median {median * 1000:.1f} ms, sigma {args.sigma}, p99/p50 "
          f"{math.exp(2.3263 * args.sigma):.1f}; {args.batch} trajectories x {args.turns} turns x {args.tokens} tokens;"
          f" {args.workers} env processes; {platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, load {os.getloadavg()[0]:.2f}", flush=True)
    if args.forwards:
        return fused_rounds([model, build(args.dim)], args, median)  # the reference: the policy's initial weights
    rows = []
    for r in range(args.rounds):
        ids: dict[bool, Any] = {}
        for overlap in ((True, False) if r % 2 == 0 else (False, True)):
            row, ids[overlap] = measure(model, args, median, overlap)
            rows.append({"round": r + 1, **row})
            print(json.dumps(rows[-1]), flush=True)
        same = ids[True].shape == ids[False].shape and bool(torch.equal(ids[True], ids[False]))
        print(f"round {r + 1}: same tokens with and without the overlap: {same}", flush=True)
    print()
    print("| loop | trajectories/s | idle | prefill/traj | prompt+obs | re-prefill/traj | env step p50 / p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for loop in ("overlap", "barrier"):
        mine = [x for x in rows if x["loop"] == loop]
        print(f"| {loop} | {statistics.median(x['traj_per_s'] for x in mine):.1f} "
              f"({', '.join(str(x['traj_per_s']) for x in mine)}) "
              f"| {statistics.median(x['idle_frac'] for x in mine):.1%} | {mine[0]['prefill_per_traj']} "
              f"| {mine[0]['prompt_plus_obs']} | {mine[0]['reprefill_per_traj']} "
              f"| {mine[0]['env_step_p50_s'] * 1000:.0f} / {mine[0]['env_step_p99_s'] * 1000:.0f} ms |")
    by_round = {(x["round"], x["loop"]): x["traj_per_s"] for x in rows}
    ratios = [by_round[r + 1, "overlap"] / by_round[r + 1, "barrier"] for r in range(args.rounds)]
    print(f"\noverlap / barrier, trajectories/s, per round: {', '.join(f'{x:.2f}x' for x in ratios)}"
          f" (median {statistics.median(ratios):.2f}x)")


def fused_rounds(models: list[Any], args: argparse.Namespace, median: float) -> None:
    """Rounds of the three loops with grpo's forwards, their order rotated each round."""
    loops = ["fused", "overlap", "barrier"]
    rows = []
    for r in range(args.rounds):
        seen: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for loop in loops[r % 3 :] + loops[: r % 3]:
            row, ids, logps = with_forwards(models, args, median=median, loop=loop)
            seen[loop] = (ids, logps)
            rows.append({"round": r + 1, **row})
            print(json.dumps(rows[-1]), flush=True)
        base_ids, base_lp = seen["barrier"]
        same = all(torch.equal(ids, base_ids) and all(torch.allclose(a, b, atol=1e-5)
                                                      for a, b in zip(lp, base_lp, strict=True))
                   for ids, lp in seen.values())
        print(f"round {r + 1}: same tokens and log-probs in the three loops: {same}", flush=True)
    print()
    print("| loop | trajectories/s (median; rounds) | idle (median) | chunks | vs barrier per round (median) |")
    print("| --- | --- | --- | --- | --- |")
    by = {(x["round"], x["loop"]): x for x in rows}
    for loop in loops:
        mine = [x for x in rows if x["loop"] == loop]
        ratios = [by[x["round"], loop]["traj_per_s"] / by[x["round"], "barrier"]["traj_per_s"] for x in mine]
        vs = "" if loop == "barrier" else (f"{', '.join(f'{x:.2f}x' for x in ratios)} "
                                           f"(**{statistics.median(ratios):.2f}x**)")
        print(f"| {loop} | {statistics.median(x['traj_per_s'] for x in mine):.1f} "
              f"({', '.join(str(x['traj_per_s']) for x in mine)}) | {statistics.median(x['idle_frac'] for x in mine):.1%} "
              f"| {mine[0]['chunks']} | {vs} |")


if __name__ == "__main__":
    sys.path.insert(0, str(EXAMPLES))  # the environments' module, as a flow's folder is on the path
    main()
