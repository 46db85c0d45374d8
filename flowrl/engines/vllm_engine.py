"""The vLLM generation engine (flowrl.engines): sampling from an `hf:` checkpoint with vLLM on a CUDA device.

Chosen per model with `engine = "vllm"` (a policy then generates with vLLM and still trains with torch, see
flowrl.engines.select); `import vllm` happens only here, lazily, with an error naming the extra to install.

`VLLMGenerator.generate` returns the same `GenOutput` as the torch engine (flowrl.engines.generation), built by
`to_gen_output` from vLLM's RequestOutput/CompletionOutput objects; that conversion is pure and unit-tested.
What differs from the torch engine, by design of vLLM:
- log-probs come from `logprobs_mode="processed_logprobs"`: the sampled token under softmax(logits / temperature)
  like the torch engine, except that vLLM renormalises over the top-p nucleus and over the EOS-banned vocabulary
  during the first `min_tokens` steps (the torch engine reports the unrestricted tempered distribution). Training
  recomputes old log-probs with the torch module anyway, so these are diagnostics;
- random streams differ: each prompt's request is seeded from (seed, its slot in the step) by
  `flowrl.engines.sampling.request_seed`, so a prompt's n samples do not depend on the batch it came in (any split
  or order of prompts gives the same samples), but vLLM's sampler draws them, not the torch engine's streams.
  (Not run here: vLLM needs a CUDA device; the seeds' derivation is tested without it.)

After each policy update the worker pushes the new weights with `load_weights`: they go to vLLM's worker
process(es) through `LLM.collective_rpc` into `WeightLoaderExtension` (vLLM's `worker_extension_cls` hook,
which calls the model's own `load_weights`, the path vLLM's RLHF examples use), then the prefix cache is reset
because cached KV blocks were computed with the old weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.engines.generation import GenOutput, check_sampling_args
from flowrl.engines.sampling import Sampling, request_seed, slots_of
from flowrl.models.tokenizer import Tokenizer

__all__ = ["INSTALL_HINT", "VLLMGenerator", "WeightLoaderExtension", "import_vllm", "request_seeds", "to_gen_output"]

INSTALL_HINT = "pip install 'flowrl[vllm]'"
_CHUNK_BYTES = 512 * 2**20  # weights per collective_rpc message: bounds the extra host memory of one sync


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"engine \"vllm\" needs vLLM, which is not installed: {INSTALL_HINT}") from exc
    return vllm


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker class (`worker_extension_cls`), so `collective_rpc` can call it by name."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def flowrl_load_weights(self, names: list[str], tensors: list[Tensor]) -> None:
        # HF parameter names: vLLM's loader maps them (and fuses q/k/v, gate/up) like it does for a checkpoint.
        self.model_runner.model.load_weights(weights=list(zip(names, tensors, strict=True)))


class VLLMGenerator:
    """One vLLM `LLM` for one policy; `generate` has the torch engine's contract (the settings as one `Sampling`,
    as the streaming torch engine takes them), `load_weights` syncs it."""

    def __init__(
        self,
        source: str,
        tokenizer: Tokenizer,
        *,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if not source.startswith("hf:"):
            raise ValueError(f"VLLMGenerator needs an hf: source (a local checkpoint directory), got {source!r}")
        vllm = import_vllm()
        self.tokenizer = tokenizer
        self._sampling_params = vllm.SamplingParams
        # 0.5 of the GPU, not vLLM's 0.9: the torch trainer of the same policy shares the device.
        # enforce_eager: CUDA-graph capture costs start-up time and memory that short RLHF rollouts rarely repay.
        self.llm = vllm.LLM(
            model=source[len("hf:"):], tokenizer=source[len("hf:"):], dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            max_model_len=max_model_len, logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
        )  # fmt: skip

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, sampling: Sampling, seed: int | None = None,
                 prompt_slots: Sequence[int] | None = None) -> GenOutput:
        """Sample `n` responses per prompt with `sampling`'s settings (temperature 0 is greedy); rows are prompt
        0's n samples, then 1's... Prompt i's request is seeded from (`seed`, `prompt_slots[i]`) (slots default
        to 0..B-1)."""
        s = sampling
        check_sampling_args(prompts, n, s.max_tokens, s.min_tokens, s.temperature, s.top_p)
        eos = self.tokenizer.eos_id
        # One SamplingParams per prompt so equal prompts in a batch still draw different samples.
        seeds = request_seeds(seed, prompt_slots, len(prompts))
        params = [
            self._sampling_params(
                n=n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, min_tokens=s.min_tokens,
                logprobs=0, seed=seed_i, detokenize=False, stop_token_ids=[eos] if eos is not None else None,
            )
            for seed_i in seeds
        ]  # fmt: skip
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return to_gen_output(prompts, outputs, n=n, pad_id=self.tokenizer.pad_id)

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy updated policy weights (HF names, e.g. the torch module's state_dict) into vLLM's model."""
        names: list[str] = []
        tensors: list[Tensor] = []
        size = 0
        for name, tensor in state_dict.items():
            cpu = tensor.detach().to("cpu")
            names.append(name)
            tensors.append(cpu)
            size += cpu.numel() * cpu.element_size()
            if size >= _CHUNK_BYTES:
                self.llm.collective_rpc("flowrl_load_weights", args=(names, tensors))
                names, tensors, size = [], [], 0
        if names:
            self.llm.collective_rpc("flowrl_load_weights", args=(names, tensors))
        self.llm.reset_prefix_cache()


def request_seeds(seed: int | None, prompt_slots: Sequence[int] | None, batch: int) -> list[int | None]:
    """Each prompt's request seed: a function of (seed, its slot) only (None without a seed: vLLM's own)."""
    if seed is None:
        return [None] * batch
    return [request_seed(seed, s) for s in slots_of(prompt_slots, batch)]


def to_gen_output(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Any], *, n: int, pad_id: int
) -> GenOutput:
    """vLLM's outputs for `prompts` (one RequestOutput each, in order, with `n` completions) as a GenOutput.

    Reads only `RequestOutput.outputs` and, per CompletionOutput, `index`, `token_ids` and `logprobs` (one
    {token_id: Logprob} mapping per generated token, requested with `logprobs=0`, so it holds the sampled token).
    """
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    for row, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {row}, expected n={n}")
        for completion in completions:
            tokens = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError("vLLM returned no log-prob per generated token (SamplingParams(logprobs=0) missing?)")
            responses.append(tokens)
            logprobs.append([_sampled_logprob(step, tok) for step, tok in zip(completion.logprobs, tokens, strict=True)])

    rows = len(responses)
    width = max(len(p) for p in prompts)
    length = max(len(r) for r in responses)
    prompt_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width), dtype=torch.long)
    response_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((rows, length), dtype=torch.long)
    out_lp = torch.zeros((rows, length), dtype=torch.float32)
    for row in range(rows):
        prompt = [int(t) for t in prompts[row // n]]
        prompt_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)  # left-padded
        prompt_mask[row, width - len(prompt) :] = 1
        size = len(responses[row])
        response_ids[row, :size] = torch.tensor(responses[row], dtype=torch.long)  # right-padded
        response_mask[row, :size] = 1
        out_lp[row, :size] = torch.tensor(logprobs[row], dtype=torch.float32)
    return GenOutput(
        prompt_ids=prompt_ids,  # (N, P)
        prompt_mask=prompt_mask,  # (N, P)
        response_ids=response_ids,  # (N, T)
        response_mask=response_mask,  # (N, T)
        response_lens=response_mask.sum(dim=1),  # (N,)
        prompt_index=torch.arange(len(prompts)).repeat_interleave(n),  # (N,)
        logprobs=out_lp,  # (N, T)
    )


def _sampled_logprob(step: Mapping[int, Any], token: int) -> float:
    """The sampled token's entry of one position's logprobs mapping (a vLLM `Logprob`, or a bare float)."""
    if token not in step:
        raise RuntimeError(f"vLLM's logprobs for a position do not include the sampled token {token}")
    value = step[token]
    return float(getattr(value, "logprob", value))
