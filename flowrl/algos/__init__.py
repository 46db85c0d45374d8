"""RL math for the step functions: advantage estimators and losses as small pure torch functions."""

from __future__ import annotations

from flowrl.algos.advantages import gae, grpo_advantages, reinforce_pp_returns, rloo_advantages, whiten
from flowrl.algos.losses import AGG_MODES, KL_KINDS, aggregate, kl, policy_loss, ppo_clip_loss, value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "aggregate",
    "gae",
    "grpo_advantages",
    "kl",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_returns",
    "rloo_advantages",
    "value_loss",
    "whiten",
]
