"""Prefix grouping for the shared-prefix forwards (flowrl.engines.prefix): a token trie and a row plan.

`plan_prefixes` deduplicates a rollout's rows by their real prompt tokens and, through `PrefixTrie`, groups the
unique prompts whose first `min_len` tokens agree (a system prompt), so each group's common prefix runs once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["PrefixPlan", "PrefixTrie", "plan_of", "plan_prefixes"]


class PrefixTrie:
    """A trie over token ids; `groups(min_len)` finds prompts sharing a long enough leading run of tokens."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}
        self.prompts: list[tuple[int, ...]] = []

    def insert(self, tokens: Sequence[int]) -> int:
        node = self.root
        for tok in tokens:
            node = node.setdefault(tok, {})
        index = len(self.prompts)
        node.setdefault(-1, []).append(index)  # key -1: the prompts that end at this node
        self.prompts.append(tuple(tokens))
        return index

    def groups(self, min_len: int) -> list[tuple[int, list[int]]]:
        """(prefix length, prompt indices) for each set of >= 2 prompts whose first `min_len` tokens agree.
        The prefix runs on to the set's longest common prefix but stops one token short of its shortest
        member, so every prompt keeps a last token of its own to score response token 0 from."""
        if min_len < 1:
            raise ValueError(f"min_len must be >= 1, got {min_len}")
        out: list[tuple[int, list[int]]] = []
        frontier: list[tuple[int, dict[int, Any]]] = [(0, self.root)]
        while frontier:
            depth, node = frontier.pop()
            if depth < min_len:
                frontier.extend((depth + 1, child) for tok, child in sorted(node.items(), reverse=True) if tok != -1)
                continue
            members = _below(node)
            if len(members) < 2:
                continue
            lcp = depth
            while -1 not in node and len(node) == 1:  # one path on: everyone still agrees
                node = next(iter(node.values()))
                lcp += 1
            length = min(lcp, min(len(self.prompts[i]) for i in members) - 1)
            if length >= min_len:
                out.append((length, sorted(members)))
        return sorted(out, key=lambda g: g[1][0])


def _below(node: dict[int, Any]) -> list[int]:
    found: list[int] = []
    stack = [node]
    while stack:
        cur = stack.pop()
        for key, child in cur.items():
            if key == -1:
                found.extend(child)
            else:
                stack.append(child)
    return found


@dataclass(frozen=True)
class PrefixPlan:
    """Which computation each row shares: `unique[u]` the tokens of unique prompt u, `row_prompt[r]` the unique
    prompt of row r, `groups` (prefix length, unique prompts) from the trie."""

    unique: list[tuple[int, ...]]
    row_prompt: list[int]
    groups: list[tuple[int, list[int]]]

    @property
    def saved_tokens(self) -> int:
        rows_total = sum(len(self.unique[u]) for u in self.row_prompt)
        return rows_total - self.computed_tokens

    @property
    def computed_tokens(self) -> int:
        grouped = sum(length * (len(members) - 1) for length, members in self.groups)
        return sum(len(p) for p in self.unique) - grouped

    def worth_it(self, min_len: int, cached: bool = False) -> bool:
        """Sharing pays when a trie group exists, or when a prompt of at least `min_len` tokens runs more
        than once or is already computed (`cached`); otherwise the plain forward (one call, not two) is used."""
        reused = cached or len(self.unique) < len(self.row_prompt)
        return bool(self.groups) or (reused and max(len(p) for p in self.unique) >= min_len)


def plan_prefixes(prompt_ids: Tensor, prompt_mask: Tensor, min_len: int) -> PrefixPlan:
    """Deduplicate rows by their real prompt tokens and group unique prompts through a `PrefixTrie`."""
    key = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)  # pad slots may hold any id: zero them
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    width = prompt_ids.shape[1]
    prompts = []
    for row in unique.tolist():
        tokens = tuple(t for t, m in zip(row[:width], row[width:], strict=True) if m)
        if not tokens:
            raise ValueError("a rollout row has an empty prompt; every prompt needs at least one token")
        prompts.append(tokens)
    return plan_of(prompts, inverse.tolist(), min_len)


def plan_of(prompts: Sequence[tuple[int, ...]], row_prompt: list[int], min_len: int) -> PrefixPlan:
    trie = PrefixTrie()
    for tokens in prompts:
        trie.insert(tokens)
    return PrefixPlan(trie.prompts, row_prompt, trie.groups(min_len))
