"""`ModelWorker`: the models of one worker group and their methods (generate, logprobs, values, score,
update). One instance lives in each rank's process — in-process for the local backend, inside a Ray actor
for the Ray backend — so both backends run the same model code. It builds its models with
flowrl.runtime.model_init, reads prompts through flowrl.runtime.prompts and trains on rollouts with the
micro-batch losses of flowrl.runtime.rollout_loss.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from flowrl.algos import denominators
from flowrl.engines.chunked_generation import StreamControl, Tail, generate_stream, resume_stream
from flowrl.engines.forward import no_grad_mode
from flowrl.engines.generation import forward_logprobs, forward_values, generate
from flowrl.engines.incremental import IncrementalScorer
from flowrl.engines.prefill import Prefixes, compute_prefixes
from flowrl.engines.prefix import shared_logprobs, shared_values
from flowrl.engines.prompt_cache import weights_changed
from flowrl.engines.select import Trainer, check_engine, forward_module, make_trainer
from flowrl.engines.training import all_reduce_sum, data_parallel_world
from flowrl.ir.attrs import ForwardAttrs, GenerateAttrs, UpdateAttrs
from flowrl.ir.graph import ModelDecl
from flowrl.models.build import LoadedModel
from flowrl.models.lora_spec import base_of
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import (
    ChunkForward,
    Growing,
    Scored,
    chunk_batches,
    chunk_of,
    sampling_of,
    score_chunks,
)
from flowrl.runtime.env_rollout import EnvPools, env_generate, env_spec_of, env_stream
from flowrl.runtime.lora_state import (
    adapter_dropout,
    base_entry,
    check_base,
    load_module_state,
    load_trainer_state,
    module_state,
    trainer_state,
)
from flowrl.runtime.model_init import init_model, model_seed, resolve_device, shared_base
from flowrl.runtime.preference import with_last_slot
from flowrl.runtime.preference_update import PairUpdate, evaluate, is_data_batch, token_rows, update_on_rows
from flowrl.runtime.prompts import PromptEncoder, prompt_slots, prompt_texts
from flowrl.runtime.rollout_loss import critic_micro_loss, policy_micro_loss, rollout_inputs, safe_temp
from flowrl.runtime.schedule import Turn, interleave, mean_step_metrics
from flowrl.runtime.shaping import ended_with
from flowrl.runtime.transport import pack, unpack

# PromptEncoder, prompt_texts, prompt_slots (flowrl.runtime.prompts) and model_seed, resolve_device, init_model
# (flowrl.runtime.model_init) are re-exported: backends and tests import them from here.
__all__ = [
    "ROLLOUT_KEYS", "ModelWorker", "PromptEncoder", "ended_with", "group_state", "init_model", "load_group_state",
    "model_seed", "prompt_slots", "prompt_texts", "resolve_device",
]

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def drop_inherited_rendezvous() -> None:
    """Forget the process-group rendezvous this rank's process inherited. A rank the runtime starts (a spawned
    process, a Ray actor) takes its parent's environment, and with it the MASTER_PORT of a group the parent made for
    itself (an in-process DeepSpeed engine sets it, and its store still listens there): the rank's group is the one
    its backend joins, or, alone, one DeepSpeed makes on a port of its own."""
    for key in RENDEZVOUS:
        os.environ.pop(key, None)


ROLLOUT_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "temperature")


class ModelWorker:
    """Holds the models named in `models` (colocated on this rank) and their optimizers."""

    def __init__(self, models: Sequence[ModelDecl], all_models: Sequence[ModelDecl], *, seed: int,
                 device: str = "cpu", rank: int = 0, world: int = 1, peers: Mapping[str, LoadedModel] | None = None):
        """`peers`: models of the same group built by another worker of this process (in-process backends), which a
        reference on a LoRA policy may share its base with."""
        self.device = resolve_device(device)
        self.rank, self.world = rank, world
        decls = {m.name: m for m in all_models}
        self.decls = {m.name: m for m in models}
        self.models: dict[str, LoadedModel] = {}
        self.trainers: dict[str, Trainer] = {}
        self.generators: dict[str, Any] = {}  # model -> VLLMGenerator, for engine = "vllm"
        self.growing: dict[str, tuple[str, IncrementalScorer]] = {}  # node id -> (fused stage, its scorer)
        self.envs = EnvPools()  # generate with `env`: warm pools kept across steps, closed with the worker
        weakref.finalize(self, self.envs.close)
        held = dict(peers or {})
        # a reference on a LoRA policy held here is that policy's base (adapters off): the policy is built first
        for m in sorted(models, key=lambda m: base_of(m, decls) is not None):
            options: Mapping[str, Any] = m.options
            check_engine(m.engine, m.role, model=m.name, trainable=m.trainable, source=m.source,
                         device=str(self.device), options=options, loc=m.loc)
            loaded = shared_base(m, decls, held) or init_model(m, decls, seed)
            loaded.module.to(self.device)
            self.models[m.name] = held[m.name] = loaded
            if m.trainable:
                # Modules stay in eval mode: dropout off, as RLHF trainers run (old and new log-probs must agree).
                self.trainers[m.name] = make_trainer(
                    m.engine, loaded.module, lr=float(m.lr if m.lr is not None else 1e-5),
                    weight_decay=float(options.get("weight_decay", 0.0) or 0.0), options=options,
                )
            else:
                loaded.module.requires_grad_(False)
            if m.engine == "vllm":
                from flowrl.engines.vllm_engine import VLLMGenerator

                self.generators[m.name] = VLLMGenerator(m.source, loaded.tokenizer, seed=model_seed(seed, m.name),
                                                        dtype=str(options.get("dtype", "float32")))
        self.models = {m.name: self.models[m.name] for m in models}

    # ---- inference methods -------------------------------------------------------------------------
    def generate(self, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                 prefixes: Prefixes | None = None) -> Batch:
        """`prefixes`: common prompt prefixes computed once (here or on another instance, the serverless
        backend's deduplicated prefill); the torch engine prefills only what follows them (vLLM ignores them:
        its own prefix cache reuses a prefix within the engine)."""
        loaded = self.models[model]
        tok = loaded.tokenizer
        a = GenerateAttrs.of(attrs)
        ids = self._prompt_ids(model, prompts, a.max_tokens)
        slots = prompt_slots(prompts)
        spec = env_spec_of(attrs)
        if spec is not None:  # multi-turn: the policy acts, the environment answers (flowrl.runtime.env_rollout)
            return env_generate(loaded.module, tok, ids, prompts, attrs, self.envs.get(spec), step_seed=step_seed,
                                slots=slots, device=str(self.device))
        if model in self.generators:  # engine = "vllm"
            out = self.generators[model].generate(ids, n=a.n, sampling=sampling_of(a), seed=step_seed,
                                                  prompt_slots=slots)
        else:
            out = generate(
                loaded.module, tok, ids, n=a.n, max_tokens=a.max_tokens, min_tokens=a.min_tokens,
                temperature=a.temperature, top_p=a.top_p, seed=step_seed, prompt_slots=slots,
                share_prefix=a.share_prefix, prefixes=prefixes, device=str(self.device),
            )
        index = out.prompt_index.cpu()
        responses = [tok.decode([int(t) for t, m in zip(r, mk, strict=True) if m]) for r, mk in
                     zip(out.response_ids.tolist(), out.response_mask.tolist(), strict=True)]
        rows: list[int] = index.tolist()
        size = len(rows)
        tensors = {
            "prompt_ids": out.prompt_ids.cpu(), "prompt_mask": out.prompt_mask.cpu(),
            "response_ids": out.response_ids.cpu(), "response_mask": out.response_mask.cpu(),
            "group_id": index.clone(),
            "temperature": torch.full((size,), a.temperature),
            "gen_logp": out.logprobs.cpu(),
            # cut at max_tokens: no EOS (response/clip_ratio, DAPO's overlong filtering)
            "truncated": ~ended_with(out.response_ids.cpu(), out.response_mask.cpu(), tok.eos_id),
        }
        meta = {k: [v[i] for i in rows] for k, v in prompts.meta.items()}
        meta["response"] = responses
        return Batch(size, tensors, meta, primary="response_ids")

    def _prompt_ids(self, model: str, prompts: Batch, max_tokens: int) -> list[list[int]]:
        return self.prompt_encoder(model).ids(prompt_texts(prompts, self.models[model].tokenizer), max_tokens)

    def prompt_encoder(self, model: str) -> PromptEncoder:
        """How `model`'s generation turns prompt texts into token ids (a driver that plans by tokens asks)."""
        config: Mapping[str, Any] = self.decls[model].config
        return PromptEncoder(self.models[model].tokenizer, int(config.get("context", 512) or 512))

    def compute_prefixes(self, model: str, tokens: Sequence[tuple[int, ...]]) -> Prefixes:
        """Common prompt prefixes' keys and values under `model`'s current weights, on the host (to hand over)."""
        module = self.models[model].module
        with no_grad_mode(module):
            out = compute_prefixes(module, tokens, self.pad_id(model), self.device)
        return out.to(torch.device("cpu"))

    # fuse-gen-inference: generation as a stream of finished-sample chunks (flowrl.runtime.gen_infer)
    def generate_stream(self, model: str, prompts: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                        first_prompt: int = 0, control: StreamControl | None = None,
                        inline: Sequence[ChunkForward] = (),
                        prefixes: Prefixes | None = None) -> Iterator[Batch | Growing | Tail | Scored]:
        """`generate`'s samples (same seed, same samples), handed over in chunks as they finish. With `inline`,
        this rank runs those forwards on each chunk right away, between decode steps (`Scored` items)."""
        loaded, a = self.models[model], GenerateAttrs.of(attrs)
        ids = self._prompt_ids(model, prompts, a.max_tokens)
        spec = env_spec_of(attrs)
        if spec is not None:  # multi-turn: trajectories handed over as they finish (no tail to migrate: rows
            # waiting on environments hold no decode work), their forwards run while others wait on environments
            chunks = env_stream(loaded.module, loaded.tokenizer, ids, prompts, attrs, self.envs.get(spec),
                                step_seed=step_seed, slots=prompt_slots(prompts, first_prompt),
                                device=str(self.device), first_sample=first_prompt * a.n)
            return score_chunks(self, chunks, inline)
        stream = generate_stream(loaded.module, loaded.tokenizer, ids, n=a.n, sampling=sampling_of(a),
                                 seed=step_seed, prompt_slots=prompt_slots(prompts, first_prompt),
                                 chunk=chunk_of(a), share_prefix=a.share_prefix, first_sample=first_prompt * a.n,
                                 control=control, flush=a.flush_steps, partial=a.partial_below,
                                 prefixes=prefixes, device=str(self.device))
        return score_chunks(self, chunk_batches(stream, loaded.tokenizer, a), inline)

    def resume_stream(self, model: str, tails: Sequence[Tail], attrs: Mapping[str, Any], *,
                      control: StreamControl | None = None) -> Iterator[Batch | Growing | Tail]:
        """Continue unfinished rows migrated from other ranks (the long tail) as one batch."""
        loaded, a = self.models[model], GenerateAttrs.of(attrs)
        stream = resume_stream(loaded.module, loaded.tokenizer, tails, sampling=sampling_of(a), chunk=chunk_of(a),
                               control=control, flush=a.flush_steps, partial=a.partial_below,
                               device=str(self.device))
        return chunk_batches(stream, loaded.tokenizer, a)

    def _inputs(self, rollout: Batch) -> tuple[torch.Tensor, ...]:
        return rollout_inputs(rollout, self.device)

    def token_rows(self, model: str, batch: Batch) -> Batch:
        """A data node's rows tokenised as `model`'s update on them does (flowrl.runtime.preference_update): a
        forward over the data lines up row for row with the update's rows. A rollout is returned as it is."""
        if not is_data_batch(batch):
            return batch
        enc = self.prompt_encoder(model)
        return token_rows(batch, enc.tokenizer, enc.context)

    def logprobs(self, model: str, rollout: Batch, attrs: Mapping[str, Any]) -> Batch:
        rollout = self.token_rows(model, rollout)
        temp = float(rollout["temperature"][0]) if "temperature" in rollout.tensors else 1.0
        module, a = self.models[model].module, ForwardAttrs.of(attrs)
        micro = a.micro_batch
        logp = None
        if a.share_prefix:  # the share-prefix pass: each prompt prefix runs once (engines/prefix.py)
            logp = shared_logprobs(module, *self._inputs(rollout), temperature=safe_temp(temp), micro_batch=micro,
                                   min_len=a.prefix_min_len, pad=self.pad_id(model))
        if logp is None:
            logp = forward_logprobs(module, *self._inputs(rollout), temperature=safe_temp(temp), micro_batch=micro)
        return rollout.derive("logp", logp=logp.cpu())

    def values(self, model: str, rollout: Batch, attrs: Mapping[str, Any]) -> Batch:
        return rollout.derive("values", values=self._values(model, self._inputs(rollout), attrs).cpu())

    def _values(self, model: str, inputs: tuple[torch.Tensor, ...], attrs: Mapping[str, Any]) -> torch.Tensor:
        module, a = self.models[model].module, ForwardAttrs.of(attrs)
        micro = a.micro_batch
        values = None
        if a.share_prefix:  # the share-prefix pass (engines/prefix.py)
            values = shared_values(module, *inputs, micro_batch=micro, min_len=a.prefix_min_len,
                                   pad=self.pad_id(model))
        if values is None:
            values = forward_values(module, *inputs, micro_batch=micro)
        return values

    def score(self, model: str, rollout: Batch, attrs: Mapping[str, Any]) -> Batch:
        """Reward-model score: the value head on the hidden state of each sample's last response token, so the
        score has read the whole response (as `flowrl.runtime.preference.pair_scores`, which trains it, and TRL's
        and OpenRLHF's reward models read it)."""
        rollout = self.token_rows(model, rollout)
        prompt_ids, prompt_mask, response_ids, response_mask = self._inputs(rollout)
        return rollout.derive("scores", scores=self._last_token_scores(
            model, prompt_ids, prompt_mask, response_ids, response_mask, attrs).cpu())

    def _last_token_scores(self, model: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                           response_ids: torch.Tensor, response_mask: torch.Tensor,
                           attrs: Mapping[str, Any]) -> torch.Tensor:
        """(B,) the value read at each response's last token: a forward's value t is read where response token t
        is predicted (flowrl.engines.forward), so one slot appended after each response makes that slot's value
        the last token's. A reward model's `missing_eos_penalty` is taken off the score of each response cut off
        before EOS (the pairs it was trained on all end with EOS: a cut-off response is one it never saw end)."""
        ids, mask, lens = with_last_slot(response_ids, response_mask)
        values = self._values(model, (prompt_ids, prompt_mask, ids, mask), attrs)
        scores = values[torch.arange(len(lens), device=values.device), lens.to(values.device)]
        penalty = float(str(self.decls[model].options.get("missing_eos_penalty", 0.0) or 0.0))
        if penalty:
            ended = ended_with(response_ids, response_mask, self.models[model].tokenizer.eos_id)
            scores = scores - penalty * (~ended).to(scores.device, scores.dtype)
        return scores

    def score_growing(self, model: str, op: str, rows: Batch, attrs: Mapping[str, Any], *, node: str,
                      stage: str) -> torch.Tensor:
        """fuse-gen-inference's scoring of samples still decoding (`IncrementalScorer`): `rows` are samples'
        responses so far (`sample` ids, `final` flags); returns the (F, T) log-probs or values, or the (F,)
        scores, of the final rows, in their order. State is kept per node and fused stage (a stage that failed
        leaves nothing behind for the next one)."""
        held = self.growing.get(node)
        if held is None or held[0] != stage:
            temp = float(rows["temperature"][0]) if "temperature" in rows.tensors else 1.0
            kind = "logprobs" if op == "logprobs" else "values"
            held = (stage, IncrementalScorer(self.models[model].module, kind, temperature=safe_temp(temp),
                                             pad=self.pad_id(model)))
            self.growing[node] = held
        final = rows["final"].bool()
        prompt_ids, prompt_mask, response_ids, response_mask = self._inputs(rows)
        out = held[1].feed(rows["sample"], prompt_ids, prompt_mask, response_ids, response_mask, final)  # (F, T)
        if held[1].held == 0:
            del self.growing[node]
        if op != "score":
            return out
        # a score reads the value at the last token, one slot past what the incremental scorer has computed: the
        # final rows get a whole forward (as `score` does, so fused and unfused scores agree)
        if not bool(final.any()):
            return out.new_zeros(0)
        return self._last_token_scores(model, prompt_ids[final], prompt_mask[final], response_ids[final],
                                       response_mask[final], attrs)

    # ---- training ----------------------------------------------------------------------------------
    def update(self, model: str, batch: Batch, attrs: Mapping[str, Any], *, step_seed: int,
               turn: Turn | None = None) -> dict[str, float]:
        """Epochs x mini-batches of optimizer steps; each mini-batch is split into micro-batches whose losses
        are scaled by the whole mini-batch's denominators, so the update does not depend on the split."""
        with adapter_dropout(self.models[model].module):  # a LoRA model's `lora_dropout`, during updates only
            return self._update(model, batch, attrs, step_seed=step_seed, turn=turn)

    def _update(self, model: str, batch: Batch, attrs: Mapping[str, Any], *, step_seed: int,
                turn: Turn | None) -> dict[str, float]:
        role = self.decls[model].role
        engine = self.trainers[model]
        a = UpdateAttrs.of(attrs)
        self._set_lr(model, a.lr or None)
        module = forward_module(engine)  # DeepSpeed's wrapper when engine = "deepspeed"
        engine.set_max_grad_norm(a.max_grad_norm)
        if is_data_batch(batch):  # sft, dpo, bradley_terry on a data node's rows (flowrl.runtime.preference_update)
            enc = self.prompt_encoder(model)
            job = PairUpdate(module, enc.tokenizer, enc.context, self.device)
            out = update_on_rows(job, engine, batch, attrs, step_seed=step_seed, turn=turn, model=model)
            self._updated(model)
            return out
        epochs, parts, micro = a.epochs, max(1, a.mini_batches), a.micro_batch
        gen = torch.Generator().manual_seed(step_seed)
        loss = critic_micro_loss if role == "critic" else policy_micro_loss

        def steps() -> Iterator[tuple[list[Batch], Callable[[Batch], Any]]]:
            for _ in range(epochs):
                order = torch.randperm(batch.size, generator=gen) if epochs > 1 or parts > 1 \
                    else torch.arange(batch.size)
                for mini in batch.select(order).split(parts):
                    # counted on the tokens trained on: a multi-turn rollout's loss_mask leaves out its observations
                    denoms = denominators(mini["response_mask"], mini.tensors.get("loss_mask"))
                    if data_parallel_world() > 1:  # ray backend, data parallel: the global mini-batch's denominators
                        tokens, seqs = all_reduce_sum([denoms["num_tokens"], denoms["num_seqs"]], self.device)
                        denoms.update(num_tokens=tokens, num_seqs=int(seqs))
                    yield mini.chunks(micro), partial(loss, module, device=self.device, a=a, denoms=denoms)

        metrics = mean_step_metrics(engine, steps(), turn, model)
        self._updated(model)
        return metrics

    def _updated(self, model: str) -> None:
        weights_changed(self.models[model].module)  # its cached prompts (share-prefix) are stale now
        if model in self.generators:  # vLLM holds its own copy of the weights: push the new ones
            self.generators[model].load_weights(self.models[model].module.state_dict())

    def evaluate(self, model: str, rows: Batch, attrs: Mapping[str, Any]) -> dict[str, float]:
        """Held-out rows (pairs or demonstrations) scored by `model` as the update with `attrs` trains it (no
        gradients)."""
        enc = self.prompt_encoder(model)
        module = forward_module(self.trainers[model]) if model in self.trainers else self.models[model].module
        return evaluate(PairUpdate(module, enc.tokenizer, enc.context, self.device), rows, attrs)

    def update_fused(self, models: Sequence[str], batches: Sequence[Batch], attrs: Sequence[Mapping[str, Any]], *,
                     step_seeds: Sequence[int]) -> dict[str, Any]:
        """fuse-train's "interleave" schedule: the updates take turns micro-batch by micro-batch
        (flowrl.runtime.schedule); each result equals that model's plain `update`."""
        jobs = list(zip(models, batches, attrs, step_seeds, strict=True))
        results, order = interleave([partial(self._update_job, job) for job in jobs])
        return {"results": results, "order": order}

    def _update_job(self, job: tuple[str, Batch, Mapping[str, Any], int], turn: Turn) -> dict[str, float]:
        model, batch, attrs, seed = job
        return self.update(model, batch, attrs, step_seed=seed, turn=turn)

    def _set_lr(self, model: str, update_lr: float | None) -> None:
        """The update's learning rate (its `lr`, else the model's), with the model's linear warm-up over its first
        `warmup_steps` optimizer steps."""
        options: Mapping[str, Any] = self.decls[model].options
        warmup = int(options.get("warmup_steps", 0) or 0)
        if warmup > 0 or update_lr is not None:
            lr = update_lr if update_lr is not None else self.decls[model].lr
            base = float(lr) if lr is not None else 1e-5
            engine = self.trainers[model]
            engine.set_lr(base * (min(1.0, (engine.steps + 1) / warmup) if warmup > 0 else 1.0))

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every model's weights and its trainer's state; a LoRA model's are its adapters' (flowrl.runtime.lora_state),
        a reference sharing its base holds none. With several ranks every rank must call it (a DeepSpeed trainer
        gathers its ZeRO partitions onto rank 0: collectives); rank 0's is the group's state and the other ranks
        return {} (their share is in rank 0's)."""
        state = {
            name: {"module": module_state(m.module),
                   "optim": trainer_state(self.trainers[name], m.module) if name in self.trainers else None,
                   **base_entry(m.module)}
            for name, m in self.models.items()
        }
        return state if self.rank == 0 else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, s in state.items():
            if name not in self.models:
                continue
            module = self.models[name].module
            if s.get("optim") is not None and name in self.trainers:
                # The trainer restores the weights too: a ZeRO-3 module's own load_state_dict cannot (its
                # partitioned tensors are empty placeholders; the engine scatters the saved whole weights). A LoRA
                # model's adapters are checked against the base they were trained on first.
                check_base(name, module, s.get("base"))
                load_trainer_state(self.trainers[name], module, s["optim"])
            else:
                load_module_state(name, module, s["module"], s.get("base"))
            weights_changed(module)
            if name in self.generators:
                self.generators[name].load_weights(module.state_dict())

    def weights(self, model: str, packed: bool = False) -> dict[str, Any]:
        """`model`'s weights on the host (a LoRA model's adapters: what moves between groups); `packed`: as numpy
        arrays, for Ray's object store (runtime.transport)."""
        out = {k: v.detach().cpu() for k, v in module_state(self.models[model].module).items()}
        return pack(out) if packed else out

    def load_weights(self, model: str, weights: Mapping[str, Any]) -> None:
        """Weights as `weights` returns them, packed or not."""
        load_module_state(model, self.models[model].module, unpack(weights))
        weights_changed(self.models[model].module)

    def close(self) -> None:
        """Stop what the worker holds beyond its models: the environment pools' processes."""
        self.envs.close()

    def pad_id(self, model: str) -> int:
        """The token id that pads `model`'s rollouts (what a group merging its ranks' rollouts fills with)."""
        return int(self.models[model].tokenizer.pad_id)


def group_state(workers: Mapping[str, ModelWorker]) -> dict[str, Any]:
    """The state of every model of a group whose models (keys) may share workers: each worker once."""
    state: dict[str, Any] = {}
    for w in {id(w): w for w in workers.values()}.values():
        state.update(w.state_dict())
    return state


def load_group_state(workers: Mapping[str, ModelWorker], state: Mapping[str, Any]) -> None:
    for w in {id(w): w for w in workers.values()}.values():
        w.load_state_dict(state)
