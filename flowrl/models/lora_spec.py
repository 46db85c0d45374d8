"""A model's LoRA settings (flowrl.models), torch-free: what a declaration's `lora_rank`, `lora_alpha`, `lora_dropout`
and `lora_targets` mean, which modules each architecture adapts by default, and which reference of a graph is a LoRA
policy's base with the adapters off. `flowrl check` and `flowrl compile` read it without importing torch;
flowrl.models.lora builds the adapters with peft.

Defaults are verl's (`lora_alpha = 16`, no dropout); the default targets are the architecture's attention and MLP
projections (GPT-2's `c_attn c_proj c_fc`, Llama's `q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`),
which is what peft's `"all-linear"` picks on these families too (every linear layer but the output head); an
architecture not listed here gets `"all-linear"`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowrl.models.sources import hf_model_type

if TYPE_CHECKING:
    from flowrl.ir.graph import Graph, ModelDecl

__all__ = ["ALL_LINEAR", "FAMILY_TARGETS", "LORA_KEYS", "OUTPUT_HEAD", "TINY_LINEAR", "LoraSpec", "base_of", "family_of",
           "lora_spec", "shares_base", "unmatched_targets"]

LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head
OUTPUT_HEAD = "lm_head"  # a causal LM's output layer: adapted only where a target names it
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.json's model_type -> the attention and MLP projections a LoRA adapts by default
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    **{family: _PROJECTIONS for family in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2")},
}
# The linear layers of the tiny models (flowrl.models.build), by source: what `lora_targets` may name. A test
# keeps them equal to the built models' modules, so `flowrl check` can name them without building one.
TINY_LINEAR: dict[str, tuple[str, ...]] = {"tiny:gpt2": FAMILY_TARGETS["gpt2"], "tiny:llama": _PROJECTIONS}


@dataclass(frozen=True)
class LoraSpec:
    """Adapters of rank `rank` scaled by `alpha / rank` on the modules `targets` names (by the last parts of their
    dotted names, as peft matches them; () = the architecture's default), or on every linear layer but the output
    head (`all_linear`)."""

    rank: int
    alpha: float = 16.0  # = flowrl.ir.signatures.MODEL_KEYS' defaults (the printer imports this module: a test
    dropout: float = 0.0  # keeps them equal)
    targets: tuple[str, ...] = ()
    all_linear: bool = False

    def label(self, family: str | None) -> str:
        """`rank=8, alpha=16.0, dropout=0.0, targets=c_attn c_proj c_fc`, as `flowrl compile` prints it."""
        return (f"rank={self.rank}, alpha={self.alpha!r}, dropout={self.dropout!r}, "
                f"targets={' '.join(self.default_targets(family)) if not self.all_linear else ALL_LINEAR}")

    def default_targets(self, family: str | None) -> tuple[str, ...]:
        """The module names adapted: those written, else the family's projections (() where the family is not
        known: every linear layer, as for `all-linear`)."""
        return self.targets or FAMILY_TARGETS.get(family or "", ())


def lora_spec(options: Mapping[str, object]) -> LoraSpec | None:
    """The LoRA a model's options (its declaration's keys) ask for; None without `lora_rank`."""
    rank = options.get("lora_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        return None
    targets = options.get("lora_targets")
    alpha, dropout = options.get("lora_alpha"), options.get("lora_dropout")
    names = (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets) \
        if isinstance(targets, (tuple, list)) else ()
    return LoraSpec(rank=rank,
                    alpha=float(alpha) if isinstance(alpha, (int, float)) else LoraSpec.alpha,
                    dropout=float(dropout) if isinstance(dropout, (int, float)) else LoraSpec.dropout,
                    targets=() if names == (ALL_LINEAR,) else names, all_linear=names == (ALL_LINEAR,))


def family_of(source: str) -> str | None:
    """A source's architecture family (config.json's model_type for `hf:`), None when it cannot be read."""
    if source.startswith("tiny:"):
        return source.split(":", 1)[1]
    return hf_model_type(source[3:]) if source.startswith("hf:") else None


def unmatched_targets(targets: Sequence[str], modules: Sequence[str]) -> list[str]:
    """The names of `targets` that match none of the (dotted) `modules`: a target matches a module it names whole or
    by its last parts (`c_proj`, `attn.c_proj`), as peft matches a list of names."""
    return [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]


def base_of(model: ModelDecl, models: Mapping[str, ModelDecl]) -> str | None:
    """The LoRA model whose base `model` is: a reference whose `source` names a model with adapters (its weights are
    that model's base with the adapters off); None otherwise."""
    src = models.get(model.source_model or "")
    if model.role != "reference" or src is None or lora_spec(src.options) is None:
        return None
    return src.name


def shares_base(graph: Graph, model: ModelDecl) -> bool:
    """Whether the reference `model` computes with its LoRA source's own weights (adapters switched off): it is, in
    every worker group holding it, beside that model, so one process holds one copy of the base. Elsewhere it gets
    a copy of the base of its own."""
    src = base_of(model, {m.name: m for m in graph.models})
    holding = [g for g in graph.worker_groups if model.name in g.models]
    return src is not None and bool(holding) and all(src in g.models for g in holding)
