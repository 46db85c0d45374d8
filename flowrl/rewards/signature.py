"""What a reward function must accept (flowrl.rewards): `fn(prompt, response, **row) -> float`, or for a batched one
`fn(prompts, responses, **columns) -> list[float]`, checked from its signature alone (inspect; no call, no torch),
so a run says so at the reward's line before the first step (`flowrl.runtime.scoring.make_scorer`) and check
time can too.
"""

from __future__ import annotations

import inspect

from flowrl.registry import RewardFn


def expected_signature(batched: bool) -> str:
    """The hint shown with a signature problem."""
    return ("a batched reward is `fn(prompts, responses, **columns) -> list[float]`" if batched else
            "a reward is `fn(prompt, response, **row) -> float` (`row`: the data row's other columns)")


def signature_problem(reward: RewardFn) -> str | None:
    """Why `reward` cannot be called as `fn(prompt, response, **row)` (batched: with lists), or None."""
    try:
        params = list(inspect.signature(reward.fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        names = ", ".join(p.name for p in params) or "nothing"
        return f"'{reward.name}' takes ({names}), not the prompt and the response"
    extra = [p.name for p in positional[2:] if p.default is p.empty and p.kind is p.POSITIONAL_ONLY]
    if extra:
        return f"'{reward.name}' needs positional arguments ({', '.join(extra)}) beyond the prompt and the response"
    return None
