"""`Batch`: the data that moves between graph nodes — named tensors sharing a sample dimension plus
per-sample metadata (prompt text, response text, the data row, prompt id). The controller moves batches
between worker groups without looking inside their tensors.

Public as `flowrl.Batch` / `flowrl.runtime.Batch`: a user step function (`@flowrl.function`) takes one per node
parameter and returns one (docs/language.md, "User functions").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Tensors carried from a rollout into every batch derived from it, so step functions have masks and groups,
# and, for a rollout generated with an environment, its turns (the advantage ops read them off `scores`).
CARRIED = ("response_mask", "group_id", "loss_mask", "turn_index", "turn_rewards", "env_return")


@dataclass
class Batch:
    """`size` samples: `tensors` maps names to tensors whose first dimension is the sample (`(B,)` per
    sample, `(B, T)` per response token), `meta` maps names to per-sample Python lists (`prompt`, `response`,
    `row`: the data set's row, `prompt_id`), and `primary` names the tensor a consumer of this node reads
    (a `logprobs` node's `logp`, a reward's `scores`, an advantage's `advantages`).
    `tensors[k].shape[0] == size` and `len(meta[k]) == size` for every key (checked when built).

    Build a node's result with `derive` from one of its inputs (it keeps the samples' `response_mask`,
    `group_id` and meta), or directly: `Batch(n, {"scores": t}, primary="scores")`."""

    size: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    primary: str | None = None  # the field a consumer gets when it asks for this node's value

    def __post_init__(self) -> None:
        for k, t in self.tensors.items():
            if t.shape[0] != self.size:
                raise ValueError(f"tensor {k!r} has {t.shape[0]} rows, batch has {self.size}")
        for k, v in self.meta.items():
            if len(v) != self.size:
                raise ValueError(f"meta {k!r} has {len(v)} entries, batch has {self.size}")

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def value(self, want: str | None = None) -> torch.Tensor:
        """The tensor named `want` if present, else this batch's primary tensor."""
        if want is not None and want in self.tensors:
            return self.tensors[want]
        if self.primary is None:
            raise KeyError(f"batch has no field {want!r} and no primary field (fields: {sorted(self.tensors)})")
        return self.tensors[self.primary]

    def derive(self, primary: str, **tensors: torch.Tensor) -> Batch:
        """A new batch over the same samples: the carried tensors and meta, plus `tensors`."""
        kept = {k: self.tensors[k] for k in CARRIED if k in self.tensors}
        return Batch(self.size, {**kept, **tensors}, dict(self.meta), primary)

    def select(self, index: Sequence[int] | torch.Tensor) -> Batch:
        """The samples at `index` (positions, in that order; repeats allowed), every field kept."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return Batch(
            len(rows),
            {k: t.index_select(0, idx) for k, t in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
            self.primary,
        )

    def slice(self, start: int, stop: int) -> Batch:
        """Samples `start` to `stop` (exclusive), every field kept."""
        return Batch(
            max(0, min(stop, self.size) - start),
            {k: t[start:stop] for k, t in self.tensors.items()},
            {k: v[start:stop] for k, v in self.meta.items()},
            self.primary,
        )

    def chunks(self, rows: int) -> list[Batch]:
        """Contiguous pieces of at most `rows` samples (rows <= 0 means one piece)."""
        if rows <= 0 or rows >= self.size:
            return [self]
        return [self.slice(i, i + rows) for i in range(0, self.size, rows)]

    def split(self, parts: int) -> list[Batch]:
        """`parts` contiguous pieces as equal as possible (data-parallel split); empty pieces dropped."""
        bounds = [round(i * self.size / parts) for i in range(parts + 1)]
        return [self.slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def merge(self, other: Batch, rename: dict[str, str] | None = None) -> Batch:
        """Fields of `other` added to this batch (same samples), optionally renamed."""
        if other.size != self.size:
            raise ValueError(f"cannot merge batches of {self.size} and {other.size} samples")
        extra = {(rename or {}).get(k, k): t for k, t in other.tensors.items()}
        return Batch(self.size, {**self.tensors, **extra}, {**other.meta, **self.meta}, self.primary)

    @staticmethod
    def concat(batches: Sequence[Batch], fill: Mapping[str, int] | None = None) -> Batch:
        """Samples of all batches, in order. Tensors with a second dimension are padded to the widest: on the
        right, except `prompt_*` tensors (left-padded prompts), with `fill[key]` (token ids: the pad id) or 0."""
        if len(batches) == 1:
            return batches[0]
        keys = list(batches[0].tensors)
        fill = fill or {}
        tensors = {k: _cat([b.tensors[k] for b in batches], left=k.startswith("prompt_"), fill=fill.get(k, 0))
                   for k in keys}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(sum(b.size for b in batches), tensors, meta, batches[0].primary)

    def nbytes(self) -> int:
        """Bytes held by the tensors (meta not counted)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _cat(parts: list[torch.Tensor], left: bool, fill: int = 0) -> torch.Tensor:
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    padded = []
    for p in parts:
        gap = width - p.shape[1]
        if gap:
            pad = p.new_full((p.shape[0], gap, *p.shape[2:]), fill)
            p = torch.cat([pad, p] if left else [p, pad], dim=1)
        padded.append(p)
    return torch.cat(padded)


# Update inputs: parameter name -> the field of its batch that it becomes in the training batch.
UPDATE_FIELDS = {"old_logp": "logp", "ref_logp": "logp", "advantages": "advantages", "returns": "returns",
                 "values": "values"}


def training_batch(inputs: Mapping[str, Batch], *, mask_truncated: bool = False) -> Batch:
    """An update node's inputs as one batch: the rollout's fields the update reads, and each other input under
    its parameter name (its value field: `old_logp` is a log-prob forward's `logp`, ...). A data node's batch (no
    response tensors: sft, dpo, bradley_terry) keeps its rows for the worker to tokenise; an input with two rows
    per data row (a forward over preference pairs: chosen at 2i, rejected at 2i + 1) comes as one (2, ...) block
    per pair, so shuffling and splitting the rows keeps each pair's two rows with it. `mask_truncated` (DAPO's
    overlong filtering): the responses the rollout marks `truncated` (cut at max_tokens without EOS) get a
    `loss_mask` of 0, so the loss, its denominators and its metrics leave them out."""
    rollout = inputs["rollout"]
    if "response_ids" not in rollout.tensors:
        return _rows_batch(rollout, {k: v for k, v in inputs.items() if k != "rollout"})
    tensors: dict[str, torch.Tensor] = {k: rollout[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                        "temperature", "group_id", "gen_logp", "loss_mask") if k in rollout.tensors}
    for param, batch in inputs.items():
        if param == "rollout":
            continue
        tensors[param] = batch.value(param if param in batch.tensors else UPDATE_FIELDS.get(param))
    if mask_truncated and "truncated" in rollout.tensors:
        trained = tensors.get("loss_mask", tensors["response_mask"])  # (B, T)
        tensors["loss_mask"] = trained * (~rollout["truncated"].bool()).to(trained.dtype)[:, None]
    return Batch(rollout.size, tensors, {}, None)


def _rows_batch(data: Batch, others: Mapping[str, Batch]) -> Batch:
    tensors: dict[str, torch.Tensor] = {}
    for param, batch in others.items():
        t = batch.value(param if param in batch.tensors else UPDATE_FIELDS.get(param))
        if t.shape[0] == 2 * data.size:
            t = t.reshape(data.size, 2, *t.shape[1:])  # (B, 2, ...): pair i's chosen and rejected rows
        elif t.shape[0] != data.size:
            raise ValueError(f"`{param}` has {t.shape[0]} rows for {data.size} data rows (expected one or two per row)")
        tensors[param] = t
    meta: dict[str, list[Any]] = {k: list(data.meta[k]) for k in ("prompt", "row", "prompt_id") if k in data.meta}
    return Batch(data.size, tensors, meta, None)
