"""The torch training engine (flowrl.engines): AdamW with gradient accumulation over micro-batches.

One `step` is one optimizer update on one mini-batch: the loss function is called per micro-batch and is
responsible for scaling, so that the micro-batch losses sum to the mini-batch loss (the engine never divides).
Gradients are clipped by global norm before the update; a non-finite norm skips the update (verl does the same)
rather than writing NaNs into the weights.

Data parallel (the ray backend's SPMD ranks): when `torch.distributed` is initialised with more than one rank,
gradients are SUM-all-reduced before clipping. The loss function must then scale by the denominators of the
global mini-batch (`all_reduce_sum` gives them), so the summed gradient equals the one-rank gradient.
With one rank nothing of this runs and the update is bit-identical to the plain path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["SHARES", "AdamWEngine", "AdamWOptions", "LossFn", "TrainEngine", "accumulate", "all_reduce_sum",
           "data_parallel_world", "merge_ranks", "reduce_metrics"]

MB = TypeVar("MB")
LossFn = Callable[[MB], tuple[Tensor, dict[str, float]]]

# Metrics a loss function computes with the whole mini-batch's denominators (like the loss itself): each
# micro-batch's (and each data-parallel rank's) value is its share of the whole, so they add up. Every other
# metric is a per-micro-batch mean (clipfrac, ppo_kl, ...) and is averaged.
SHARES = frozenset({"loss", "pg_loss", "kl_loss", "entropy", "vf_loss", "kl_mean",
                    # the supervised and preference losses' (flowrl.runtime.preference)
                    "sft_loss", "rm_loss", "rm_accuracy", "rm_margin", "dpo_loss", "rewards/chosen",
                    "rewards/rejected", "rewards/accuracies", "rewards/margins"})


def reduce_metrics(per_micro_batch: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One mini-batch's metrics from its micro-batches': shares summed, the rest averaged."""
    keys = {k: None for m in per_micro_batch for k in m}
    return {k: sum(float(m.get(k, 0.0)) for m in per_micro_batch) / (1 if k in SHARES else len(per_micro_batch))
            for k in keys}


def accumulate(micro_batches: Sequence[MB], loss_fn: LossFn[MB],
               backward: Callable[[Tensor], None]) -> tuple[float, list[dict[str, float]]]:
    """Run `loss_fn` and `backward` on each micro-batch: (the summed loss, each micro-batch's metrics). The loss
    function already scales (micro losses sum to the mini-batch loss), so nothing is divided here."""
    total = 0.0
    seen: list[dict[str, float]] = []
    for mb in micro_batches:
        loss, metrics = loss_fn(mb)
        backward(loss)
        total += float(loss.detach())
        seen.append(metrics)
    return total, seen


def merge_ranks(results: Sequence[Mapping[str, float]], tokens: Sequence[float]) -> dict[str, float]:
    """One update's metrics from its data-parallel ranks': shares summed, the rest (per-rank means, or equal on
    every rank after the all-reduce) averaged, weighted by each rank's valid tokens."""
    total = sum(tokens) or 1.0
    return {key: sum(float(r[key]) for r in results) if key in SHARES else
            sum(float(r[key]) * t for r, t in zip(results, tokens, strict=True)) / total for key in results[0]}


class AdamWOptions(TypedDict, total=False):
    """The optimizer keywords of a training engine (`AdamWEngine`): AdamW's and the clipping bound."""

    weight_decay: float
    betas: tuple[float, float]
    eps: float
    max_grad_norm: float | None


class AdamWEngine:
    """The AdamW optimizer of one trainable module, what a caller sets between steps (learning rate, clipping
    bound) and the metrics a step returns: shared by `TrainEngine` and `DeepSpeedTrainEngine` (whose ZeRO steps
    the same client AdamW, so lr lives in its param groups at every stage)."""

    def __init__(self, module: nn.Module, *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float | None = 1.0) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{type(self).__name__}: the module has no trainable parameters (is it a frozen "
                             "reference?)")
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.steps = 0  # optimizer steps taken (skipped ones not counted)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every param group (schedules live outside the engine)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_max_grad_norm(self, bound: float | None) -> None:
        """Clip the gradient norm to `bound` from the next step on (None or <= 0: measure it only)."""
        self.max_grad_norm = bound

    def accumulate_all(self, micro_batches: Sequence[MB], loss_fn: LossFn[MB],
                   backward: Callable[[Tensor], None]) -> tuple[float, list[dict[str, float]]]:
        """`accumulate` for this engine's `step`, which needs at least one micro-batch."""
        if not micro_batches:
            raise ValueError(f"{type(self).__name__}.step needs at least one micro-batch")
        return accumulate(micro_batches, loss_fn, backward)

    def step_metrics(self, seen: Sequence[Mapping[str, float]], loss: float, grad_norm: float,
                     skipped: bool) -> dict[str, float]:
        """What `step` returns: the micro-batches' metrics (`reduce_metrics`) and loss, grad_norm, lr, skipped."""
        out = reduce_metrics(seen)
        out.update(loss=loss, grad_norm=grad_norm, lr=self.lr, skipped=float(skipped))
        return out


class TrainEngine(AdamWEngine):
    """Owns the optimizer of one trainable module (policy or critic); built as `AdamWEngine`."""

    def step(self, micro_batches: Sequence[MB], loss_fn: LossFn[MB]) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, clip, update; returns `step_metrics`."""
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, seen = self.accumulate_all(micro_batches, loss_fn, lambda loss: loss.backward())
        if data_parallel_world() > 1:
            self._all_reduce_grads()
        # clip_grad_norm_ with an infinite bound only measures the norm.
        bound = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, bound))
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return self.step_metrics(seen, total_loss, grad_norm, skipped)

    # ---- data parallel (only with torch.distributed initialised and world > 1) ----------------------
    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks in one flat buffer (a missing grad counts as zeros, so every rank sends
        the same layout). Every rank then clips the same norm and takes the same optimizer step."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    def state_dict(self) -> dict[str, Any]:
        """Module weights, optimizer moments and the step count (everything a checkpoint needs)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", 0))


# ---- data parallel helpers -------------------------------------------------------------------------
def data_parallel_world() -> int:
    """Ranks in the default process group; 1 when torch.distributed is not initialised (local backend)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(values: Sequence[float], device: torch.device | str = "cpu") -> list[float]:
    """`values` summed over the ranks of the default process group (unchanged with one rank)."""
    if data_parallel_world() <= 1:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]
