"""Built-in step functions (advantage estimators) and reward scoring, run on the single controller.

Each built-in takes the `Batch`es bound to its node inputs and the node's literal attrs, and returns a
`Batch` derived from the rollout. Their signatures are declared in `flowrl.ir.signatures.FUNCTIONS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flowrl.algos import gae, grpo_advantages, kl, reinforce_pp_returns, rloo_advantages, whiten
from flowrl.errors import Diagnostic, ExecutionError, RewardError
from flowrl.ir.signatures import PASS_KEYS
from flowrl.registry import FUNCTIONS as USER_FUNCTIONS
from flowrl.registry import RewardFn, extra_columns
from flowrl.runtime.batch import Batch


class GroupSizeError(ValueError):
    pass


def _groups(scores: Batch, group: int) -> torch.Tensor:
    """Group ids from the rollout; checks every group has `group` samples (the flow's `group` must match
    the generate call's `n`)."""
    if "group_id" not in scores.tensors:
        return torch.arange(scores.size) // group
    ids = scores["group_id"]
    counts = torch.bincount(ids)
    counts = counts[counts > 0]
    if bool((counts != group).any()):
        raise GroupSizeError(f"group = {group} but the rollout has groups of {sorted(set(counts.tolist()))} "
                             "samples: set group to the generate call's n")
    return ids


def _last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) outcome rewards placed on each sample's last valid response token -> (B, T)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    last = (mask.sum(1) - 1).clamp(min=0).long()
    out.scatter_(1, last[:, None], scores.float()[:, None])
    return out * mask


def group_advantage(scores: Batch, *, group: int, norm_std: bool = True, eps: float = 1e-6) -> Batch:
    s = scores.value("scores")
    adv = grpo_advantages(s, _groups(scores, group), norm_std=norm_std, eps=eps)  # (B,)
    return scores.derive("advantages", advantages=adv)


def rloo_advantage(scores: Batch, *, group: int) -> Batch:
    adv = rloo_advantages(scores.value("scores"), _groups(scores, group))
    return scores.derive("advantages", advantages=adv)


def gae_advantage(scores: Batch, values: Batch, *, gamma: float = 1.0, lam: float = 0.95,
                  whiten: bool = True) -> Batch:
    mask = values["response_mask"].float()  # (B, T)
    rewards = _last_token_rewards(scores.value("scores"), mask)
    v = values.value("values") * mask
    adv, ret = gae(rewards, v, mask, gamma, lam)
    if whiten:
        adv = _whiten(adv, mask)
    return scores.derive("advantages", advantages=adv * mask, returns=ret * mask)


def reinforce_pp_advantage(scores: Batch, logp: Batch | None = None, ref_logp: Batch | None = None, *,
                           gamma: float = 1.0, kl_coef: float = 0.0, kl: str = "k1") -> Batch:
    mask = scores["response_mask"].float()
    rewards = _last_token_rewards(scores.value("scores"), mask)
    if kl_coef and logp is not None and ref_logp is not None:
        rewards = rewards - kl_coef * _kl(logp.value("logp"), ref_logp.value("logp"), kl) * mask
    returns = reinforce_pp_returns(rewards, mask, gamma)
    return scores.derive("advantages", advantages=_whiten(returns, mask) * mask, returns=returns)


def _kl(a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.Tensor:
    return kl(a, b, kind)


def _whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.sum() < 2:  # whitening one token is undefined: keep the raw values
        return x
    return whiten(x, mask)


BUILTINS: dict[str, Callable[..., Batch]] = {
    "group_advantage": group_advantage,
    "rloo_advantage": rloo_advantage,
    "gae": gae_advantage,
    "reinforce_pp_advantage": reinforce_pp_advantage,
}


def call_function(name: str, inputs: Mapping[str, Batch], attrs: Mapping[str, Any]) -> Batch:
    """Run a built-in or user-registered step function with node inputs by parameter name."""
    kwargs = {k: v for k, v in attrs.items() if k != "fn" and k not in PASS_KEYS}  # not the passes' bookkeeping
    fn = BUILTINS.get(name) or USER_FUNCTIONS.get(name)
    if fn is None:
        raise KeyError(f"no step function named {name!r}")
    out = fn(**inputs, **kwargs)
    if not isinstance(out, Batch):
        raise ExecutionError(Diagnostic(f"step function '{name}' returned {type(out).__name__}, expected a "
                                        "flowrl.Batch", hint=_make_batch_hint(inputs)))
    sizes = {b.size for b in inputs.values()}
    if len(sizes) == 1 and out.size not in sizes:  # inputs of several sizes (prompts and samples): no one answer
        raise ExecutionError(Diagnostic(f"step function '{name}' returned a Batch of {out.size} samples for "
                                        f"inputs of {sizes.pop()}", hint="one row per sample of its inputs, in their order"))
    return out


def _make_batch_hint(inputs: Mapping[str, Batch]) -> str:
    """How to wrap a tensor in a Batch, written with the function's own first input's name."""
    first = next(iter(inputs), "scores")
    return (f"wrap the tensor in a Batch of the same samples: `return {first}.derive(\"advantages\", "
            f"advantages=tensor)` (keeps their masks, groups and meta; the first argument names the field the next "
            f"node reads), or `flowrl.Batch({first}.size, {{\"advantages\": tensor}}, primary=\"advantages\")`; "
            "see docs/language.md, User functions")


def score_rollout(name: str, reward: RewardFn, rollout: Batch) -> Batch:
    """Call a reward function on every sample; a raise or a non-finite value names the sample."""
    prompts, responses = rollout.meta["prompt"], rollout.meta["response"]
    rows = rollout.meta.get("row", [{}] * rollout.size)
    if reward.batched:
        values = _call_batched(name, reward, prompts, responses, rows)
    else:
        values = [_call_one(name, reward, i, p, r, row) for i, (p, r, row) in
                  enumerate(zip(prompts, responses, rows, strict=True))]
    return rollout.derive("scores", scores=torch.tensor(values, dtype=torch.float32))


def _sample_error(name: str, index: int, prompt: str, response: str, problem: str) -> RewardError:
    return RewardError(Diagnostic(
        f"reward '{name}' {problem} on sample {index}",
        hint=f"prompt={prompt!r} response={response!r}",
    ))


def _call_one(name: str, reward: RewardFn, i: int, prompt: str, response: str, row: Mapping[str, Any]) -> float:
    try:
        value = reward.fn(prompt, response, **extra_columns(reward.fn, row))
    except Exception as e:  # the user's function failed: say which sample made it fail
        raise _sample_error(name, i, prompt, response, f"raised {type(e).__name__}: {e}") from e
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _sample_error(name, i, prompt, response, f"returned {value!r}, not a number") from None
    if not math.isfinite(out):
        raise _sample_error(name, i, prompt, response, f"returned {out}")
    return out


def _call_batched(name: str, reward: RewardFn, prompts: list[str], responses: list[str],
                  rows: list[Mapping[str, Any]]) -> list[float]:
    keys = sorted({k for r in rows for k in r if k != "prompt"})
    columns = {k: [r.get(k) for r in rows] for k in keys}
    try:
        values = list(reward.fn(prompts, responses, **columns))
    except Exception as e:
        raise RewardError(Diagnostic(f"batched reward '{name}' raised {type(e).__name__}: {e}",
                                     hint=f"first sample: prompt={prompts[0]!r}")) from e
    if len(values) != len(prompts):
        raise RewardError(Diagnostic(f"batched reward '{name}' returned {len(values)} values for "
                                     f"{len(prompts)} samples"))
    out = []
    for i, v in enumerate(values):
        f = float(v) if isinstance(v, (int, float)) else math.nan
        if not math.isfinite(f):
            raise _sample_error(name, i, prompts[i], responses[i], f"returned {v!r}")
        out.append(f)
    return out
