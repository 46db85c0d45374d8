"""RL math for the step functions: advantage estimators and losses as small pure torch functions."""

from __future__ import annotations

from flowrl.algos.advantages import (
    gae,
    group_baseline,
    grpo_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten,
)
from flowrl.algos.losses import (
    AGG_MODES,
    KL_KINDS,
    aggregate,
    denominators,
    kl,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)
from flowrl.algos.turns import (
    last_valid_index,
    token_rewards,
    turn_advantages,
    turn_returns,
    turn_rloo_advantages,
)

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "aggregate",
    "denominators",
    "gae",
    "group_baseline",
    "grpo_advantages",
    "kl",
    "last_valid_index",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_returns",
    "rloo_advantages",
    "token_rewards",
    "turn_advantages",
    "turn_returns",
    "turn_rloo_advantages",
    "value_loss",
    "whiten",
]
