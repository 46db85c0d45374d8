"""A run's model exported from one of its checkpoints as a Hugging Face directory (flowrl.runtime): which model (the
policy the run trains, by default), the `ModelSpec` it was built from (read from the run's graph.json), its whole
weights (flowrl.runtime.carry: also a DeepSpeed ZeRO-3 model's), and the hook of `run { export }`, which writes
OUT/hf/MODEL/ at the run's last checkpoint ("final") or at each ("every").

`flowrl export` finds the run, stage and checkpoint (flowrl.runtime.export_run) and exports through here; the
weights become a directory in flowrl.models.export.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph
from flowrl.ir.printer import to_json
from flowrl.models.build import ModelSpec
from flowrl.models.export import Exported, export_model, weights_dtype
from flowrl.runtime.carry import checkpoint_weights

__all__ = ["EXPORT_DIR", "export_at_checkpoint", "default_model", "export_checkpoint", "spec_of", "trained_models"]

EXPORT_DIR = "hf"  # `run { export }` writes OUT/hf/MODEL/


def trained_models(graph: Mapping[str, Any]) -> list[str]:
    """The models a run's graph (graph.json's object) updates, in the order of their update nodes."""
    names = [str(n["model"]) for n in graph.get("nodes", []) if n.get("op") == "update" and n.get("model")]
    return list(dict.fromkeys(names))


def default_model(graph: Mapping[str, Any]) -> str | None:
    """The model exported when none is named: the policy the run trains, else the model it trains (a reward
    model's run), else its first policy, else its first model; None for a graph without models."""
    models = {str(m["name"]): m for m in graph.get("models", [])}
    trained = trained_models(graph)
    policies = [n for n, m in models.items() if m.get("role") == "policy"]
    for choice in ([n for n in trained if n in policies], trained, policies, list(models)):
        if choice:
            return choice[0]
    return None


def spec_of(graph: Mapping[str, Any], model: str, weights: Mapping[str, Tensor]) -> ModelSpec:
    """The `ModelSpec` `model` of a run's graph was built from: its role and config, and the source of the model it
    comes from (`source = actor` follows actor back to a `tiny:`/`hf:` source); dtype: its weights'."""
    models = {str(m["name"]): m for m in graph.get("models", [])}
    entry = origin = models[model]
    seen = {model}
    while str(origin["source"]) in models and str(origin["source"]) not in seen:
        seen.add(str(origin["source"]))
        origin = models[str(origin["source"])]
    config = {str(k): v for k, v in dict(entry.get("config") or {}).items()}
    return ModelSpec(source=str(origin["source"]), config=config, role=str(entry["role"]),
                     dtype=weights_dtype(weights))


def export_checkpoint(graph: Mapping[str, Any], checkpoint: Path, model: str, out: str | Path, *,
                      overwrite: bool = False) -> Exported:
    """`model` of the run whose graph is `graph` (graph.json's object), with its weights at `checkpoint`, written to
    `out` as a Hugging Face directory."""
    weights = checkpoint_weights(checkpoint).get(model)
    if weights is None:
        raise FlowError(Diagnostic(f"{checkpoint} holds no weights of `{model}`"))
    partial = sorted(k for k, v in weights.items() if v.numel() == 0)
    if partial:  # a ZeRO-3 placeholder with no gathered copy beside it
        raise FlowError(Diagnostic(f"{checkpoint} holds only partitions of `{model}` ({len(partial)} tensors empty, "
                                   f"e.g. {partial[0]}), not its whole weights",
                                   hint="a DeepSpeed ZeRO-3 model's checkpoint keeps its gathered weights in its "
                                        "trainer's state; this one has none"))
    return export_model(weights, spec_of(graph, model, weights), out, overwrite=overwrite)


def export_at_checkpoint(graph: Graph, out_dir: Path, checkpoint: Path | None, final: bool) -> Exported | None:
    """`run { export = "final" | "every" }` (the runner calls this after each checkpoint it writes, `final` at the
    run's last step): the run's default model at `checkpoint` to OUT/hf/MODEL/, replacing what an earlier
    checkpoint wrote there; nothing for `export = "none"`."""
    mode = str(graph.run.get("export", "none") or "none")
    if checkpoint is None or mode == "none" or (mode == "final" and not final):
        return None
    body = to_json(graph)
    model = default_model(body)
    if model is None:
        return None
    return export_checkpoint(body, checkpoint, model, out_dir / EXPORT_DIR / model, overwrite=True)
