"""Typed node attributes: one default per key, taken from the signatures (or PASS_KEYS), so they cannot drift."""

from __future__ import annotations

from dataclasses import fields

import pytest

from flowrl.ir.attrs import ForwardAttrs, GenerateAttrs, UpdateAttrs
from flowrl.ir.signatures import CRITIC_UPDATE, GENERATE, PASS_KEYS, POLICY_UPDATE, Signature


def _source(record: type, key: str) -> object:
    """Where the default of `record.key` must come from."""
    sigs: dict[type, list[Signature]] = {GenerateAttrs: [GENERATE], ForwardAttrs: [POLICY_UPDATE],
                                         UpdateAttrs: [POLICY_UPDATE, CRITIC_UPDATE]}
    for sig in sigs[record]:
        param = sig.param(key)
        if param is not None:
            return param.default
    assert key in PASS_KEYS, f"{record.__name__}.{key} has no signature parameter nor a PASS_KEYS entry"
    return PASS_KEYS[key]


@pytest.mark.parametrize("record", [GenerateAttrs, ForwardAttrs, UpdateAttrs])
def test_every_default_is_the_signatures(record: type) -> None:
    for f in fields(record):
        assert f.default == _source(record, f.name), f"{record.__name__}.{f.name}"


def test_the_critic_and_the_policy_agree_on_their_shared_keys() -> None:
    for p in CRITIC_UPDATE.params:
        other = POLICY_UPDATE.param(p.name)
        if other is not None and p.kind != "node" and p.name != "loss":
            assert p.default == other.default, p.name


def test_a_record_takes_the_keys_it_knows_with_their_types() -> None:
    a = GenerateAttrs.of({"n": 4.0, "max_tokens": "16", "share_prefix": 1, "fusion": "gen-infer:rollout"})
    assert (a.n, a.max_tokens, a.share_prefix, a.temperature) == (4, 16, True, 1.0)
    u = UpdateAttrs.of({"clip_high": 0.28, "epochs": 2})
    assert (u.clip_high, u.dual_clip, u.epochs, u.mini_batches) == (0.28, None, 2, 1)
    assert UpdateAttrs.of({}).clip == 0.2 and ForwardAttrs.of({}).micro_batch == 0
