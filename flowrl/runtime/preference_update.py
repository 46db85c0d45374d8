"""A model's update on data rows (flowrl.runtime): `loss = "sft"` on demonstrations, `"dpo"` on preference pairs
for a policy, `"bradley_terry"` on pairs for a reward model — what `ModelWorker.update` hands these losses to.

The update gets the data node's rows (flowrl.runtime.batch.training_batch keeps them; a DPO update also gets its
reference's log-probs, one (2, T) block per pair) and tokenises them with the model's tokenizer and context
(flowrl.runtime.pairs: chosen at row 2i, rejected at 2i + 1), as `logprobs` and `score` do over the same data,
so the reference's rows line up with the update's. It shuffles by pair (a pair's two rows stay together), runs
epochs x mini-batches of `TrainEngine.step` with the micro losses of flowrl.runtime.preference (`micro_batch`
counts rows, rounded to whole pairs). `evaluate` scores held-out rows (`held_out` on the data; the controller
calls the worker's `evaluate` after the update): `eval_accuracy` for a reward model, `eval/rewards/accuracies`
and `eval/loss` for DPO, `eval/sft_loss` (the mean NLL of the held-out responses' tokens) for SFT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.algos.preference import bradley_terry_loss, dpo_loss, sequence_logp
from flowrl.engines.forward import forward_logprobs
from flowrl.engines.training import all_reduce_sum, data_parallel_world
from flowrl.ir.attrs import ForwardAttrs, UpdateAttrs
from flowrl.ir.signatures import POLICY_UPDATE, REWARD_UPDATE
from flowrl.models.tokenizer import Tokenizer
from flowrl.runtime.batch import Batch
from flowrl.runtime.pairs import demo_batch, pair_batch
from flowrl.runtime.preference import dpo_micro_loss, pair_scores, reward_micro_loss, sft_micro_loss
from flowrl.runtime.schedule import Turn, mean_step_metrics

__all__ = ["EVAL_LOGITS", "EVAL_REF", "EVAL_ROWS", "PairUpdate", "eval_rows", "evaluate", "fit_width",
           "held_out_forward", "is_data_batch", "pair_order", "rows_batch", "token_rows", "update_on_rows"]

PAIR_LOSSES = ("dpo", "bradley_terry")
EVAL_REF = "eval_ref_logp"  # `evaluate`'s attrs key: the reference's (2E, T) log-probs of the held-out rows
EVAL_LOGITS = 1 << 25  # logits a held-out forward holds at most (128 MB in fp32) when the update sets no micro_batch
EVAL_ROWS = 16  # token rows the reference's forward over held-out rows reads when it sets no `micro_batch`
_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def is_data_batch(batch: Batch) -> bool:
    """A data node's batch (rows, no tokens yet), not a rollout."""
    return "response_ids" not in batch.tensors and "row" in batch.meta


def rows_batch(rows: Sequence[Mapping[str, Any]]) -> Batch:
    return Batch(len(rows), {}, {"prompt": [str(r.get("prompt", "")) for r in rows], "row": list(rows)})


def token_rows(batch: Batch, tokenizer: Tokenizer, context: int) -> Batch:
    """A data batch as token rows: preference rows (prompt/chosen/rejected) as 2B pair rows, demonstrations
    (prompt/response) as B rows."""
    rows: list[Mapping[str, Any]] = batch.meta["row"]
    if all("chosen" in r and "rejected" in r for r in rows):
        return pair_batch(batch, tokenizer, context)
    if all("response" in r for r in rows):
        return demo_batch(batch, tokenizer, context)
    keys = sorted(set().union(*(r.keys() for r in rows))) if rows else []
    raise ValueError(f"data rows need `prompt`, `chosen`, `rejected` (preference pairs) or `prompt`, `response` "
                     f"(demonstrations); these have {', '.join(keys) or 'no columns'}")


def fit_width(t: Tensor, width: int) -> Tensor:
    """(R, T) -> (R, width): responses are right-padded, so their tokens sit in the first columns whatever the
    padding; cut the rest or pad with zeros (a forward over another split of the rows padded them wider)."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.cat([t, t.new_zeros(t.shape[0], width - t.shape[1])], dim=1)


def pair_order(units: int, per: int, *, epochs: int, parts: int, gen: torch.Generator) -> list[list[list[int]]]:
    """Row indices of each mini-batch of each epoch: `units` pairs (or demonstrations) of `per` rows each,
    shuffled by unit when there is more than one mini-batch or epoch, so a pair's rows stay together."""
    out = []
    for _ in range(epochs):
        order = torch.randperm(units, generator=gen) if epochs > 1 or parts > 1 else torch.arange(units)
        bounds = [round(i * units / parts) for i in range(parts + 1)]
        out.append([[int(u) * per + k for u in order[a:b].tolist() for k in range(per)]
                    for a, b in zip(bounds, bounds[1:], strict=False) if b > a])
    return out


@dataclass(frozen=True)
class PairUpdate:
    """What one update on rows needs from the worker: the model to train (a value model for bradley_terry),
    its tokenizer and context, and its device."""

    module: nn.Module
    tokenizer: Tokenizer
    context: int
    device: torch.device


def _param(attrs: Mapping[str, Any], name: str, loss: str) -> Any:
    sig = REWARD_UPDATE if loss == "bradley_terry" else POLICY_UPDATE
    value = attrs.get(name)
    if value is None:
        p = sig.param(name)
        value = p.default if p is not None else None
    return value


def _global(values: list[float], device: torch.device) -> list[float]:
    """Sums over the data-parallel ranks (a mini-batch's pairs or tokens), else the values."""
    if data_parallel_world() > 1:
        summed = all_reduce_sum(values, device)
        return [float(v) for v in summed]
    return values


def update_on_rows(job: PairUpdate, engine: Any, batch: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                   turn: Turn | None = None, model: str = "") -> dict[str, float]:
    """One `update` node on a data batch (see the module docstring); returns the mean metrics of its optimizer
    steps, plus the held-out evaluation's when `attrs` carries held-out rows."""
    a = UpdateAttrs.of(attrs)
    loss = str(attrs.get("loss"))
    rows = token_rows(batch, job.tokenizer, job.context)
    per = 2 if loss in PAIR_LOSSES else 1
    if per == 2 and "pair_side" not in rows.tensors:
        raise ValueError(f"loss \"{loss}\" trains on preference pairs (prompt/chosen/rejected), got demonstrations")
    if per == 1 and "pair_side" in rows.tensors:
        raise ValueError("loss \"sft\" trains on demonstrations (prompt/response), got preference pairs")
    width = rows["response_ids"].shape[1]
    if "ref_logp" in batch.tensors:  # (B, 2, T'): one block per pair -> (2B, T) on the update's rows
        ref = batch["ref_logp"]
        rows.tensors["ref_logp"] = fit_width(ref.reshape(rows.size, ref.shape[-1]), width)
    share = a.prefix_min_len if a.share_prefix else 0
    micro_rows = per * max(1, round(a.micro_batch / per)) if a.micro_batch > 0 else 0  # whole pairs
    gen = torch.Generator().manual_seed(step_seed)
    minis = (rows.select(index) for epoch in pair_order(batch.size, per, epochs=a.epochs,
                                                        parts=max(1, a.mini_batches), gen=gen) for index in epoch)
    return mean_step_metrics(engine, ((mini.chunks(micro_rows), _micro_loss(job, loss, mini, attrs, share))
                                      for mini in minis), turn, model)


def _micro_loss(job: PairUpdate, loss: str, mini: Batch, attrs: Mapping[str, Any],
                share: int) -> Callable[[Batch], tuple[Tensor, dict[str, Any]]]:
    if loss == "sft":
        (tokens,) = _global([float(mini["response_mask"].sum())], job.device)
        return partial(_sft, job.module, num_tokens=tokens)
    (pairs,) = _global([float(mini.size // 2)], job.device)
    if loss == "bradley_terry":
        return partial(_rm, job.module, num_pairs=int(pairs), margin=float(_param(attrs, "margin", loss)),
                       share=share)
    kind = str(_param(attrs, "dpo", loss))
    return partial(_dpo, job.module, num_pairs=int(pairs), beta=float(_param(attrs, "beta", loss)), kind=kind,
                   label_smoothing=float(_param(attrs, "label_smoothing", loss)),
                   gamma=float(_param(attrs, "gamma", loss)), share=share)


def _sft(module: nn.Module, mb: Batch, *, num_tokens: float) -> tuple[Tensor, dict[str, float]]:
    return sft_micro_loss(module, mb, num_tokens=num_tokens)


def _rm(module: nn.Module, mb: Batch, *, num_pairs: int, margin: float,
        share: int) -> tuple[Tensor, dict[str, float]]:
    return reward_micro_loss(module, mb, num_pairs=num_pairs, margin=margin, share=share)


def _dpo(module: nn.Module, mb: Batch, *, num_pairs: int, beta: float, kind: str, label_smoothing: float,
         gamma: float, share: int) -> tuple[Tensor, dict[str, Any]]:
    ref = mb["ref_logp"] if "ref_logp" in mb.tensors else None
    if ref is None and kind != "simpo":
        raise ValueError(f"dpo = \"{kind}\" needs the reference's log-probs (ref_logp)")
    return dpo_micro_loss(module, mb, num_pairs=num_pairs, ref_logp=ref, beta=beta, kind=kind,
                          label_smoothing=label_smoothing, gamma=gamma, share=share)


def eval_rows(attrs: Mapping[str, Any], per: int, job: PairUpdate) -> int:
    """Token rows a held-out forward reads: the update's `micro_batch` (a training micro-batch, which keeps its
    activations for the backward too, fits it), else as many as keep the forward's logits within `EVAL_LOGITS`
    values (rows x the model's context x its vocabulary: a tiny model's 200 pairs in one forward, a 128k
    vocabulary's one pair at a time); whole pairs (`per` rows each)."""
    micro = UpdateAttrs.of(attrs).micro_batch
    if micro <= 0:
        # the model's own vocabulary (its LM head's width: a checkpoint's may pass its tokenizer's)
        vocab = max(int(getattr(getattr(job.module, "config", None), "vocab_size", 0) or 0),
                    int(getattr(job.tokenizer, "vocab_size", 0) or 0), 1)
        micro = EVAL_LOGITS // max(1, job.context * vocab)
    return per * max(1, micro // per)


def held_out_forward(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A forward node's attrs for running over held-out rows (the reference's log-probs of them, once while it is
    frozen): its own `micro_batch`, or `EVAL_ROWS` rows a forward when it has none (all rows at once: memory
    growing with the held-out set)."""
    micro = ForwardAttrs.of(attrs).micro_batch
    return {**attrs, "micro_batch": micro if micro > 0 else EVAL_ROWS}


def evaluate(job: PairUpdate, held: Batch, attrs: Mapping[str, Any]) -> dict[str, float]:
    """The held-out rows `held` (data rows) scored after an update with `attrs`: a reward model's accuracy
    (chosen scored above rejected) and loss, DPO's loss and implicit-reward accuracy against the reference's
    log-probs of the same rows (`attrs[EVAL_REF]`, (2E, T)), or SFT's loss on held-out demonstrations (their
    response tokens' mean NLL, every token weighing alike, as the update's `sft_loss`).

    The rows are tokenised and run `eval_rows` at a time, keeping one number per row (a score, a sequence
    log-prob) and for SFT two sums: memory is one bounded forward's whatever the held-out set's size (a
    full-vocabulary forward over 2,000 pairs at once is hundreds of GB), and the metrics those of one forward
    over all of them."""
    loss = str(attrs.get("loss"))
    if loss not in (*PAIR_LOSSES, "sft"):
        return {}
    per = 2 if loss in PAIR_LOSSES else 1
    kind = str(_param(attrs, "dpo", loss)) if loss == "dpo" else ""
    ref = attrs.get(EVAL_REF)
    if loss == "dpo" and kind != "simpo" and ref is None:
        return {}
    ref_all = torch.as_tensor(ref) if ref is not None and kind != "simpo" else None  # (2E, T)
    mean = kind in ("ipo", "simpo")  # length-normalised, as the update (flowrl.runtime.preference)
    # one number per token row, written in place: nothing a part keeps is left between the next parts' buffers
    seq = torch.zeros(held.size * per)  # (2E,) scores, or sequence log-probs
    ref_seq = torch.zeros(held.size * per) if ref_all is not None else None  # (2E,) the reference's
    nll = tokens = 0.0
    first, units = 0, eval_rows(attrs, per, job) // per
    with torch.no_grad():
        for start in range(0, held.size, units):
            rows = token_rows(held.slice(start, start + units), job.tokenizer, job.context)
            if ("pair_side" in rows.tensors) != (per == 2):
                raise ValueError("loss \"sft\" evaluates demonstrations (prompt/response), got preference pairs"
                                 if per == 1 else f"loss \"{loss}\" evaluates preference pairs, got demonstrations")
            here = slice(first, first + rows.size)
            if loss == "sft":
                value, _ = sft_micro_loss(job.module, rows, num_tokens=1.0)  # (the NLL's sum)
                nll, tokens = nll + float(value), tokens + float(rows["response_mask"].sum())
            elif loss == "bradley_terry":
                seq[here] = pair_scores(job.module, rows).cpu()  # (2b,)
            else:
                inputs = [rows[k].to(job.device) for k in _INPUTS]
                seq[here] = sequence_logp(forward_logprobs(job.module, *inputs), inputs[3], mean=mean).cpu()
                if ref_seq is not None and ref_all is not None:
                    mask = rows["response_mask"]
                    ref_seq[here] = sequence_logp(fit_width(ref_all[here], mask.shape[1]), mask, mean=mean)
            first += rows.size
    if loss == "sft":
        return {"eval/sft_loss": nll / max(tokens, 1.0)}
    if loss == "bradley_terry":
        _, m = bradley_terry_loss(seq[0::2], seq[1::2], margin=float(_param(attrs, "margin", loss)))
        return {"eval_accuracy": m["accuracy"], "eval_loss": m["loss"]}
    _, m = dpo_loss(seq[0::2], seq[1::2], None if ref_seq is None else ref_seq[0::2],
                    None if ref_seq is None else ref_seq[1::2], beta=float(_param(attrs, "beta", loss)), kind=kind,
                    label_smoothing=float(_param(attrs, "label_smoothing", loss)),
                    gamma=float(_param(attrs, "gamma", loss)))
    return {"eval/loss": m["loss"], "eval/rewards/accuracies": m["rewards/accuracies"],
            "eval/rewards/margins": m["rewards/margins"]}
