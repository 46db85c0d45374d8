"""Typed node attributes (flowrl.ir): a frozen record per kind of call, built from a node's `attrs` mapping.

The graph keeps attributes as a plain mapping (what `flowrl compile` prints and what crosses to the workers);
the code that reads them builds one of these records once per call instead of `attrs.get(key, default)` at
each use. Each key has one default: its parameter's in `flowrl.ir.signatures` (the method's signature), or
`PASS_KEYS` for the keys the passes add. Keys a record does not know are ignored (the fusion bookkeeping is
read where it is used)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from flowrl.ir.graph import Value
from flowrl.ir.signatures import GENERATE, PASS_KEYS, POLICY_UPDATE, Signature

R = TypeVar("R", bound="_Record")


def default(sig: Signature, key: str) -> Any:
    """The default of parameter `key` of `sig`."""
    param = sig.param(key)
    if param is None:
        raise KeyError(f"{sig.name} has no parameter {key!r}")
    return param.default


def _convert(value: Value, like: Any) -> Any:
    if value is None:
        return None
    if isinstance(like, bool):
        return bool(value)
    if isinstance(like, int):
        return int(value) if isinstance(value, (int, float)) else int(str(value))
    if isinstance(like, float):
        return float(value) if isinstance(value, (int, float)) else float(str(value))
    if isinstance(like, str):
        return str(value)
    return value


@dataclass(frozen=True)
class _Record:
    @classmethod
    def of(cls: type[R], attrs: Mapping[str, Any]) -> R:
        """The record of `attrs` (a node's attributes, or the mapping a worker method received)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in attrs and attrs[f.name] is not None:
                values[f.name] = _convert(attrs[f.name], f.default)
        return cls(**values)


@dataclass(frozen=True)
class Prefix(_Record):
    """share-prefix's keys, on every model call it marks."""

    share_prefix: bool = bool(PASS_KEYS["share_prefix"])
    prefix_min_len: int = int(str(PASS_KEYS["prefix_min_len"]))


@dataclass(frozen=True)
class GenerateAttrs(Prefix):
    n: int = int(default(GENERATE, "n"))
    max_tokens: int = int(default(GENERATE, "max_tokens"))
    min_tokens: int = int(default(GENERATE, "min_tokens"))
    temperature: float = float(default(GENERATE, "temperature"))
    top_p: float = float(default(GENERATE, "top_p"))
    stream_chunk: int = int(str(PASS_KEYS["stream_chunk"]))
    flush_steps: int = int(str(PASS_KEYS["flush_steps"]))
    partial_below: float = float(str(PASS_KEYS["partial_below"]))
    chunk_forwards: str = str(PASS_KEYS["chunk_forwards"])
    migrate_below: float = float(str(PASS_KEYS["migrate_below"]))


@dataclass(frozen=True)
class ForwardAttrs(Prefix):
    """logprobs / values / score."""

    micro_batch: int = int(default(POLICY_UPDATE, "micro_batch"))  # rows per forward chunk (0: all at once)


@dataclass(frozen=True)
class UpdateAttrs(Prefix):
    """A policy's or a critic's update (a critic's `clip` is its value clipping, with the same default)."""

    epochs: int = int(default(POLICY_UPDATE, "epochs"))
    mini_batches: int = int(default(POLICY_UPDATE, "mini_batches"))
    micro_batch: int = int(default(POLICY_UPDATE, "micro_batch"))
    max_grad_norm: float = float(default(POLICY_UPDATE, "max_grad_norm"))
    agg: str = str(default(POLICY_UPDATE, "agg"))
    clip: float = float(default(POLICY_UPDATE, "clip"))
    clip_high: float | None = default(POLICY_UPDATE, "clip_high")
    dual_clip: float | None = default(POLICY_UPDATE, "dual_clip")
    kl_coef: float = float(default(POLICY_UPDATE, "kl_coef"))
    kl: str = str(default(POLICY_UPDATE, "kl"))
    entropy_coef: float = float(default(POLICY_UPDATE, "entropy_coef"))
    is_correction: str = str(default(POLICY_UPDATE, "is_correction"))
    is_cap: float = float(default(POLICY_UPDATE, "is_cap"))
    lr: float = float(default(POLICY_UPDATE, "lr"))  # 0: the model's own
    loss: str = str(default(POLICY_UPDATE, "loss"))  # a policy's rollout loss: ppo_clip or cispo (a critic's: value)
    ratio: str = str(default(POLICY_UPDATE, "ratio"))  # "token", or "sequence" (GSPO)
    loss_scale_factor: int = int(str(default(POLICY_UPDATE, "loss_scale_factor")))  # 0: the response width

    @property
    def correction(self) -> str:
        """The off-policy correction in force: "auto" (left for pass async-rollout to decide) is "none"."""
        return "none" if self.is_correction == "auto" else self.is_correction

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> UpdateAttrs:
        record = super().of(attrs)
        # clip_high and dual_clip default to None (off): `_convert` has no type to go by for them
        high, dual = attrs.get("clip_high"), attrs.get("dual_clip")
        return UpdateAttrs(**{**record.__dict__, "clip_high": float(str(high)) if high is not None else None,
                              "dual_clip": float(str(dual)) if dual is not None else None})
