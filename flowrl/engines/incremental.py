"""Incremental scoring of samples that are still decoding (flowrl.engines), for `fuse-gen-inference`.

A causal model's score of response token t (its log-prob, or the critic's value read at the position that
predicts it) depends on the prompt and tokens < t only. So a worker group that scores a rollout does not have
to wait for a long-tail sample to finish: it can run the forward over the tokens decoded so far, keep that
forward's KV cache, and later run only the tokens that came since (RLHFuse hides the forwards of finished
samples behind the tail; this hides most of the tail's own forwards too). `IncrementalScorer.feed` takes
samples' responses so far, brings each sample's state up to date with one forward over its new tokens, and
returns the whole (T,) scores of the samples marked final, equal to a full forward's (`forward_logprobs`,
`forward_values`) to float rounding.

State is kept in cohorts: the samples that started together share one KV cache (their rows keep the cache
batch dimension); a feed runs one forward per cohort over the new tokens of its rows, right-padded (masked)
where a row has fewer new tokens than another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from flowrl.engines.forward import no_grad_mode, positions_from_mask
from flowrl.models.build import cache_kw

__all__ = ["IncrementalScorer"]


@dataclass
class _Cohort:
    samples: list[int]  # sample id of each cache row
    cache: DynamicCache
    attn: Tensor  # (r, L) attention mask of everything fed
    pos: Tensor  # (r,) position id of the next token
    fed: Tensor  # (r,) response tokens fed so far
    last: Tensor  # (r, V) logits or (r,) values at the last fed position: what scores the next token
    scores: Tensor  # (r, W) scores of the fed tokens


class IncrementalScorer:
    """Per-token scores of growing samples: log-probs (`kind = "logprobs"`) or values (`kind = "values"`)."""

    def __init__(self, module: nn.Module, kind: str, *, temperature: float = 1.0, pad: int = 0):
        if kind not in ("logprobs", "values"):
            raise ValueError(f"unknown kind {kind!r}: expected logprobs or values")
        self.module, self.kind, self.pad = module, kind, pad
        self.scale = 1.0 / temperature if temperature > 0 else 1.0
        self.cohorts: list[_Cohort] = []

    @property
    def held(self) -> int:
        """Samples whose state is kept."""
        return sum(len(c.samples) for c in self.cohorts)

    def feed(self, samples: Tensor, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
             response_mask: Tensor, final: Tensor) -> Tensor:
        """Bring every given sample up to its response so far; returns the (F, T) scores of the rows marked
        `final` (in their order here, 0 past each response), whose state is then dropped. Prompts are
        left-padded, responses right-padded, as a rollout holds them; a sample's response only grows."""
        lengths = response_mask.long().sum(1)  # (B,)
        where = {s: (ci, row) for ci, c in enumerate(self.cohorts) for row, s in enumerate(c.samples)}
        ids = samples.tolist()
        mine: dict[int, list[tuple[int, int]]] = {}  # cohort -> (index here, its row there)
        for i, s in enumerate(ids):
            if s in where:
                mine.setdefault(where[s][0], []).append((i, where[s][1]))
        with no_grad_mode(self.module):
            for ci, rows in mine.items():
                self._extend(self.cohorts[ci], rows, response_ids, lengths)
            new = [i for i, s in enumerate(ids) if s not in where]
            if new:
                self.cohorts.append(self._start(new, samples, prompt_ids, prompt_mask, response_ids, lengths))
            out = torch.zeros(response_ids.shape, dtype=torch.float32)
            done = {s: i for i, s in enumerate(ids) if bool(final[i])}
            for cohort in self.cohorts:
                for row, s in enumerate(cohort.samples):
                    if s in done:
                        n = int(lengths[done[s]])
                        out[done[s], :n] = cohort.scores[row, :n].cpu()
            self._drop(set(done))
        return out[final.bool()]

    # -- pieces ----------------------------------------------------------------------------------------
    def _start(self, rows: list[int], samples: Tensor, prompt_ids: Tensor, prompt_mask: Tensor,
               response_ids: Tensor, lengths: Tensor) -> _Cohort:
        """A new cohort: one forward over the prompts and the responses so far, keeping its cache."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        width = max(1, int(lengths[idx].max()))
        resp = response_ids[idx, :width]
        resp_mask = (torch.arange(width)[None, :] < lengths[idx, None]).long()  # (r, w)
        attn = torch.cat([prompt_mask[idx].long(), resp_mask], dim=1)  # (r, P + w)
        device = self._device()
        cache = DynamicCache(config=getattr(self.module, "config", None))
        outs = self._run(torch.cat([prompt_ids[idx], resp], dim=1).to(device), attn.to(device),
                         positions_from_mask(attn).to(device), cache, keep=width + 1)  # (r, w + 1, ...)
        fed = lengths[idx].to(device)
        scores = self._score(outs[:, :width], resp.to(device)) * resp_mask.to(device)  # (r, w)
        last = outs[torch.arange(len(rows), device=device), fed]  # the position of each row's last token
        return _Cohort([int(samples[i]) for i in rows], cache, attn.to(device), attn.sum(1).to(device), fed, last,
                       scores)

    def _extend(self, c: _Cohort, mine: list[tuple[int, int]], response_ids: Tensor, lengths: Tensor) -> None:
        """One forward over the cohort's new tokens (rows without any: masked slots)."""
        device = c.attn.device
        add = torch.zeros(len(c.samples), dtype=torch.long)
        for i, row in mine:
            add[row] = max(0, int(lengths[i]) - int(c.fed[row]))
        width = int(add.max())
        if width == 0:
            return
        new = torch.full((len(c.samples), width), self.pad, dtype=torch.long)
        for i, row in mine:
            start = int(c.fed[row])
            new[row, : int(add[row])] = response_ids[i, start : start + int(add[row])]
        add, new = add.to(device), new.to(device)
        new_mask = (torch.arange(width, device=device)[None, :] < add[:, None]).long()  # (r, w)
        pos = c.pos[:, None] + torch.arange(width, device=device)[None, :]
        c.attn = torch.cat([c.attn, new_mask], dim=1)
        outs = self._run(new, c.attn, pos, c.cache, keep=width)  # (r, w, ...)
        # Token j of the new ones is scored by the output before it: the stored last one, then the new ones.
        before = torch.cat([c.last.unsqueeze(1), outs[:, :-1]], dim=1)
        scores = self._score(before, new) * new_mask
        # Never narrower than before: a finished sample's row left (`_drop`) may have been the widest.
        grown = torch.zeros((len(c.samples), max(c.scores.shape[1], int((c.fed + add).max()))), device=device)
        grown[:, : c.scores.shape[1]] = c.scores
        at = c.fed[:, None] + torch.arange(width, device=device)[None, :]
        grown.scatter_add_(1, at.clamp(max=grown.shape[1] - 1), scores)
        c.scores = grown
        moved = add > 0
        c.last = torch.where(moved.view(-1, *[1] * (outs.dim() - 2)),
                             outs[torch.arange(len(c.samples), device=device), (add - 1).clamp(min=0)], c.last)
        c.fed, c.pos = c.fed + add, c.pos + add

    def _run(self, ids: Tensor, attn: Tensor, pos: Tensor, cache: DynamicCache, keep: int) -> Tensor:
        """The model's last `keep` outputs: (r, keep, V) scaled logits, or (r, keep) values."""
        if self.kind == "values":
            return self.module(input_ids=ids, attention_mask=attn, position_ids=pos,
                               cache=cache)[:, -keep:].float()  # fmt: skip
        out = self.module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                          logits_to_keep=keep, **cache_kw(self.module, cache))  # fmt: skip
        logits = out.logits.float()
        return logits * self.scale if self.scale != 1.0 else logits

    def _score(self, before: Tensor, tokens: Tensor) -> Tensor:
        """(r, w) scores of `tokens` from the outputs at the positions that predict them."""
        if self.kind == "values":
            return before
        picked = before.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(before, dim=-1)

    def _drop(self, samples: set[int]) -> None:
        kept = []
        for c in self.cohorts:
            keep = [row for row, s in enumerate(c.samples) if s not in samples]
            if not keep:
                continue
            if len(keep) < len(c.samples):
                idx = torch.as_tensor(keep, dtype=torch.long, device=c.attn.device)
                c.cache.batch_select_indices(idx)
                c.samples = [c.samples[r] for r in keep]
                c.attn, c.pos, c.fed, c.last, c.scores = (t[idx] for t in (c.attn, c.pos, c.fed, c.last, c.scores))
            kept.append(c)
        self.cohorts = kept

    def _device(self) -> torch.device:
        return next(self.module.parameters()).device
