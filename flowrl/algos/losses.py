"""Policy, value and KL losses: pure functions called by the training step functions of the controller.

All per-token tensors are (B, T) with a 0/1 `mask` of the same shape. Losses reduce through `aggregate`,
whose optional `num_tokens` / `num_seqs` / `horizon` let a trainer split a mini-batch into micro-batches
and still get, by summing the micro-batch losses, exactly the loss (and gradient) of the whole
mini-batch. Conventions follow verl's `core_algos`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.algos.ratios import ROLLOUT_LOSSES, cispo_token_loss, importance_log_ratio

__all__ = ["AGG_MODES", "IS_CORRECTIONS", "KL_KINDS", "aggregate", "behaviour_weights", "cispo_loss", "denominators",
           "kl", "policy_loss", "ppo_clip_loss", "value_loss"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# Canonical estimator for each accepted name (verl's spellings are aliases).
KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over entries where mask > 0; 0 when nothing is valid. A non-finite value at a masked
    entry (an observation token's log-prob, say) is dropped, not multiplied by 0 into NaN."""
    m = mask.to(x.dtype)
    return torch.where(m > 0, x * m, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def denominators(response_mask: Tensor, loss_mask: Tensor | None = None) -> dict[str, float]:
    """The mini-batch's `aggregate` denominators {num_tokens, num_seqs, horizon}, counted on the tokens the
    loss trains on.

    Without a `loss_mask` (a rollout without an environment): sum(response_mask), B, T, as the trainer has
    always used. With one (B, T) (0 on observation tokens inside the response, and on padding):
    num_tokens = sum(loss_mask) and horizon = the most action tokens of any row, the width of the batch once
    observation tokens are taken out, so no mode counts an observation token: every mode then gives the same
    loss as on the compacted action-only sequences. A multi-turn trajectory is one row (one sequence) however
    many turns it has, so num_seqs stays B: turns do not multiply the update's samples.
    """
    rows = float(response_mask.shape[0])
    if loss_mask is None:
        return {"num_tokens": float(response_mask.sum()), "num_seqs": rows, "horizon": float(response_mask.shape[1])}
    actions = (loss_mask > 0).sum(dim=1)  # (B,)
    horizon = float(actions.max()) if actions.numel() else 0.0
    return {"num_tokens": float(actions.sum()), "num_seqs": rows, "horizon": horizon}


def _on_mask(x: Tensor, mask: Tensor) -> Tensor:
    """`x` where mask > 0, 0 elsewhere, taken before any arithmetic: a masked position (an observation token,
    a pad) then holds a finite value, so neither the loss nor its gradient can see what was there (a product
    by 0 would not do: 0 * inf is NaN, and the backward of a masked -inf log-prob would be NaN too)."""
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _as_tensor(value: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    horizon: float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token-mean               sum(m*l) / num_tokens          (num_tokens defaults to sum(m))
    seq-mean-token-mean      sum_i [sum_t m*l / sum_t m] / num_seqs  (num_seqs defaults to B)
    seq-mean-token-sum       sum_i sum_t m*l / num_seqs
    seq-mean-token-sum-norm  sum(m*l) / horizon             (horizon defaults to T; no division by B, as verl)

    `mask` is the LOSS mask: for a multi-turn trajectory, 0 on the observation tokens inside the response too
    (not the attention mask); every count above is over its 1s, so masked tokens anywhere in a row count for
    nothing. Only the horizon's default, T, is a width: pass `denominators(...)["horizon"]`, which counts
    action tokens only.

    Passing the whole mini-batch's num_tokens / num_seqs (and a fixed horizon) to every micro-batch makes
    the micro-batch losses sum to the mini-batch loss: each denominator is then a constant, so the
    reduction is linear in the rows. A sequence without valid tokens counts as 0 in seq-mean-token-mean.
    """
    m = mask.to(loss.dtype)  # (B, T)
    # where(), not a bare product: a non-finite loss on a padded token must not leak as NaN (value or grad).
    token_loss = torch.where(m > 0, loss * m, torch.zeros_like(loss))  # (B, T)
    if mode == "token-mean":
        denom = m.sum() if num_tokens is None else _as_tensor(num_tokens, loss)
        return token_loss.sum() / denom.clamp(min=1)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        seq_loss = token_loss.sum(dim=-1)  # (B,)
        if mode == "seq-mean-token-mean":
            seq_tokens = m.sum(dim=-1)  # (B,)
            seq_loss = torch.where(
                seq_tokens > 0, seq_loss / seq_tokens.clamp(min=1), torch.zeros_like(seq_loss)
            )
        seqs = _as_tensor(loss.shape[0] if num_seqs is None else num_seqs, loss)
        return seq_loss.sum() / seqs.clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        length = _as_tensor(loss.shape[-1] if horizon is None else horizon, loss)
        return token_loss.sum() / length
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")


def kl(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate between the policy and the reference, from sampled-token log-probs (B, T).

    With d = logp - ref_logp (http://joschu.net/blog/kl-approx.html):
    k1 ("kl") = d;  k2 ("mse") = d^2 / 2;  k3 ("low_var_kl") = exp(-d) + d - 1.
    k3 clamps d to +-20 and its output to +-10, as verl does, because exp(-d) overflows for very
    unlikely reference tokens and one such token would dominate the batch.
    """
    canonical = KL_KINDS.get(kind)
    if canonical is None:
        raise ValueError(f"unknown kl kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    d = logp - ref_logp  # (B, T)
    if canonical == "k1":
        return d
    if canonical == "k2":
        return 0.5 * d * d
    d = d.clamp(-20.0, 20.0)
    return (torch.exp(-d) + d - 1).clamp(-10.0, 10.0)


IS_CORRECTIONS = ("none", "decoupled", "tis")


def behaviour_weights(prox_logp: Tensor, behav_logp: Tensor, mode: str, cap: float = 5.0) -> Tensor:
    """Per-token importance weight (B, T) of the proximal policy over the behaviour policy that sampled the
    tokens, w = exp(prox_logp - behav_logp), for a sample generated by older weights (an asynchronous run):

    decoupled  AReaL's decoupled PPO (arXiv:2505.24298): w, and 0 for tokens where w > cap (dropped, as AReaL's
               `behav_imp_weight_cap` does: a token the behaviour policy found far less likely says little)
    tis        truncated importance sampling (verl's and Yao et al.'s TIS): min(w, cap)
    none       1 (the staleness is ignored)

    Detached: the weight scales the clipped surrogate, it is not trained through. The log-ratio is clamped at
    +-20 like PPO's, so a garbage token cannot overflow exp()."""
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {mode!r}; expected one of {', '.join(IS_CORRECTIONS)}")
    if cap <= 0:
        raise ValueError(f"is_cap must be > 0, got {cap}")
    if mode == "none":
        return torch.ones_like(prox_logp)
    w = torch.exp((prox_logp.detach() - behav_logp.detach()).clamp(-20.0, 20.0))
    if mode == "decoupled":
        return torch.where(w <= cap, w, torch.zeros_like(w))
    return w.clamp(max=cap)


def _ppo_clip_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    *,
    ratio_level: str = "token",
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate -> (loss, ratio, clipped), each (B, T); see `ppo_clip_loss`. `ratio_level`
    "sequence" (GSPO) needs the `mask` its per-sequence mean runs over."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss at -dual_clip * A), got {dual_clip}")
    old_logp = old_logp.detach()
    advantages = advantages.detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1): one outcome advantage for every token
    # The log-ratio is clamped so a stale or garbage token cannot overflow exp() (flowrl.algos.ratios).
    ratio = torch.exp(importance_log_ratio(logp, old_logp, torch.ones_like(logp) if mask is None else mask,
                                          ratio_level))  # (B, T)
    high = clip if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)  # pessimistic bound
    if dual_clip is not None:
        # Dual-clip PPO (arXiv:1912.09729): with A < 0 a huge ratio would make the loss unbounded.
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss, ratio, clipped > unclipped


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    horizon: float | Tensor | None = None,
    weights: Tensor | None = None,
    ratio: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped policy loss (arXiv:1707.06347) -> (scalar loss, metrics).

    logp, old_logp, mask: (B, T); advantages: (B,) outcome advantages broadcast over tokens, or (B, T).
    rho = exp(clamp(logp - old_logp, -20, 20));
    l = max(-A * rho, -A * clamp(rho, 1 - clip, 1 + clip_high))   (clip_high defaults to clip; DAPO's
    clip-higher uses clip_high > clip); dual_clip=c > 1 additionally caps l at -c * A where A < 0.
    `ratio` "sequence" is GSPO: rho is the sequence's ratio s_i on each of its tokens, with each token's own
    gradient (flowrl.algos.ratios.importance_log_ratio), and the clip acts on whole sequences.
    Gradients flow to `logp` only (old_logp and advantages are detached). `weights` (B, T), when given,
    multiply each token's l before aggregation (the behaviour importance weights of `behaviour_weights`).

    metrics: clipfrac (share of valid tokens where the clipped term won), ppo_kl (masked mean of
    old_logp - logp), ratio_mean (masked mean of rho). Metrics are local to this (micro-)batch.
    """
    logp, old_logp = _on_mask(logp, mask), _on_mask(old_logp, mask)
    if advantages.dim() == 2:
        advantages = _on_mask(advantages, mask)
    token_loss, rho, clipped = _ppo_clip_token_loss(logp, old_logp, advantages, clip, clip_high, dual_clip,
                                                    ratio_level=ratio, mask=mask)
    return _reduced(token_loss, rho, clipped, logp, old_logp, mask, agg, weights,
                    num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float = 1.0,
    clip_high: float | None = 4.0,
    agg: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    horizon: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO's policy loss (MiniMax-M1, arXiv:2506.13585) -> (scalar loss, metrics): agg of
    l = -sg(clamp(rho, 1 - clip, 1 + clip_high)) * A * logp (flowrl.algos.ratios.cispo_token_loss), every token
    keeping its gradient. Shapes, `weights` and metrics as `ppo_clip_loss` (clipfrac: the tokens whose weight
    was clamped)."""
    logp, old_logp = _on_mask(logp, mask), _on_mask(old_logp, mask)
    if advantages.dim() == 2:
        advantages = _on_mask(advantages, mask)
    token_loss, rho, clipped = cispo_token_loss(logp, old_logp, advantages, clip, clip_high)
    return _reduced(token_loss, rho, clipped, logp, old_logp, mask, agg, weights,
                    num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)


def _reduced(token_loss: Tensor, rho: Tensor, clipped: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor,
             agg: str, weights: Tensor | None, **denoms: float | Tensor | None) -> tuple[Tensor, dict[str, float]]:
    """A per-token policy loss aggregated (times `weights`, detached) and its metrics."""
    if weights is not None:
        token_loss = token_loss * weights.detach()
    loss = aggregate(token_loss, mask, agg, **denoms)
    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean(clipped.to(rho.dtype), mask).item(),
            "ppo_kl": _masked_mean(old_logp - logp, mask).item(),
            "ratio_mean": _masked_mean(rho, mask).item(),
        }
    return loss, metrics


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    behav_logp: Tensor | None = None,
    is_correction: str = "none",
    is_cap: float = 5.0,
    entropy: Tensor | None = None,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    horizon: float | Tensor | None = None,
    loss: str = "ppo_clip",
    ratio: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """The policy update's whole objective -> (scalar loss, metrics):

        loss = ppo_clip_loss(logp, old_logp, A, weights=w) + kl_coef * agg(kl(logp, ref_logp))
               - entropy_coef * agg(entropy)

    `loss` "cispo" puts `cispo_loss` in place of `ppo_clip_loss` (with the same clip, clip_high and weights);
    `ratio` "sequence" makes ppo_clip GSPO's (`ppo_clip_loss`).

    For samples generated by older weights (an asynchronous run), `old_logp` is the proximal policy's (the
    weights before this update) and `behav_logp` the behaviour policy's (recorded by generation);
    w = behaviour_weights(old_logp, behav_logp, is_correction, is_cap) (all ones for "none": plain PPO-clip,
    to which "decoupled" and "tis" reduce when behaviour = proximal). metrics then add is_weight_mean (masked
    mean of w), is_dropped (share of tokens "decoupled" dropped) and is_truncated (share "tis" capped).
    `old_logp` None: one optimizer step on the rollout (pass on-policy-logp), so the old log-probs are
    `logp.detach()` and the ratio is 1; then, with `ref_logp`, the step's KL to the reference (k1, token mean
    over `num_tokens`: what the controller reports as kl_mean) is measured here as `kl_mean`. All (B, T).
    metrics: pg_clipfrac is named `clipfrac`, the others of `ppo_clip_loss` get a `pg_` prefix; pg_loss,
    kl_loss (when kl_coef and ref_logp), entropy (when given).
    """
    logp = _on_mask(logp, mask)  # observation tokens and pads: nothing of theirs reaches the loss or gradient
    old = logp.detach() if old_logp is None else _on_mask(old_logp, mask)
    ref_logp = None if ref_logp is None else _on_mask(ref_logp, mask)
    behav_logp = None if behav_logp is None else _on_mask(behav_logp, mask)
    entropy = None if entropy is None else _on_mask(entropy, mask)
    weights = raw = None
    if is_correction != "none":
        if behav_logp is None:
            raise ValueError(f"is_correction = {is_correction!r} needs the behaviour policy's log-probs "
                             "(the rollout's gen_logp, recorded by generation)")
        weights = behaviour_weights(old, behav_logp, is_correction, is_cap)
        raw = torch.exp((old.detach() - behav_logp.detach()).clamp(-20.0, 20.0))
    if loss not in ROLLOUT_LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; expected one of {', '.join(ROLLOUT_LOSSES)}")
    if loss == "cispo":
        total, pg = cispo_loss(logp, old, advantages, mask, clip=clip, clip_high=clip_high, agg=agg,
                               num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon, weights=weights)
    else:
        total, pg = ppo_clip_loss(logp, old, advantages, mask, clip=clip, clip_high=clip_high, dual_clip=dual_clip,
                                  agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon,
                                  weights=weights, ratio=ratio)
    metrics = {k if k == "clipfrac" else f"pg_{k}": v for k, v in pg.items()}
    if weights is not None and raw is not None:
        with torch.no_grad():
            metrics["is_weight_mean"] = _masked_mean(weights, mask).item()
            beyond = _masked_mean((raw > is_cap).to(raw.dtype), mask).item()
            metrics["is_dropped" if is_correction == "decoupled" else "is_truncated"] = beyond
    metrics["pg_loss"] = float(total.detach())
    denoms = {"num_tokens": num_tokens, "num_seqs": num_seqs, "horizon": horizon}
    if ref_logp is not None and old_logp is None:
        with torch.no_grad():
            tokens = float(num_tokens) if num_tokens is not None else float(mask.sum())
            diff = torch.where(mask > 0, (logp - ref_logp) * mask, torch.zeros_like(logp))  # (B, T)
            metrics["kl_mean"] = float(diff.sum()) / max(tokens, 1.0)
    if kl_coef and ref_logp is not None:
        kl_loss = aggregate(kl(logp, ref_logp, kl_kind), mask, agg, **denoms)
        total = total + kl_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
    if entropy is not None:
        ent = aggregate(entropy, mask, agg, **denoms)
        metrics["entropy"] = float(ent.detach())
        if entropy_coef:
            total = total - entropy_coef * ent  # a bonus: higher entropy lowers the loss
    return total, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    horizon: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * agg(max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)), (B, T) in.

    clip=None gives the plain 0.5 * agg((V - R)^2). Gradients flow to `values` only.
    metrics: vf_clipfrac (share of valid tokens where the clipped error was larger), vpred_mean.
    """
    values = _on_mask(values, mask)
    old_values = _on_mask(old_values.detach(), mask)
    returns = _on_mask(returns.detach(), mask)
    unclipped = (values - returns) ** 2  # (B, T)
    if clip is None:
        token_loss = unclipped
        clipped_more = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        # Keep the new value within clip of the one used to compute the advantages (PPO2 style).
        v_clipped = torch.clamp(values, old_values - clip, old_values + clip)
        clipped_sq = (v_clipped - returns) ** 2
        token_loss = torch.maximum(unclipped, clipped_sq)
        clipped_more = clipped_sq > unclipped
    loss = 0.5 * aggregate(token_loss, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, horizon=horizon)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": _masked_mean(clipped_more.to(values.dtype), mask).item(),
            "vpred_mean": _masked_mean(values, mask).item(),
        }
    return loss, metrics
