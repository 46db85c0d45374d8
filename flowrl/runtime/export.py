"""A run's model exported from one of its checkpoints as a Hugging Face directory (flowrl.runtime): which model (the
policy the run trains, by default), the `ModelSpec` it was built from (read from the run's graph.json), its whole
weights (flowrl.runtime.carry: also a DeepSpeed ZeRO-3 model's), and the hook of `run { export }`, which writes
OUT/hf/MODEL/ at the run's last checkpoint ("final") or at each ("every").

`flowrl export` finds the run, stage and checkpoint (flowrl.runtime.export_run) and exports through here; the
weights become a directory in flowrl.models.export.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor

from flowrl.errors import Diagnostic, FlowError, Loc
from flowrl.ir.graph import Graph, ModelDecl
from flowrl.ir.printer import to_json
from flowrl.models.build import ModelSpec
from flowrl.models.export import Exported, check_out, export_model, weights_dtype
from flowrl.models.lora import merged_state, save_adapter
from flowrl.models.lora_spec import LORA_KEYS, lora_spec
from flowrl.runtime.carry import checkpoint_weights, read_checkpoint
from flowrl.runtime.lora_state import load_module_state
from flowrl.runtime.model_init import init_model

__all__ = ["EXPORT_DIR", "default_model", "export_at_checkpoint", "export_checkpoint", "export_lora", "spec_of",
           "trained_models"]

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
                      overwrite: bool = False, adapter: bool = False) -> Exported:
    """`model` of the run whose graph is `graph` (graph.json's object), with its weights at `checkpoint`, written to
    `out` as a Hugging Face directory; a LoRA model's adapters merged into its base, or with `adapter` as a peft
    adapter directory (`export_lora`)."""
    entry = next(m for m in graph.get("models", []) if m["name"] == model)
    if "lora" in entry or "base_of" in entry:
        return export_lora(graph, checkpoint, model, out, overwrite=overwrite, adapter=adapter)
    if adapter:
        raise FlowError(Diagnostic(f"`{model}` has no LoRA adapters to write (--adapter writes a LoRA model's)",
                                   hint="leave --adapter out to write its weights"))
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


def export_lora(graph: Mapping[str, Any], checkpoint: Path, model: str, out: str | Path, *, overwrite: bool = False,
                adapter: bool = False) -> Exported:
    """A LoRA model (or a reference that is one's base): its base rebuilt as the run built it (from the source and
    the run's seed, flowrl.runtime.model_init; the checkpoint's digest says it is the same), its adapters loaded from
    `checkpoint` and merged into it (peft's merge), or with `adapter` written as a peft adapter directory over the
    base: the `hf:` source's directory, or for a `tiny:` source the base written beside them (OUT/base)."""
    decls = _decls(graph)
    decl, seed = decls[model], int(graph.get("run", {}).get("seed", 0))
    check_out(Path(out), overwrite)
    loaded = init_model(decl, decls, seed)
    if lora_spec(decl.options) is None:  # a reference on a LoRA policy: the base itself
        if adapter:
            raise FlowError(Diagnostic(f"`{model}` is the base of `{decl.source_model}` and holds no adapters",
                                       hint=f"--model {decl.source_model} --adapter writes the adapters"))
        weights = loaded.module.state_dict()
        return export_model(weights, spec_of(graph, model, weights), out, overwrite=overwrite)
    saved, bases = read_checkpoint(checkpoint)
    if model not in saved:
        raise FlowError(Diagnostic(f"{checkpoint} holds no weights of `{model}`"))
    load_module_state(model, loaded.module, saved[model], bases.get(model))
    if not adapter:
        weights, untied = merged_state(loaded.module)
        return export_model(weights, spec_of(graph, model, weights), out, overwrite=overwrite, untie=untied)
    if decl.role not in ("policy", "reference"):
        raise FlowError(Diagnostic(f"--adapter writes a policy's adapters, and `{model}` is a {decl.role}",
                                   hint="leave --adapter out: its adapters are merged into a one-label classifier"))
    base = init_model(replace(decl, options={k: v for k, v in decl.options.items() if k not in LORA_KEYS}),
                      decls, seed)
    out = Path(out)
    base_path = decl.source[3:] if decl.source.startswith("hf:") else str((out / "base").resolve())
    base_weights = base.module.state_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # beside `out`: nothing half-written lands there
        save_adapter(base.module, loaded.module, tmp, base_path)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(tmp, out)
    if not decl.source.startswith("hf:"):  # a tiny model's base exists nowhere else: written beside the adapters
        done = export_model(base_weights, spec_of(graph, model, base_weights), out / "base")
        notes = (f"the base the adapters go on is {done.path} ({done.architecture})",)
    else:
        notes = (f"the base the adapters go on is the run's source, {base_path}",)
    return Exported(out, "LoRA adapter (peft)", weights_dtype(base_weights), notes)


def _decls(graph: Mapping[str, Any]) -> dict[str, ModelDecl]:
    """The model declarations of a run's graph.json, as far as building them needs (the LoRA and dtype keys)."""
    models = {str(m["name"]): m for m in graph.get("models", [])}
    out: dict[str, ModelDecl] = {}
    for name, m in models.items():
        origin, seen = m, {name}
        while str(origin["source"]) in models and str(origin["source"]) not in seen:
            seen.add(str(origin["source"]))
            origin = models[str(origin["source"])]
        lora = m.get("lora") or {}
        options: dict[str, Any] = {"dtype": m.get("dtype", "float32")}
        if lora:
            targets = lora.get("targets")
            options.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                           lora_targets=tuple(targets) if isinstance(targets, list) and targets else
                           targets if isinstance(targets, str) else None)
        path, line, col = (str(m.get("loc", "?:0:0")).rsplit(":", 2) + ["0", "0"])[:3]
        src = str(m["source"])
        out[name] = ModelDecl(name=name, role=str(m["role"]), source=str(origin["source"]),
                              loc=Loc(path, int(line) if line.isdigit() else 0, int(col) if col.isdigit() else 0),
                              config=dict(m.get("config") or {}), source_model=src if src in models else None,
                              trainable=bool(m.get("trainable")), options=options)
    return out


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
