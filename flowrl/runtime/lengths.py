"""How well response lengths can be predicted before generation (flowrl.runtime): one `LengthPredictor`
(flowrl.elastic) per generate node, fed each step with its prompts' ids and their samples' lengths.

Each step, before it learns the new lengths, the predictor's guess per prompt is ranked against the prompt's mean
response length: `NODE/length_spearman` in metrics.jsonl (left out while the guesses cannot rank, e.g. at the
first step, when no prompt has been seen). It is what length-ranked assignment and the instance-count choice of
elastic pools rest on. Its state goes into checkpoints, so a resumed run reports what an uninterrupted one does.

`record` also returns the step's lengths as rows for the run directory's `lengths.jsonl` (one per generate node
and step: the prompts' data-set ids, their lengths in tokens, and their samples' response lengths): the trace a
simulator replays at scale, so every policy sees the same content.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flowrl.elastic import LengthPredictor, spearman
from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch


class LengthTracker:
    def __init__(self, graph: Graph, window: int = 4):
        self.nodes = [(n.id, str(n.input("prompts"))) for n in graph.nodes if n.op == "generate"]
        self.predictors = {node: LengthPredictor(window=window) for node, _ in self.nodes}

    def record(self, values: Mapping[str, Batch], step: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Score last steps' predictions against this step's rollouts, then learn from them; returns the metrics
        and the step's `lengths.jsonl` rows."""
        out: dict[str, float] = {}
        rows: list[dict[str, Any]] = []
        for node, prompts in self.nodes:
            if node not in values or prompts not in values or "prompt_id" not in values[prompts].meta \
                    or "group_id" not in values[node].tensors:
                continue
            rollout = values[node]
            ids = list(values[prompts].meta["prompt_id"])
            lengths = rollout["response_mask"].sum(1).tolist()
            groups = rollout["group_id"].tolist()
            prompt_lens = rollout["prompt_mask"].sum(1).tolist() if "prompt_mask" in rollout.tensors else None
            per_prompt: dict[int, list[float]] = {}
            prompt_len: dict[int, int] = {}
            for row, (g, n) in enumerate(zip(groups, lengths, strict=True)):
                per_prompt.setdefault(int(g), []).append(float(n))
                if prompt_lens is not None:
                    prompt_len.setdefault(int(g), int(prompt_lens[row]))
            order = sorted(per_prompt)
            rows.append({"step": step, "node": node, "prompt_id": [ids[g] for g in order],
                         "prompt_len": [prompt_len.get(g) for g in order],
                         "response_len": [[int(n) for n in per_prompt[g]] for g in order]})
            predictor = self.predictors[node]
            guess = predictor.predict([ids[g] for g in order], fallback=0.0)
            rho = spearman(guess, [sum(per_prompt[g]) / len(per_prompt[g]) for g in order])
            if math.isfinite(rho):
                out[f"{node}/length_spearman"] = rho
            predictor.observe([ids[int(g)] for g in groups], lengths)
        return out, rows

    def state_dict(self) -> dict[str, Any]:
        return {node: p.state_dict() for node, p in self.predictors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for node, saved in state.items():
            if node in self.predictors:
                self.predictors[node].load_state_dict(saved)
