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
    cispo_loss,
    denominators,
    kl,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)
from flowrl.algos.ratios import (
    RATIO_LEVELS,
    ROLLOUT_LOSSES,
    cispo_token_loss,
    importance_log_ratio,
    sequence_log_ratio,
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
    "RATIO_LEVELS",
    "ROLLOUT_LOSSES",
    "aggregate",
    "cispo_loss",
    "cispo_token_loss",
    "denominators",
    "gae",
    "group_baseline",
    "grpo_advantages",
    "importance_log_ratio",
    "kl",
    "last_valid_index",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_returns",
    "rloo_advantages",
    "sequence_log_ratio",
    "token_rewards",
    "turn_advantages",
    "turn_returns",
    "turn_rloo_advantages",
    "value_loss",
    "whiten",
]
