"""Generation-speed benchmark (bench/): flowrl's torch decode loop vs `transformers` `model.generate`.

Shapes (`--shape`), both tiny GPT-2 (layers=2, dim=128, heads=4), temperature 1, exactly the new tokens asked
(min_tokens = max_tokens): `wide` (default) 16 prompts x n=8 samples, prompt length 32, 64 new tokens; `short`
the short-prompt GRPO shape of issue 34 item 9, 4 prompts x n=4, prompt length 9, 32 new tokens. Prints generated
tokens/s (median of --repeats runs after one warm-up). `--clock cpu` times with the process's CPU clock on one
torch thread instead of the wall clock (what to use on a machine shared with other work). flowrl is called with
a `generator` (its seed), which every version of `generate` takes: `PYTHONPATH=<another checkout>` times that one.
Run: `python bench/gen_speed.py [--shape short] [--clock cpu] [--repeats 5]`.

`--sampler` times one decode step's sampling alone (the part that depends on how randomness is drawn), at
vocabularies from the tiny byte tokenizer's to a real model's, for the ways a row's draw could be keyed:
the counter-based per-row streams flowrl samples with (one hashed uniform per row, inverse CDF in float64) with
the hash run once a step or, as `generate` does, 32 steps at a time (`Draws`), one torch.Generator per row (one
draw each), and the exponential race over a (rows, V) noise tensor from one shared generator, which flowrl used
before (fast, but a row's draws depend on the batch it is in).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from flowrl.engines.generation import generate
from flowrl.models.build import ModelSpec, build_model

# shape -> (prompts, samples per prompt, prompt length, new tokens)
SHAPES = {"wide": (16, 8, 32, 64), "short": (4, 4, 9, 32)}


def _time(fns: dict[str, Callable[[], object]], repeats: int,
          clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per variant; rounds interleave the variants so background load hits them all alike."""
    for fn in fns.values():
        fn()  # warm-up: allocator, kernels, lazy imports
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _sampler_variants(rows: int, vocab: int) -> dict[str, Callable[[], object]]:
    from flowrl.engines.sampling import Draws, inverse_cdf, row_keys, uniforms

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    keys = row_keys(7, range(rows // 8), 8)
    draws = Draws(keys)
    shared = torch.Generator().manual_seed(7)
    per_row = [torch.Generator().manual_seed(i) for i in range(rows)]
    steps = iter(range(10**9))

    def hashed_each_step() -> object:
        return inverse_cdf(torch.softmax(logits, dim=-1), uniforms(keys, next(steps)))

    def streams() -> object:
        return inverse_cdf(torch.softmax(logits, dim=-1), draws.at(next(steps)))

    def generators() -> object:
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in per_row])
        return inverse_cdf(torch.softmax(logits, dim=-1), u)

    def race() -> object:
        noise = torch.rand(logits.shape, generator=shared).log_().neg_()
        return (torch.softmax(logits, dim=-1) / noise).argmax(dim=-1)

    return {"per-row streams (flowrl, Draws)": streams, "per-row streams, hashed each step": hashed_each_step,
            "per-row generators": generators, "shared-generator race (before)": race}


def sampler_bench(repeats: int, rows: int = 128, vocabs: tuple[int, ...] = (260, 32_000, 151_936)) -> None:
    """Seconds per decode step of sampling (rows, V) logits: softmax, the draw, the token."""
    print(f"sampling one decode step | {rows} rows | torch threads: {torch.get_num_threads()} | median of {repeats}")
    for vocab in vocabs:
        for name, seconds in _time(_sampler_variants(rows, vocab), repeats).items():
            print(f"V={vocab:<7d} {name:34s} {seconds * 1e3:8.3f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time on one torch thread (for a machine shared with other work)")
    parser.add_argument("--sampler", action="store_true", help="time one step's sampling alone")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.clock == "cpu":
        torch.set_num_threads(1)
        clock = time.process_time
    if args.sampler:
        sampler_bench(max(args.repeats, 20))
        return

    prompts_n, samples, prompt_len, new_tokens = SHAPES[args.shape]
    loaded = build_model(ModelSpec("tiny:gpt2", {"layers": 2, "dim": 128, "heads": 4}, role="policy"), seed=0)
    module, tok = loaded.module, loaded.tokenizer
    data = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (prompts_n, prompt_len), generator=data).tolist()
    total = prompts_n * samples * new_tokens

    def ours(share: bool) -> Callable[[], object]:
        def run() -> object:
            return generate(module, tok, prompts, n=samples, max_tokens=new_tokens, min_tokens=new_tokens,
                            generator=torch.Generator().manual_seed(1), share_prefix=share)  # fmt: skip

        return run

    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)

    def hf() -> object:
        torch.manual_seed(1)
        with torch.inference_mode():
            return module.generate(  # type: ignore[operator]
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, num_return_sequences=samples, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=tok.pad_id, eos_token_id=tok.eos_id,
            )  # fmt: skip

    shape = f"{prompts_n} prompts x n={samples} | prompt {prompt_len} | {new_tokens} new tokens"
    print(f"tiny gpt2 L2 d128 h4 | {shape}")
    print(f"torch threads: {torch.get_num_threads()}  clock: {args.clock}  repeats: {args.repeats} (median)")
    results = _time(
        {
            "flowrl generate (share_prefix=True)": ours(True),
            "flowrl generate (share_prefix=False)": ours(False),
            "transformers model.generate": hf,
        },
        args.repeats,
        clock,
    )
    baseline = results["transformers model.generate"]
    for name, seconds in results.items():
        print(f"{name:40s} {seconds * 1e3:8.1f} ms  {total / seconds:9.0f} tok/s  x{baseline / seconds:.2f}")


if __name__ == "__main__":
    main()
