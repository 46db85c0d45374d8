"""How well response lengths can be predicted before generation (flowrl.runtime): one `LengthPredictor`
(flowrl.elastic) per generate node, fed each step with its prompts' ids and their samples' lengths.

Each step, before it learns the new lengths, the predictor's guess per prompt is ranked against the prompt's mean
response length: `NODE/length_spearman` in metrics.jsonl (left out while the guesses cannot rank, e.g. at the
first step, when no prompt has been seen). It is what length-ranked assignment and the instance-count choice of
elastic pools rest on. Its state goes into checkpoints, so a resumed run reports what an uninterrupted one does.
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

    def record(self, values: Mapping[str, Batch]) -> dict[str, float]:
        """Score last steps' predictions against this step's rollouts, then learn from them."""
        out: dict[str, float] = {}
        for node, prompts in self.nodes:
            if node not in values or prompts not in values or "prompt_id" not in values[prompts].meta \
                    or "group_id" not in values[node].tensors:
                continue
            rollout = values[node]
            ids = list(values[prompts].meta["prompt_id"])
            lengths = rollout["response_mask"].sum(1).tolist()
            groups = rollout["group_id"].tolist()
            per_prompt: dict[int, list[float]] = {}
            for g, n in zip(groups, lengths, strict=True):
                per_prompt.setdefault(int(g), []).append(float(n))
            order = sorted(per_prompt)
            predictor = self.predictors[node]
            guess = predictor.predict([ids[g] for g in order], fallback=0.0)
            rho = spearman(guess, [sum(per_prompt[g]) / len(per_prompt[g]) for g in order])
            if math.isfinite(rho):
                out[f"{node}/length_spearman"] = rho
            predictor.observe([ids[int(g)] for g in groups], lengths)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {node: {"ewma": dict(p.ewma), "total": p.total, "count": p.count}
                for node, p in self.predictors.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for node, saved in state.items():
            if node in self.predictors:
                p = self.predictors[node]
                p.ewma, p.total, p.count = dict(saved["ewma"]), float(saved["total"]), int(saved["count"])
