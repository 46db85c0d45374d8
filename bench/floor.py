"""The bare-torch floor of one GRPO step on the benchmark shape (bench/): what any trainer must compute.

Written directly against the HF model, no flowrl controller, worker or batch: a KV-cached sampling loop of
128 rows x 32 tokens, one no-grad forward for the reference log-probs, the reward (decode + Python), one
forward + backward of the GRPO loss (PPO clip + beta * k3 KL, token-mean), grad-norm clip and the AdamW step.
The update is one optimizer step on the rollout, so the old log-probs are the loss forward's own, detached
(what TRL does, and flowrl's on-policy-logp pass); no separate forward computes them. The sampling loop is a plain loop written here (prefill the 128 rows,
then one cached forward + softmax + multinomial per token, EOS masked); flowrl's own engine
(`flowrl.engines.generation.generate`, shared-prefix prefill, buffered KV cache) is timed beside it on the same
prompts, and the floor uses whichever is faster, so it is the lower bound of the two.
Run: `python bench/floor.py [--json OUT.json]` (main venv, after `grpo_vs_trl.py` has written bench/out/).
"""

from __future__ import annotations

import argparse

import grpo_shape as shape
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from flowrl.engines.generation import generate
from flowrl.models.build import cache_kw


def plain_sample(model: torch.nn.Module, ids: Tensor, mask: Tensor, eos: int, gen: torch.Generator) -> Tensor:
    """(N, T) tokens: prefill all N left-padded rows, then T - 1 cached one-token forwards; EOS is never
    sampled. Positions count real tokens only (what flowrl and the loss forward use)."""
    rows, width = ids.shape
    out_tokens = torch.empty((rows, shape.COMPLETION), dtype=torch.long)
    attn = torch.cat([mask, torch.ones((rows, shape.COMPLETION), dtype=torch.long)], dim=1)
    lengths = mask.sum(1, keepdim=True)  # (N, 1)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True,
                    logits_to_keep=1, **cache_kw(model, cache))  # fmt: skip
        for t in range(shape.COMPLETION):
            logits = out.logits[:, -1] / shape.TEMPERATURE  # (N, V)
            logits[:, eos] = float("-inf")  # min_tokens = max_tokens
            tok = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)  # (N, 1)
            out_tokens[:, t] = tok[:, 0]
            if t == shape.COMPLETION - 1:
                break
            out = model(input_ids=tok, attention_mask=attn[:, : width + t + 1], position_ids=lengths + t,
                        use_cache=True, **cache_kw(model, cache))  # fmt: skip
    return out_tokens


def positions(mask: Tensor) -> Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def token_logprobs(model: torch.nn.Module, seq: Tensor, mask: Tensor) -> Tensor:
    """(N, T) log-prob of each completion token; `seq` is (N, P + T), left-padded as `mask` says."""
    length = shape.COMPLETION
    out = model(input_ids=seq, attention_mask=mask, position_ids=positions(mask), use_cache=False,
                logits_to_keep=length + 1)  # fmt: skip
    logits = out.logits[:, :-1]  # (N, T, V): position t predicts completion token t
    logits = logits / shape.TEMPERATURE
    picked = logits.gather(-1, seq[:, -length:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def grpo_loss(logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor) -> Tensor:
    """PPO clip + beta * k3 KL, token-mean (every row has exactly T tokens, so no mask is needed)."""
    ratio = torch.exp(logp - old)  # (N, T)
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - shape.CLIP, 1 + shape.CLIP))
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    return (pg + shape.BETA * kl).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--steps", type=int, default=shape.STEPS)
    args = parser.parse_args()

    path = str(shape.CKPT)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    policy = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    ref.requires_grad_(False)
    optim = torch.optim.AdamW(policy.parameters(), lr=shape.LR, weight_decay=0.0)
    rows = shape.prompt_rows()
    eos = int(tok.eos_token_id)
    gen = torch.Generator().manual_seed(shape.SEED)

    class _Tok:  # the Tokenizer protocol flowrl's engine needs (pad and EOS only)
        pad_id, eos_id = int(tok.pad_token_id), eos

    names = ("sample (plain loop)", "sample (flowrl engine)", "ref logp", "reward", "loss + backward",
             "clip + AdamW")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    marks = [shape.cpu_mark()]

    def clock(name: str) -> None:
        marks.append(shape.cpu_mark())
        wall[name].append(marks[-1][0] - marks[-2][0])
        cpu[name].append(marks[-1][2] - marks[-2][2])

    for step in range(args.steps):
        batch = rows[step * shape.PROMPTS_PER_STEP : (step + 1) * shape.PROMPTS_PER_STEP]
        prompts = [tok(r["prompt"])["input_ids"] for r in batch]  # BOS + the characters
        ids, mask = (x.repeat_interleave(shape.GROUP, dim=0) for x in left_pad(prompts, int(tok.pad_token_id)))
        marks.append(shape.cpu_mark())
        completion = plain_sample(policy, ids, mask, eos, gen)  # (N, T)
        clock("sample (plain loop)")
        generate(policy, _Tok(), prompts, n=shape.GROUP, max_tokens=shape.COMPLETION,  # type: ignore[arg-type]
                 min_tokens=shape.COMPLETION, temperature=shape.TEMPERATURE, generator=gen)  # fmt: skip
        clock("sample (flowrl engine)")
        seq = torch.cat([ids, completion], dim=1)  # (N, P + T)
        seq_mask = torch.cat([mask, torch.ones_like(completion)], dim=1)
        with torch.inference_mode():
            ref_lp = token_logprobs(ref, seq, seq_mask)
            clock("ref logp")
        texts = tok.batch_decode(completion.tolist(), skip_special_tokens=True)
        scores = torch.tensor([shape.reward(r["prompt"], c, answer=r["answer"])
                               for r, c in zip([r for r in batch for _ in range(shape.GROUP)], texts, strict=True)])
        grouped = scores.view(-1, shape.GROUP)  # (B, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()
        clock("reward")
        optim.zero_grad(set_to_none=True)
        logp = token_logprobs(policy, seq, seq_mask)
        loss = grpo_loss(logp, logp.detach(), ref_lp, adv)  # one optimizer step: the old log-probs are logp's
        loss.backward()
        clock("loss + backward")
        torch.nn.utils.clip_grad_norm_(policy.parameters(), shape.MAX_GRAD_NORM)
        optim.step()
        clock("clip + AdamW")

    def total(table: dict[str, list[float]], sampler: str) -> list[float]:
        """Per-step sum of every phase except the other sampler."""
        parts = [v for k, v in table.items() if not k.startswith("sample") or k == sampler]
        return [sum(step) for step in zip(*parts, strict=True)]

    plain, engine = total(wall, "sample (plain loop)"), total(wall, "sample (flowrl engine)")
    use_engine = shape.median(shape.steady(engine)) < shape.median(shape.steady(plain))
    sampler = "sample (flowrl engine)" if use_engine else "sample (plain loop)"
    # Other processes' load over each whole step (both samplers ran in it).
    step_marks = [m for i, m in enumerate(marks) if i == 0 or (i - 1) % (len(names) + 1) == len(names)]
    result = {
        "system": "floor",
        "torch_threads": torch.get_num_threads(),
        "step_s": engine if use_engine else plain,
        "others_cores": shape.others_cores(step_marks),
        "cpu_s": total(cpu, sampler),
        "floor_sampler": sampler[8:-1],
        "step_s_plain_loop": plain,
        "step_s_flowrl_engine": engine,
        "phases": wall,
    }
    shape.write_result(args.json, result)
    print(f"floor: median {shape.median(shape.steady(plain)):.3f} s with the plain loop, "
          f"{shape.median(shape.steady(engine)):.3f} s with flowrl's engine")
    for name, secs in wall.items():
        print(f"  {name:24s} {shape.median(shape.steady(secs)):7.3f} s")


if __name__ == "__main__":
    main()
