"""Tests for flowrl.engines.turns: token identity, loss masks, sampling independent of timing and batch make-up,
turn limits, environment errors, prefill accounting and the continuous batch's overlap."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import DynamicCache

from flowrl.engines.forward import forward_logprobs
from flowrl.engines.sampling import row_keys
from flowrl.engines.turn_cache import pack, packed_rows, unpack
from flowrl.engines.turns import ENDED, TurnOutput, generate_turns, turn_keys
from flowrl.models.build import ModelSpec, build_model, cache_kw
from flowrl.models.tokenizer import Tokenizer


def _load_envs() -> Any:
    """The test pool lives next to this file (tests are imported by path, not as a package)."""
    spec = importlib.util.spec_from_file_location("envs_for_tests", Path(__file__).with_name("envs_for_tests.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("envs_for_tests", module)
    spec.loader.exec_module(module)
    return module


E = _load_envs()
CHARS = "0123456789<>=?;ab"
SPEC: dict[str, object] = {"layers": 2, "dim": 32, "heads": 2, "charset": CHARS, "context": 96}
TEXTS = ["12?", "3", "45<6", "a"]
ROWS: list[dict[str, Any]] = [{"hidden": 3, "intro": "?"}, {"hidden": 7}, {"hidden": 0, "intro": "=>"}, {"hidden": 9, "intro": "ab"}]


def _model(family: str = "gpt2", seed: int = 0) -> tuple[Any, Tokenizer]:
    loaded = build_model(ModelSpec(f"tiny:{family}", SPEC), seed=seed)
    return loaded.module, loaded.tokenizer


@contextmanager
def _eos_bias(module: Any, eos: int, bias: float) -> Iterator[None]:
    """Shift the EOS logit so a random tiny model actually stops."""

    def hook(_mod: nn.Module, _inp: Any, out: Tensor) -> Tensor:
        out = out.clone()
        out[..., eos] += bias
        return out

    handle = module.get_output_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _run(module: Any, tok: Tokenizer, envs: Any, texts: list[str] = TEXTS, rows: list[dict[str, Any]] = ROWS,
         **kw: Any) -> TurnOutput:
    args: dict[str, Any] = {"n": 2, "max_tokens": 5, "max_turns": 3, "stop": (";",), "seed": 3} | kw
    try:
        return generate_turns(module, tok, [tok.encode(t) for t in texts], rows, envs, **args)
    finally:
        envs.close()


def _trajectories(out: TurnOutput) -> list[list[int]]:
    return [out.response_ids[r, : int(out.response_lens[r])].tolist() for r in range(out.response_ids.shape[0])]


def _action(out: TurnOutput, r: int, k: int) -> list[int]:
    """Trajectory r's action k: its generated tokens of turn k."""
    sel = (out.turn_index[r] == k) & (out.loss_mask[r] == 1)
    return out.response_ids[r][sel].tolist()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_token_identity_generated_plus_observed_ids(family: str) -> None:
    module, tok = _model(family)
    envs = E.ThreadEnvs(E.CountEnv)
    out = _run(module, tok, envs, max_turns=4)
    assert set(out.ended) <= set(ENDED)
    for r in range(out.response_ids.shape[0]):
        key = (r // 2, r % 2)
        outcomes, actions, turns = envs.outcomes[key], envs.actions[key], int(out.turns[r])
        assert len(actions) == turns and len(outcomes) == turns + 1  # the reset, then one step per turn
        expected, gen = tok.encode(outcomes[0].observation), [0] * len(tok.encode(outcomes[0].observation))
        for k in range(turns):
            ids = _action(out, r, k)
            assert tok.decode(ids) == actions[k]  # the env saw exactly the text of the ids trained on
            expected, gen = expected + ids, gen + [1] * len(ids)
            if k < turns - 1:  # the observation after the last action is never appended
                obs = tok.encode(outcomes[k + 1].observation)
                expected, gen = expected + obs, gen + [0] * len(obs)
        length = int(out.response_lens[r])
        assert out.response_ids[r, :length].tolist() == expected
        assert out.loss_mask[r, :length].tolist() == gen
        assert out.response_mask[r, :length].eq(1).all() and out.response_mask[r, length:].eq(0).all()
        assert out.loss_mask[r, length:].eq(0).all() and out.turn_index[r, length:].eq(-1).all()
        assert out.logprobs[r][out.loss_mask[r] == 0].eq(0).all()
    assert sorted(envs.released) == sorted(envs.outcomes)  # every environment released at its end


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logprobs_equal_a_full_forward_over_the_final_sequence(family: str) -> None:
    module, tok = _model(family, seed=1)
    out = _run(module, tok, E.ThreadEnvs(E.CountEnv), max_turns=4, temperature=0.8)
    assert int(out.turns.max()) >= 3  # observations were prefilled onto kept caches, not only a first turn
    full = forward_logprobs(module, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                            temperature=0.8)  # fmt: skip
    gen = out.loss_mask.bool()
    assert torch.allclose(full[gen], out.logprobs[gen], atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kept_caches_packed_fed_and_repacked_equal_a_plain_forward(family: str) -> None:
    """Rows of different lengths kept apart, packed, fed new tokens of different lengths (padding inside rows),
    packed again with another kept row joining, decoded one step: each row's scores are a plain forward's over
    its whole sequence, and unpacking drops every padding slot."""
    module, _ = _model(family)
    seqs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    new = [[11, 12], [13, 14, 15, 16]]

    def plain(ids: list[int]) -> Tensor:
        return module(input_ids=torch.tensor([ids])).logits[0, -1].float()

    def run(cache: Any, ids: Tensor, attn: Tensor, pos: Tensor) -> Tensor:  # (R, V) last scores
        out = module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **cache_kw(module, cache))
        return out.logits[:, -1].float()

    with torch.inference_mode():
        kvs = []
        for seq in seqs:  # each row's own cache, as a trajectory out of the batch keeps it
            own = DynamicCache(config=module.config)
            module(input_ids=torch.tensor([seq]), use_cache=True, **cache_kw(module, own))
            layers: list[Any] = list(own.layers)
            kvs.append([(layer.keys[0], layer.values[0]) for layer in layers])
        cache, mask, width = pack(module, kvs[:2], headroom=4)
        ids = torch.tensor([[0, 0, 11, 12], [13, 14, 15, 16]])  # left-padded new tokens
        fed = (torch.arange(4) >= torch.tensor([[2], [0]])).long()  # (2, 4)
        pos = torch.tensor([[3], [1]]) + fed.cumsum(1) - 1
        attn = torch.cat([mask, fed], dim=1)
        logits = run(cache, ids, attn, pos)
        for r in range(2):
            assert torch.allclose(logits[r], plain(seqs[r] + new[r]), atol=1e-5)
        # Alone, the two rows' inner padding is over a quarter of their width: it is squeezed out.
        alone, alone_mask, alone_width = pack(module, [], 1, [packed_rows(cache, attn, width + 4)])
        assert alone_width == 5 and alone_mask.sum(1).tolist() == [5, 5]
        step = run(alone, torch.tensor([[7], [8]]), torch.ones(2, 6, dtype=torch.long), torch.tensor([[5], [5]]))
        for r, tok in enumerate([7, 8]):
            assert torch.allclose(step[r], plain(seqs[r] + new[r] + [tok]), atol=1e-5)
        # The third row joins the two (their inner padding kept: squeezing it out would not narrow the buffer).
        cache, mask, width = pack(module, [kvs[2]], 1, [packed_rows(cache, attn, width + 4)])
        assert width == 7 and mask.sum(1).tolist() == [5, 5, 6]
        step = run(cache, torch.tensor([[7], [8], [9]]), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                   torch.tensor([[5], [5], [6]]))  # fmt: skip
        whole = [seqs[0] + new[0] + [7], seqs[1] + new[1] + [8], seqs[2] + [9]]
        for r in range(3):
            assert torch.allclose(step[r], plain(whole[r]), atol=1e-5)
        back = unpack(cache, torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1), width + 1, [0, 1, 2])
        assert [kv[0][0].shape[1] for kv in back] == [len(w) for w in whole]
        # Packed again from the unpacked rows alone: a row's scores do not depend on how it was packed.
        cache, mask, width = pack(module, back, 0)
        assert width == 7 and mask.sum(1).tolist() == [6, 6, 7]


def _seeded_slow(start: int) -> Callable[[], Any]:
    seeds = itertools.count(start)
    return lambda: E.SlowEnv(next(seeds))


def test_same_samples_with_overlap_off_random_latency_and_a_split_batch() -> None:
    module, tok = _model()
    base = _run(module, tok, E.ThreadEnvs(E.GuessEnv))
    runs = [
        _run(module, tok, E.ThreadEnvs(E.GuessEnv), overlap=False),
        _run(module, tok, E.ThreadEnvs(_seeded_slow(0), workers=8)),
        _run(module, tok, E.ThreadEnvs(_seeded_slow(100), workers=3)),
        _run(module, tok, E.ThreadEnvs(_seeded_slow(7), workers=8), overlap=False),
    ]
    # The batch split in two calls, the later prompts first: each keeps its slot in the whole batch.
    late = _run(module, tok, E.ThreadEnvs(_seeded_slow(50)), texts=TEXTS[2:], rows=ROWS[2:], prompt_slots=[2, 3])
    early = _run(module, tok, E.ThreadEnvs(_seeded_slow(60)), texts=TEXTS[:2], rows=ROWS[:2], prompt_slots=[0, 1])
    want = _trajectories(base)
    assert len({tuple(t) for t in want}) > 4  # samples of a random model, not one repeated answer
    for run in runs:
        assert _trajectories(run) == want
        assert run.ended == base.ended and torch.equal(run.turns, base.turns)
        assert torch.allclose(run.logprobs[:, : base.logprobs.shape[1]], base.logprobs, atol=1e-5)
    assert _trajectories(early) + _trajectories(late) == want
    assert early.ended + late.ended == base.ended


def test_turns_respect_max_turns_stop_and_max_tokens() -> None:
    module, tok = _model(seed=2)
    envs = E.ThreadEnvs(E.CountEnv)
    out = _run(module, tok, envs, texts=TEXTS * 2, rows=ROWS * 2, max_tokens=4, max_turns=3)
    ended_by_stop = 0
    for r, ended in enumerate(out.ended):
        turns = int(out.turns[r])
        assert 1 <= turns <= 3 and (ended == "max_turns") == (turns == 3 and ended != "eos")
        for k in range(turns):
            ids = _action(out, r, k)
            text = tok.decode(ids)
            assert 1 <= len(ids) <= 4
            if ";" in text:  # a turn ends at its first stop text, which is part of the action
                assert text.index(";") == len(text) - 1
                ended_by_stop += 1
            else:
                assert len(ids) == 4 or ids[-1] == tok.eos_id
    assert ended_by_stop > 0  # the stop text did end turns in this run


class _Scripted(nn.Module):
    """Wraps an LM: the token after position p is forced to `script[(p + 1) % len(script)]` (a fixed text)."""

    def __init__(self, lm: nn.Module, script: list[int]) -> None:
        super().__init__()
        self.module = lm  # the name `cache_kw` looks through
        self.config = lm.config
        self.script = torch.tensor(script)

    def forward(self, input_ids: Tensor, position_ids: Tensor, **kwargs: Any) -> Any:
        out = self.module(input_ids=input_ids, position_ids=position_ids, **kwargs)
        logits = out.logits  # (B, k, V): aligned with the last k inputs
        nxt = self.script[(position_ids[:, -logits.shape[1] :] + 1) % len(self.script)]  # (B, k)
        logits.scatter_add_(-1, nxt[..., None], torch.full_like(logits[..., :1], 100.0))
        return out


def test_a_stop_text_spanning_tokens_ends_the_turn() -> None:
    """'é' is two byte tokens: the turn ends on the second, found in the turn's decoded text."""
    lm = build_model(ModelSpec("tiny:gpt2", {"layers": 2, "dim": 32, "heads": 2}), seed=0)
    tok = lm.tokenizer
    module = _Scripted(lm.module, tok.encode("xé"))
    envs = E.ThreadEnvs(E.CountEnv)
    out = _run(module, tok, envs, texts=["go", "a"], rows=[{}, {"intro": "é"}], max_tokens=8, max_turns=3, stop=("é",))
    assert out.ended == ["max_turns"] * 4
    for r in range(4):
        for k in range(3):
            ids = _action(out, r, k)
            assert tok.decode(ids).endswith("é") and tok.decode(ids).count("é") == 1 and len(ids) <= 4


def test_eos_ends_the_trajectory_after_its_step() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(E.CountEnv)
    with _eos_bias(module, tok.eos_id, 3.0):
        out = _run(module, tok, envs, max_tokens=6, max_turns=5)
    eos_rows = [r for r, e in enumerate(out.ended) if e == "eos"]
    assert eos_rows
    for r in eos_rows:
        length = int(out.response_lens[r])
        assert out.response_ids[r, length - 1] == tok.eos_id and out.loss_mask[r, length - 1] == 1
        # The step was still called (to reward a final answer), its reward placed on the EOS token.
        assert len(envs.actions[(r // 2, r % 2)]) == int(out.turns[r])
        assert float(out.turn_rewards[r, length - 1]) == pytest.approx(envs.outcomes[(r // 2, r % 2)][-1].reward)


def test_max_total_caps_the_whole_response() -> None:
    module, tok = _model()
    out = _run(module, tok, E.ThreadEnvs(E.CountEnv), max_tokens=5, max_turns=6, max_total=9)
    assert int(out.response_lens.max()) <= 9
    assert "length" in out.ended
    for r, ended in enumerate(out.ended):
        if ended == "length":  # no room left for an observation and one more action token
            assert int(out.response_lens[r]) >= 9 - 3


def test_turn_rewards_sit_on_each_turns_last_action_token() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(E.CountEnv)
    out = _run(module, tok, envs)
    for r in range(out.response_ids.shape[0]):
        key = (r // 2, r % 2)
        steps = envs.outcomes[key][1:]
        where = []
        for k in range(int(out.turns[r])):
            sel = ((out.turn_index[r] == k) & (out.loss_mask[r] == 1)).nonzero().squeeze(1)
            where.append(int(sel[-1]))
        expect = torch.zeros_like(out.turn_rewards[r])
        for at, outcome in zip(where, steps, strict=True):
            expect[at] = outcome.reward
        assert torch.allclose(out.turn_rewards[r], expect)
    assert torch.allclose(out.turn_rewards.sum(1), torch.tensor([sum(o.reward for o in envs.outcomes[(r // 2, r % 2)])
                                                                 for r in range(8)]))  # fmt: skip


def test_prefill_tokens_are_prompt_plus_observations() -> None:
    module, tok = _model()
    out = _run(module, tok, E.ThreadEnvs(E.CountEnv), max_turns=4)
    prompt = out.prompt_mask.sum(1)
    observed = (out.response_mask - out.loss_mask).sum(1)
    assert torch.equal(out.prefill_tokens, prompt + observed)
    assert int(observed.min()) > 0


def test_crashing_env_observe_hands_the_error_back() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(lambda: E.RaiseEnv(fail_at=1), on_error="observe")
    out = _run(module, tok, envs, max_turns=3)
    for r in range(out.response_ids.shape[0]):
        first = envs.outcomes[(r // 2, r % 2)][1]
        assert first.error == "raised ValueError: tool crashed" and not first.done
        assert int(out.errors[r]) == 1 and int(out.timeouts[r]) == 0
        assert int(out.calls[r]) <= int(out.turns[r]) - 1  # the crashed step is no call
        if int(out.turns[r]) > 1:  # the error text was the observation after action 0
            obs = ((out.turn_index[r] == 0) & (out.loss_mask[r] == 0) & (out.response_mask[r] == 1)).nonzero()
            assert obs.numel() > 0
            seen = out.response_ids[r][obs[-len(tok.encode(first.observation)) :].squeeze(1)].tolist()
            assert seen == tok.encode(first.observation)


def test_crashing_env_end_ends_the_trajectory() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(lambda: E.RaiseEnv(fail_at=2), on_error="end")
    out = _run(module, tok, envs, max_turns=4)
    assert out.ended == ["error"] * 8 or all(e in ("error", "eos") for e in out.ended)
    for r, ended in enumerate(out.ended):
        if ended == "error":
            assert int(out.turns[r]) == 2 and int(out.errors[r]) == 1 and int(out.calls[r]) == 1
    assert sorted(envs.released) == sorted(envs.outcomes)


def test_hanging_env_times_out() -> None:
    module, tok = _model()
    release = threading.Event()
    envs = E.ThreadEnvs(lambda: E.HangEnv(release), workers=8, timeout=0.05, on_error="observe")
    try:
        out = _run(module, tok, envs, max_turns=2)
    finally:
        release.set()  # the hung threads can never finish on their own
    # Every step hangs (the 8 threads stay blocked), so each action's step times out, and is counted.
    assert torch.equal(out.timeouts, out.errors)
    for r in range(out.response_ids.shape[0]):
        outcomes = envs.outcomes[(r // 2, r % 2)]
        assert all(o.timed_out and o.error == "timeout after 0.05 s" for o in outcomes[1:])
        assert len(outcomes) == int(out.turns[r]) + 1
        assert int(out.timeouts[r]) == sum(o.timed_out for o in outcomes)  # a reset on a busy machine too
    assert all(e in ("max_turns", "eos") for e in out.ended)


def test_groups_of_n_samples() -> None:
    module, tok = _model()
    envs = E.ThreadEnvs(E.CountEnv)
    out = _run(module, tok, envs, n=3, prompt_slots=[5, 9, 2, 4])
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(out.prompt_ids[0], out.prompt_ids[2]) and not torch.equal(out.prompt_ids[0], out.prompt_ids[3])
    assert sorted(envs.outcomes) == sorted((s, j) for s in (5, 9, 2, 4) for j in range(3))
    trajs = _trajectories(out)
    assert any(len({tuple(t) for t in trajs[g * 3 : g * 3 + 3]}) > 1 for g in range(4))  # samples differ


class _Relay:
    """Environments made in order: the first one's step blocks until another trajectory has finished its
    last turn, which it can only do if the decode loop went on while the first waited."""

    def __init__(self, max_turns: int) -> None:
        self.max_turns, self.made = max_turns, 0
        self.event = threading.Event()
        self.unblocked: bool | None = None

    def __call__(self) -> Any:
        self.made += 1
        return _Blocked(self) if self.made == 1 else _Counting(self)


class _Blocked:
    def __init__(self, relay: _Relay) -> None:
        self.relay = relay

    def reset(self, row: Any) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.relay.unblocked = self.relay.event.wait(timeout=60)  # a bound only so a broken loop fails, not hangs
        return "", 0.0, True


class _Counting:
    def __init__(self, relay: _Relay) -> None:
        self.relay, self.steps = relay, 0

    def reset(self, row: Any) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        self.steps += 1
        if self.steps == self.relay.max_turns:
            self.relay.event.set()
        return "<", 0.0, False


def test_others_keep_decoding_while_an_environment_is_pending() -> None:
    module, tok = _model()
    relay = _Relay(max_turns=3)
    out = _run(module, tok, E.ThreadEnvs(relay, workers=4), texts=TEXTS[:2], rows=ROWS[:2], n=1, max_turns=3,
               stop=())  # fmt: skip
    assert relay.unblocked is True
    assert out.ended == ["done", "max_turns"] and out.turns.tolist() == [1, 3]


def test_turn_keys_are_distinct_streams() -> None:
    keys = row_keys(11, [0, 1], 2)  # (4, 2)
    k0, k1 = turn_keys(keys, 0), turn_keys(keys, 1)
    assert torch.equal(turn_keys(keys, torch.tensor([0, 1, 0, 1]))[::2], k0[::2])
    assert len({tuple(k) for k in torch.cat([keys, k0, k1]).tolist()}) == 12


def test_bad_arguments() -> None:
    module, tok = _model()
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        _run(module, tok, E.ThreadEnvs(E.CountEnv), max_turns=0)
    with pytest.raises(ValueError, match="3 rows for 4 prompts"):
        _run(module, tok, E.ThreadEnvs(E.CountEnv), rows=ROWS[:3])


def _decode_rows(module: Any) -> tuple[list[int], Any]:
    """The rows of every forward after the prompts' prefill (decode steps and joining rows' prefills)."""
    rows: list[int] = []

    def hook(_mod: nn.Module, args: Any, kwargs: Any) -> None:
        rows.append(int(kwargs["input_ids"].shape[0]))

    return rows, module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_batch_caps_the_rows_decoding_and_keeps_the_samples(overlap: bool) -> None:
    module, tok = _model()
    base = _run(module, tok, E.ThreadEnvs(E.GuessEnv))
    for cap, seed in ((1, 0), (3, 40)):
        rows, handle = _decode_rows(module)
        try:
            run = _run(module, tok, E.ThreadEnvs(_seeded_slow(seed), workers=8), overlap=overlap, decode_batch=cap)
        finally:
            handle.remove()
        assert _trajectories(run) == _trajectories(base)
        assert run.ended == base.ended and torch.equal(run.turns, base.turns)
        assert torch.allclose(run.logprobs[:, : base.logprobs.shape[1]], base.logprobs, atol=1e-5)
        assert rows[0] == len(TEXTS)  # the prompts' prefill: every prompt, once
        assert max(rows[1:]) == cap  # 8 trajectories, never more than the cap decoding at once, and the cap reached


def test_a_queued_trajectory_decodes_while_the_batchs_only_row_waits_on_its_environment() -> None:
    """decode_batch = 1: the first trajectory's environment answers only after the second has taken all its turns,
    so the run ends only if the queued one joins when the first leaves the batch (not when its environment answers)."""
    module, tok = _model()
    relay = _Relay(max_turns=3)
    out = _run(module, tok, E.ThreadEnvs(relay, workers=4), texts=TEXTS[:2], rows=ROWS[:2], n=1, max_turns=3,
               stop=(), decode_batch=1)  # fmt: skip
    assert relay.unblocked is True
    assert out.ended == ["done", "max_turns"] and out.turns.tolist() == [1, 3]


def test_decode_batch_must_not_be_negative() -> None:
    module, tok = _model()
    with pytest.raises(ValueError, match="decode_batch must be >= 0"):
        _run(module, tok, E.ThreadEnvs(E.CountEnv), decode_batch=-1)
