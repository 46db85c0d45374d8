"""flowrl's attention for Hugging Face models (flowrl.models): SDPA, plus two decoding paths.

Models flowrl builds with SDPA use `NAME`. Everything but a one-query step (prefill, training) is HF's own
SDPA function unchanged. A decode step has one query per row and reads the whole KV cache, so it is bound by
memory traffic, and two things make it cheaper:

- Shared prompts (cascade attention). When the n samples of a prompt decode from one prefilled prompt
  (generation with share-prefix), the cache keeps the prompt's keys and values once (`SharedPrefix`) and only
  each sample's own tokens per row. The n queries of a prompt are scored against its prefix in one matmul and
  against their own tokens separately; one softmax over both gives exactly full attention, while the prompt's
  KV is read once instead of n times (and never copied n times).
- On CPU, `q @ k^T -> softmax -> @ v` instead of SDPA's flash kernel, which costs about 3x as much for one
  query (128 rows x 4 heads x 166 keys x 32 dims: 2.0 ms against 0.68 ms).

Masks are SDPA's: boolean (True = attend) or additive floats, over [prefix | own tokens].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NAME", "SharedPrefix", "attention", "install", "reads_shared_prefix"]

NAME = "flowrl_sdpa"
_registered = False


@dataclass(frozen=True)
class SharedPrefix:
    """Prompt keys/values kept once, and which prompt each live decode row continues."""

    keys: Tensor  # (U, kv_heads, P, d)
    values: Tensor  # (U, kv_heads, P, d)
    owner: Tensor  # (N,) the prompt row of each decode row
    width: int  # grid width: decode rows of one prompt sit in one grid row of `width` slots
    slots: Tensor | None = None  # (N,) slot of each row in the (U * width) grid; None: row r is slot r

    @staticmethod
    def grouped(keys: Tensor, values: Tensor, n: int) -> SharedPrefix:
        """Rows 0..n-1 continue prompt 0, rows n..2n-1 prompt 1, ... (what repeat_interleave(n) lays out)."""
        owner = torch.arange(keys.shape[0], device=keys.device).repeat_interleave(n)
        return SharedPrefix(keys, values, owner, n)

    def select(self, rows: Tensor) -> SharedPrefix:
        """The prefix for decode rows `rows` only (finished rows dropped): the prompt KV itself is not touched."""
        owner = self.owner[rows]
        order = torch.argsort(owner, stable=True)
        ranked = owner[order]
        rank = torch.empty_like(owner)
        rank[order] = torch.arange(len(owner), device=owner.device) - torch.searchsorted(ranked, ranked)
        width = int(rank.max()) + 1 if len(owner) else 1
        return SharedPrefix(self.keys, self.values, owner, width, owner * width + rank)

    def rows(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Materialised (len(rows), kv_heads, P, d) keys and values of decode rows `rows`."""
        return self.keys[self.owner[rows]], self.values[self.owner[rows]]


def _grid(x: Tensor, prefix: SharedPrefix) -> Tensor:
    """(N, ...) rows -> (U, width, ...) grid (zeros in empty slots)."""
    units = prefix.keys.shape[0]
    if prefix.slots is None:
        return x.reshape(units, prefix.width, *x.shape[1:])
    grid = x.new_zeros((units * prefix.width, *x.shape[1:]))
    grid[prefix.slots] = x
    return grid.view(units, prefix.width, *x.shape[1:])


def _ungrid(grid: Tensor, prefix: SharedPrefix) -> Tensor:
    """(U, width, ...) grid -> (N, ...) rows."""
    flat = grid.reshape(-1, *grid.shape[2:])
    return flat if prefix.slots is None else flat[prefix.slots]


def _cascade(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
             prefix: SharedPrefix, scale: float) -> Tensor:
    """One-query attention over [prompt prefix (once per prompt) | each row's own tokens] -> (N, 1, heads, d)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = int(getattr(module, "num_key_value_groups", 1))
    pk, pv = prefix.keys, prefix.values
    if groups > 1:
        pk, pv, key, value = (repeat_kv(x, groups) for x in (pk, pv, key, value))
    length = pk.shape[2]
    q = query[:, :, 0]  # (N, heads, d)
    qg = _grid(q, prefix).transpose(1, 2)  # (U, heads, width, d)
    on_prefix = _ungrid(torch.matmul(qg, pk.transpose(-1, -2)).transpose(1, 2), prefix)  # (N, heads, P)
    on_own = torch.matmul(query, key.transpose(-1, -2))[:, :, 0]  # (N, heads, S)
    scores = torch.cat([on_prefix, on_own], dim=-1) * scale  # (N, heads, P + S)
    if mask is not None:
        m = mask[:, :, -1, -scores.shape[-1]:]  # (N, 1, P + S)
        scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min) if m.dtype == torch.bool else scores + m
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    pg = _grid(probs[..., :length], prefix).transpose(1, 2)  # (U, heads, width, P)
    out = _ungrid(torch.matmul(pg, pv).transpose(1, 2), prefix)  # (N, heads, d)
    out = out + torch.matmul(probs[..., length:, None].transpose(-1, -2), value)[:, :, 0]
    return out[:, None]  # (N, 1, heads, d)


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
              **kwargs: Any) -> tuple[Tensor, None]:
    """HF's attention-function signature: query (b, heads, q, d), key/value (b, kv_heads, k, d) -> (b, q, heads, d)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix: SharedPrefix | None = getattr(key, "flowrl_prefix", None)  # set by the generation engine's cache
    if prefix is not None:
        if query.shape[2] == 1 and not (dropout and module.training):
            return _cascade(module, query, key, value, attention_mask, prefix, scale), None
        rows = torch.arange(key.shape[0], device=key.device)
        pk, pv = prefix.rows(rows)
        key, value = torch.cat([pk, key], dim=2), torch.cat([pv, value], dim=2)
    one_query = query.shape[2] == 1 and query.device.type == "cpu"
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        one_query = False  # not the plain cache layout this path assumes: HF's SDPA decides
    if not one_query or (dropout and module.training) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (b, heads, 1, k)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def install(model: nn.Module) -> None:
    """Switch an SDPA model (and its submodules' configs) to `NAME`; other implementations are left alone."""
    global _registered
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not _registered:
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        try:
            model.set_attn_implementation(NAME)  # type: ignore[operator]
        except (ValueError, AttributeError, NotImplementedError):
            pass  # a model that cannot switch keeps HF's SDPA: correct, only without the faster decode


# Architectures whose attention layers hand the cache's keys to the attention function unchanged (checked
# for GPT-2 and Llama by tests/models/test_attention.py; Qwen2/3 and Mistral share Llama's attention code).
# Elsewhere the prompt KV is copied per sample, as plain HF caching does.
CASCADE_MODELS = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3"})


def reads_shared_prefix(module: nn.Module) -> bool:
    """Whether `module`'s attention is `NAME` on an architecture that passes a `SharedPrefix` through."""
    lm: Any = getattr(module, "backbone", module)
    config = getattr(lm, "config", None)
    return getattr(config, "_attn_implementation", None) == NAME and getattr(config, "model_type", "") in CASCADE_MODELS
