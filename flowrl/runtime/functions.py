"""Built-in step functions (advantage estimators) and reward scoring, run on the single controller.

Each built-in takes the `Batch`es bound to its node inputs and the node's literal attrs, and returns a
`Batch` derived from the rollout. Their signatures are declared in `flowrl.ir.signatures.FUNCTIONS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flowrl.algos import (
    gae,
    grpo_advantages,
    kl,
    reinforce_pp_returns,
    rloo_advantages,
    token_rewards,
    turn_advantages,
    turn_rloo_advantages,
    whiten,
)
from flowrl.errors import Diagnostic, ExecutionError, RewardError
from flowrl.ir.signatures import PASS_KEYS, TURNS
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


# What a rollout generated with an environment adds (the batch contract of issue 26): loss_mask (B, T) 1 on
# action tokens only, turn_index (B, T) the turn of each token (-1 on pads), turn_rewards (B, T) each turn's
# reward at its last action token, env_return (B,) their sum. Absent: a plain rollout, treated exactly as before.


def _tensor(name: str, *batches: Batch | None) -> torch.Tensor | None:
    """The tensor `name` from the first batch that carries it."""
    return next((b[name] for b in batches if b is not None and name in b.tensors), None)


def _loss_mask(*batches: Batch | None) -> torch.Tensor:
    """The tokens trained on (B, T): the rollout's loss_mask when generated with an environment (observation
    tokens are 0 there), else its response_mask."""
    mask = _tensor("loss_mask", *batches)
    if mask is None:
        mask = _tensor("response_mask", *batches)
    if mask is None:
        raise KeyError("the batch has neither loss_mask nor response_mask: derive it from the rollout")
    return mask.float()


def _declared_scores(scores: Batch) -> torch.Tensor:
    """The declared rewards' score (B,); 0 for a rollout that only has its environment's rewards (the advantage
    op was given the rollout itself)."""
    if "scores" not in scores.tensors and "env_return" in scores.tensors:
        return torch.zeros(scores.size)
    return scores.value("scores").float()


def trajectory_returns(scores: Batch) -> torch.Tensor:
    """A trajectory's return (B,): its declared score plus the sum of its environment's turn rewards (what the
    advantages optimise; the run's `reward_mean` reports it too)."""
    s = _declared_scores(scores)
    env = scores.tensors.get("env_return")
    return s if env is None else s + env.float()


def _turns(turns: str, scores: Batch) -> bool:
    """Whether to credit turns: `turns = "turn"` on a rollout that has turns (a plain rollout is one turn, whose
    turn-level advantage is the trajectory's, so it gets the broadcast one)."""
    if turns not in TURNS:
        raise ValueError(f"turns = {turns!r}: expected one of {', '.join(map(repr, TURNS))}")
    return turns == "turn" and "turn_rewards" in scores.tensors and "turn_index" in scores.tensors


def group_advantage(scores: Batch, *, group: int, norm_std: bool = True, eps: float = 1e-6,
                    turns: str = "trajectory") -> Batch:
    """GRPO on each trajectory's return (declared score + env_return), one advantage per trajectory (B,), or
    with `turns = "turn"` each turn's return from that turn on against the group's mean total return (B, T),
    see flowrl.algos.turn_advantages."""
    ids = _groups(scores, group)
    if _turns(turns, scores):
        adv = turn_advantages(scores["turn_rewards"], scores["turn_index"], _loss_mask(scores),
                              _declared_scores(scores), ids, norm_std=norm_std, eps=eps)  # (B, T)
    else:
        adv = grpo_advantages(trajectory_returns(scores), ids, norm_std=norm_std, eps=eps)  # (B,)
    return scores.derive("advantages", advantages=adv)


def rloo_advantage(scores: Batch, *, group: int, turns: str = "trajectory") -> Batch:
    """RLOO on each trajectory's return, or per turn with `turns = "turn"` (flowrl.algos.turn_rloo_advantages)."""
    ids = _groups(scores, group)
    if _turns(turns, scores):
        adv = turn_rloo_advantages(scores["turn_rewards"], scores["turn_index"], _loss_mask(scores),
                                   _declared_scores(scores), ids)  # (B, T)
    else:
        adv = rloo_advantages(trajectory_returns(scores), ids)  # (B,)
    return scores.derive("advantages", advantages=adv)


def gae_advantage(scores: Batch, values: Batch, *, gamma: float = 1.0, lam: float = 0.95,
                  whiten: bool = True) -> Batch:
    """GAE over the action tokens: token rewards are the turn rewards at their tokens plus the declared score at
    the last action token; observation tokens are skipped by the recursion (flowrl.algos.gae)."""
    mask = _loss_mask(values, scores)  # (B, T)
    rewards = token_rewards(_declared_scores(scores), mask, _tensor("turn_rewards", scores, values))
    v = values.value("values") * mask
    adv, ret = gae(rewards, v, mask, gamma, lam)
    if whiten:
        adv = _whiten(adv, mask)
    return scores.derive("advantages", advantages=adv * mask, returns=ret * mask)


def reinforce_pp_advantage(scores: Batch, logp: Batch | None = None, ref_logp: Batch | None = None, *,
                           gamma: float = 1.0, kl_coef: float = 0.0, kl: str = "k1") -> Batch:
    """REINFORCE++ returns over the action tokens (turn rewards at their tokens, the declared score at the last
    action token, minus the KL penalty on action tokens), whitened over the batch's action tokens."""
    mask = _loss_mask(scores)  # (B, T)
    rewards = token_rewards(_declared_scores(scores), mask, scores.tensors.get("turn_rewards"))
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


def score_rollout(name: str, reward: RewardFn, rollout: Batch, seen: Callable[[Any], None] | None = None) -> Batch:
    """Call a reward function on every sample; a raise or a non-finite value names the sample. `seen` is shown
    each value as returned (the scorers read the notes a `flowrl.rewards.graded.Graded` carries)."""
    prompts, responses = rollout.meta["prompt"], rollout.meta["response"]
    rows = rollout.meta.get("row", [{}] * rollout.size)
    if reward.batched:
        values = _call_batched(name, reward, prompts, responses, rows, seen)
    else:
        values = [_call_one(name, reward, i, p, r, row, seen) for i, (p, r, row) in
                  enumerate(zip(prompts, responses, rows, strict=True))]
    return rollout.derive("scores", scores=torch.tensor(values, dtype=torch.float32))


def _sample_error(name: str, index: int, prompt: str, response: str, problem: str) -> RewardError:
    return RewardError(Diagnostic(
        f"reward '{name}' {problem} on sample {index}",
        hint=f"prompt={prompt!r} response={response!r}",
    ))


def _call_one(name: str, reward: RewardFn, i: int, prompt: str, response: str, row: Mapping[str, Any],
              seen: Callable[[Any], None] | None = None) -> float:
    try:
        value = reward.fn(prompt, response, **extra_columns(reward.fn, row))
    except Exception as e:  # the user's function failed: say which sample made it fail
        raise _sample_error(name, i, prompt, response, f"raised {type(e).__name__}: {e}") from e
    if seen is not None:
        seen(value)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _sample_error(name, i, prompt, response, f"returned {value!r}, not a number") from None
    if not math.isfinite(out):
        raise _sample_error(name, i, prompt, response, f"returned {out}")
    return out


def _call_batched(name: str, reward: RewardFn, prompts: list[str], responses: list[str],
                  rows: list[Mapping[str, Any]], seen: Callable[[Any], None] | None = None) -> list[float]:
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
        if seen is not None:
            seen(v)
        f = float(v) if isinstance(v, (int, float)) else math.nan
        if not math.isfinite(f):
            raise _sample_error(name, i, prompts[i], responses[i], f"returned {v!r}")
        out.append(f)
    return out
