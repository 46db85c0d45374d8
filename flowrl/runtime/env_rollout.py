"""Multi-turn rollouts on a worker (`ModelWorker.generate` with `env = NAME`): the warm environment pools a
worker keeps, and the rollout `Batch` built from `flowrl.engines.turns.generate_turns`' output.

The generate node carries its env's whole spec (`attrs["env"]`, EnvSpec's fields, set by `dsl.environments`),
so each backend's worker builds the same pool from the node alone. A pool is made at a worker's first env
generate, kept warm across steps (its processes and their imported modules stay up) and closed with the worker.

The batch contract (issue 26): besides a plain rollout's tensors, `loss_mask` (1 on generated tokens only),
`turn_index`, `turn_rewards`, `env_return`, `env_turns`, `env_calls`, `env_errors`, `env_timeouts`,
`prefill_tokens`, `gen_idle_s` and `gen_wall_s` (the call's seconds divided equally among its rows), and the
meta `response` (actions and observations), `env_step_s` and `env_ended`.

`env_stream` is the fused stage's form (pass fuse-gen-inference, `ModelWorker.generate_stream`): the same
trajectories as rollout chunks as they finish (`flowrl.engines.turns.stream_turns`), numbered as a stream numbers
its samples, so a rank runs the forwards over finished trajectories while the others wait on their environments.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.engines.turns import TurnChunk, TurnOutput, generate_turns, stream_turns
from flowrl.envs import EnvSpec, Outcome
from flowrl.envs.pool import EnvPool
from flowrl.errors import Diagnostic, ExecutionError
from flowrl.ir.attrs import GenerateAttrs
from flowrl.models.tokenizer import Tokenizer
from flowrl.runtime.batch import Batch


def env_spec_of(attrs: Mapping[str, Any]) -> EnvSpec | None:
    """The EnvSpec a generate node carries, or None for a plain generate."""
    raw = attrs.get("env")
    if not isinstance(raw, Mapping):
        return None
    fields = dict(raw)
    fields["stop"] = tuple(fields.get("stop", ()))
    fields["imports"] = tuple(fields.get("imports", ()))
    fields["options"] = dict(fields.get("options", {}))
    return EnvSpec(**fields)


class EnvPools:
    """A worker's environment pools, one per declared env (by name), each kept while its spec stays the same."""

    def __init__(self) -> None:
        self.pools: dict[str, tuple[EnvSpec, EnvPool]] = {}
        self.lock = threading.Lock()

    def get(self, spec: EnvSpec) -> EnvPool:
        with self.lock:
            held = self.pools.get(spec.name)
            if held is not None and held[0] == spec:
                return held[1]
            if held is not None:
                held[1].close()
            pool = EnvPool(spec)
            self.pools[spec.name] = (spec, pool)
            return pool

    def close(self) -> None:
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
        for _, pool in pools:
            pool.close()


@dataclass
class _Watched:
    """The `Envs` handed to the decode loop: the pool itself, plus each trajectory's last action and the first
    failed call's (key, op, error), so a failure under on_error = "raise" names its sample and action."""

    pool: EnvPool
    actions: dict[Hashable, str] = field(default_factory=dict)
    failure: tuple[Hashable, str, str] | None = None

    def reset(self, key: Hashable, row: Mapping[str, Any]) -> Future[Outcome]:
        return self._watch(key, "reset", self.pool.reset(key, row))

    def step(self, key: Hashable, action: str) -> Future[Outcome]:
        self.actions[key] = action
        return self._watch(key, "step", self.pool.step(key, action))

    def release(self, key: Hashable) -> None:
        self.pool.release(key)

    def close(self) -> None:  # the pool outlives the call: EnvPools closes it
        pass

    def _watch(self, key: Hashable, op: str, future: Future[Outcome]) -> Future[Outcome]:
        def seen(f: Future[Outcome]) -> None:
            error = f.result().error
            if error is not None and self.failure is None:
                self.failure = (key, op, error)

        future.add_done_callback(seen)
        return future


def env_generate(module: torch.nn.Module, tokenizer: Tokenizer, ids: Sequence[Sequence[int]], prompts: Batch,
                 attrs: Mapping[str, Any], pool: EnvPool, *, step_seed: int, slots: Sequence[int],
                 device: str) -> Batch:
    """`n` trajectories per prompt with the node's environment; the rollout Batch of the batch contract."""
    spec = env_spec_of(attrs)
    assert spec is not None
    a = GenerateAttrs.of(attrs)
    total = int(attrs.get("max_total") or 0)
    envs = _Watched(pool)
    out = generate_turns(module, tokenizer, ids, _rows(prompts), envs, n=a.n, max_tokens=a.max_tokens,
                         max_turns=spec.max_turns, max_total=total or None, stop=spec.stop, min_tokens=a.min_tokens,
                         temperature=a.temperature, top_p=a.top_p, seed=step_seed, prompt_slots=slots,
                         overlap=spec.overlap, decode_batch=spec.decode_batch, device=device)
    if pool.failed is not None:
        raise _failure(spec, attrs, envs, prompts, slots)
    return rollout_batch(out, tokenizer, prompts, a.temperature)


def env_stream(module: torch.nn.Module, tokenizer: Tokenizer, ids: Sequence[Sequence[int]], prompts: Batch,
               attrs: Mapping[str, Any], pool: EnvPool, *, step_seed: int, slots: Sequence[int], device: str,
               first_sample: int = 0) -> Iterator[Batch]:
    """`env_generate`'s trajectories as rollout chunks as they finish (each handed out before the loop waits on
    environments with nothing to decode, so the caller's forwards on it fill that wait), with the chunk fields
    `sample` (numbered from `first_sample`), `group_id` (sample // n) and `pad`. Each chunk's `gen_idle_s` /
    `gen_wall_s` share the call's seconds since the previous chunk, so their sums over the rollout are the call's,
    the caller's forwards counted busy."""
    spec = env_spec_of(attrs)
    assert spec is not None
    a = GenerateAttrs.of(attrs)
    total = int(attrs.get("max_total") or 0)
    envs = _Watched(pool)
    for part in stream_turns(module, tokenizer, ids, _rows(prompts), envs, n=a.n, max_tokens=a.max_tokens,
                             max_turns=spec.max_turns, max_total=total or None, stop=spec.stop,
                             min_tokens=a.min_tokens, temperature=a.temperature, top_p=a.top_p, seed=step_seed,
                             prompt_slots=slots, overlap=spec.overlap, decode_batch=spec.decode_batch,
                             device=device):
        if pool.failed is not None:
            raise _failure(spec, attrs, envs, prompts, slots)
        assert isinstance(part, TurnChunk)  # no `park`: never suspended
        out = rollout_batch(part.out, tokenizer, prompts, a.temperature)
        sample = first_sample + torch.tensor(part.rows, dtype=torch.long)
        out.tensors.update(sample=sample, group_id=sample // a.n, pad=torch.full((out.size,), tokenizer.pad_id))
        yield out


def _rows(prompts: Batch) -> list[dict[str, Any]]:
    """The data rows (the controller's prompt batch carries each under meta "row"): an environment reads them."""
    if "row" in prompts.meta:
        return [dict(r) for r in prompts.meta["row"]]
    return [{k: v[i] for k, v in prompts.meta.items()} for i in range(prompts.size)]


def rollout_batch(out: TurnOutput, tokenizer: Tokenizer, prompts: Batch, temperature: float) -> Batch:
    """The rollout of `generate_turns`' output: its tensors under the batch contract's names, the prompts' meta
    repeated per trajectory, the whole response text (actions and observations) and each trajectory's ending."""
    index = out.prompt_index.cpu()
    rows: list[int] = index.tolist()
    size = len(rows)
    responses = [tokenizer.decode([int(t) for t, m in zip(r, mk, strict=True) if m]) for r, mk in
                 zip(out.response_ids.tolist(), out.response_mask.tolist(), strict=True)]
    tensors = {
        "prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask,  # (N, P)
        "response_ids": out.response_ids, "response_mask": out.response_mask,  # (N, T)
        "loss_mask": out.loss_mask, "gen_logp": out.logprobs,  # (N, T)
        "turn_index": out.turn_index, "turn_rewards": out.turn_rewards,  # (N, T)
        "env_return": out.turn_rewards.sum(1),  # (N,)
        "env_turns": out.turns, "env_calls": out.calls, "env_errors": out.errors, "env_timeouts": out.timeouts,
        "prefill_tokens": out.prefill_tokens,  # (N,)
        "gen_idle_s": torch.full((size,), out.idle_s / max(size, 1)),
        "gen_wall_s": torch.full((size,), out.wall_s / max(size, 1)),
        "group_id": index.clone(), "temperature": torch.full((size,), temperature),
        "truncated": torch.tensor([e == "length" for e in out.ended], dtype=torch.bool),  # ran out of tokens
    }
    meta = {k: [v[i] for i in rows] for k, v in prompts.meta.items()}
    meta["response"] = responses
    meta["env_step_s"] = [list(s) for s in out.step_seconds]
    meta["env_ended"] = list(out.ended)
    return Batch(size, tensors, meta, primary="response_ids")


def _failure(spec: EnvSpec, attrs: Mapping[str, Any], envs: _Watched, prompts: Batch,
             slots: Sequence[int]) -> ExecutionError:
    """An environment's failure under on_error = "raise" (or a class that could not start), as a run error that
    names the declaration and the sample: its prompt and the action the environment was given."""
    where = str(attrs.get("env_at") or "")
    declared = f" (declared at {where})" if where else ""
    if envs.failure is None:  # the pool's own record (a class that could not start)
        assert envs.pool.failed is not None
        problem = envs.pool.failed.diagnostics[0].message
        return ExecutionError(Diagnostic(f"{spec.kind} `{spec.name}`{declared}: {problem}"))
    key, op, error = envs.failure
    slot, sample = key if isinstance(key, tuple) and len(key) == 2 else (key, 0)
    places = [int(s) for s in slots]
    prompt = str(prompts.meta["prompt"][places.index(slot)]) if isinstance(slot, int) and slot in places else "?"
    what = f"its action {envs.actions.get(key, '')!r}" if op == "step" else "its reset"
    return ExecutionError(Diagnostic(
        f"{spec.kind} `{spec.name}`{declared} failed on sample {sample} of prompt {prompt!r}, {what}: {error}",
        hint='on_error = "observe" shows the policy the error and "end" ends the trajectory; the run goes on'))
