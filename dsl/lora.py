"""Checks of a model's LoRA keys (lowering, from `dsl.checks.check_flow`): adapters on a model that trains, the other
LoRA keys only with `lora_rank`, `lora_targets` of the right kind naming layers a tiny model has (an `hf:` model's
layers are named when it is built: flowrl.models.lora), and an engine that can run them. Located at the key or value
written; nothing is built.
"""

from __future__ import annotations

from flowrl.ir.graph import ModelDecl
from flowrl.models.lora_spec import ALL_LINEAR, LORA_KEYS, OUTPUT_HEAD, TINY_LINEAR, unmatched_targets

from . import ast
from .checks import Flow
from .diagnostics import Reporter, did_you_mean
from .keys import Entry


def check_lora(rep: Reporter, flow: Flow) -> None:
    by_name = {m.name: m for m in flow.models}
    for m in flow.models:
        block = flow.model_blocks.get(m.name, {})
        rank = block.get("lora_rank")
        if rank is None:
            for key in LORA_KEYS:
                if key in block:
                    at = block[key]
                    rep.error(at.src, f"`{key}` needs `lora_rank`", at.entry.key,
                              hint=f"`lora_rank = 8` trains adapters of rank 8 on `{m.name}`'s frozen weights; "
                                   f"without it `{m.name}` trains every weight")
            continue
        if not m.trainable:
            rep.error(rank.src, f"`lora_rank` on `{m.name}`, which does not train: LoRA adapters are weights an "
                                "update trains", rank.entry.key, hint=_untrained_hint(m, by_name))
            continue
        if m.engine == "vllm":
            rep.error(rank.src, f"`{m.name}` has LoRA adapters and engine \"vllm\", which generates from a copy of "
                                "the whole weights that flowrl replaces after each update", rank.entry.key,
                      hint="use engine = \"torch\" with LoRA")
        targets = block.get("lora_targets")
        if targets is not None:
            _check_targets(rep, m, targets)


def _untrained_hint(m: ModelDecl, by_name: dict[str, ModelDecl]) -> str:
    src = by_name.get(m.source_model or "")
    if m.role == "reference" and src is not None and "lora_rank" in src.options and src.options["lora_rank"]:
        return (f"a reference whose source is a LoRA policy is already that policy's base with the adapters off "
                f"(`{src.name}`'s weights, one copy): remove the LoRA keys from `{m.name}`")
    if m.role == "reference":
        return f"a reference never trains: remove the LoRA keys from `{m.name}`"
    return f"set `trainable = true` on `{m.name}`, or remove its LoRA keys"


def _check_targets(rep: Reporter, m: ModelDecl, at: Entry) -> None:
    value = at.entry.value
    items = list(value.items) if isinstance(value, ast.ListLit) else [value]
    if not items or not all(isinstance(i, ast.Literal) and isinstance(i.value, str) and i.value for i in items):
        rep.error(at.src, f"`lora_targets` must be \"{ALL_LINEAR}\", a module name or a list of module names",
                  value, hint='for example `lora_targets = ["q_proj", "v_proj"]`')
        return
    names = [str(i.value) for i in items if isinstance(i, ast.Literal)]
    if ALL_LINEAR in names:
        if len(names) > 1:
            rep.error(at.src, f"`lora_targets` lists \"{ALL_LINEAR}\" with module names", value,
                      hint=f"\"{ALL_LINEAR}\" alone adapts every linear layer but the output head")
        return
    layers = TINY_LINEAR.get(m.source)
    if layers is None:  # an hf: model: its layers are known once it is built (flowrl.models.lora.resolve_targets)
        return
    linear = (*layers, OUTPUT_HEAD) if m.role == "policy" else layers  # a value model's head trains whole
    for item, name in zip(items, names, strict=True):
        last = name.rsplit(".", 1)[-1]  # a dotted name's path inside the model is checked when it is built
        if unmatched_targets([last], linear):
            known = f"its linear modules are {', '.join(linear)} (or write \"{ALL_LINEAR}\")"
            guess = did_you_mean(last, linear)
            rep.error(at.src, f"`lora_targets` names \"{name}\", which matches no linear module of {m.source}", item,
                      hint=f"{guess} {known}" if guess else known)
