"""A flowrl model's weights as a Hugging Face directory (flowrl.models): config.json, model.safetensors, the
tokenizer's files and generation_config.json, which transformers loads with no flowrl import.

`export_model(weights, spec, out)` takes a model's state dict as flowrl holds it (a checkpoint's, read by
flowrl.runtime.export) and the `ModelSpec` it was built from:

- a policy or reference is its own causal LM (`GPT2LMHeadModel` for `tiny:gpt2`, `LlamaForCausalLM` for
  `tiny:llama`, the source's architecture for `hf:`), weights as they are;
- a critic or reward model (`ValueModel`: backbone + a linear value head with a bias) is the backbone's
  `...ForSequenceClassification` with one label, the value head as its `score`. HF's `score` has no bias: where the
  backbone ends in a LayerNorm with a bias (GPT-2), the head's bias is folded into it exactly (the norm's output feeds
  only `score` in a classifier: `w·(h + b·w/|w|²) = w·h + b`); elsewhere (RMSNorm: Llama, Qwen) no weight can carry
  a constant, so transformers' scores are flowrl's minus the bias, which config.json keeps as `score_bias` (flowrl's
  `hf:` loader adds it back, flowrl.models.build) and `Exported.notes` says so;
- the tokenizer is the source directory's files, copied as they are (chat template included), or flowrl's tiny
  tokenizer converted (flowrl.models.hf_tokenizer);
- the dtype is the weights'.

Weights + spec in, a directory out: a caller that holds other weights (adapters merged first) uses the same function.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import Diagnostic, FlowError
from flowrl.models.build import ModelSpec, quiet_transformers, tiny_config
from flowrl.models.hf_tokenizer import save_hf_tokenizer
from flowrl.models.sources import hf_source_problem, tiny_tokenizer
from flowrl.models.tokenizer import HFTokenizer

__all__ = ["TOKENIZER_FILES", "VALUE_ROLES", "Exported", "check_out", "export_model", "out_problem", "weights_dtype"]

VALUE_ROLES = ("critic", "reward_model")
BACKBONE, HEAD = "backbone.", "value_head."  # where flowrl.models.build.ValueModel keeps its parts
# What a Hugging Face directory's tokenizer may consist of (slow and fast, chat templates): copied from an `hf:` source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
_FINAL_NORMS = ("ln_f", "norm", "final_layer_norm", "final_layernorm", "norm_f")  # a backbone's last module, by family
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Exported:
    """What `export_model` wrote: the directory, its architecture (config.json's), dtype and anything a user of the
    directory should know (a value head's bias transformers leaves out)."""

    path: Path
    architecture: str
    dtype: str
    notes: tuple[str, ...] = ()


def out_problem(out: Path, overwrite: bool) -> tuple[str, str] | None:
    """(why, what to do) when `export_model` would refuse to write to `out`, else None: a non-empty directory is
    replaced only with `overwrite`, and only when it is a model directory (config.json), so a mistyped -o never
    empties another one."""
    new = "choose a new or empty directory"
    if not out.exists():
        return None
    if not out.is_dir():
        return "it is a file", new
    if not any(out.iterdir()):
        return None
    if not overwrite:
        return "it is not empty", f"{new}, or replace the model directory there with --overwrite"
    if not (out / "config.json").is_file():
        return "it is not empty and is not a model directory (no config.json), so --overwrite leaves it alone", new
    return None


def check_out(out: Path, overwrite: bool) -> None:
    """Raise `FlowError` where `export_model` would refuse to write to `out` (`out_problem`)."""
    problem = out_problem(out, overwrite)
    if problem is not None:
        raise FlowError(Diagnostic(f"cannot write the export to {out}: {problem[0]}", hint=problem[1]))


def export_model(weights: Mapping[str, Tensor], spec: ModelSpec, out: str | Path, *,
                 overwrite: bool = False, untie: bool = False) -> Exported:
    """Write `weights` (a state dict of the model `spec` builds) to `out` as a Hugging Face directory (see the module
    docstring); raises `FlowError` for what a user can fix (where to write, a source directory gone). `untie`: the
    output layer's weights are its own, not the input embeddings' (a merged LoRA adapter on a tied `lm_head`)."""
    out = Path(out)
    check_out(out, overwrite)
    dtype = _dtype_of(weights)
    config, tokenizer_from = _config(spec)
    if untie:
        config.tie_word_embeddings = False
    notes: list[str] = []
    with quiet_transformers(), torch.random.fork_rng(devices=[]):  # from_config initialises weights we overwrite
        if spec.role in VALUE_ROLES:
            model = _classifier(config, weights, dtype, spec, notes)
        else:
            model = _causal_lm(config, weights, dtype)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"  # beside `out`: the rename below stays on one disk
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            # save_pretrained imports DeepSpeed where it is installed, whose import logs to stdout (where the CLI
            # prints its result); its logger keeps the stream it found, so later warnings go to stderr too
            with contextlib.redirect_stdout(sys.stderr):
                model.save_pretrained(str(tmp))
            tokenizer_from(tmp)
            if spec.role not in VALUE_ROLES:
                _write_generation_config(tmp, spec)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)  # readers never see half a directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, type(model).__name__, _DTYPES[dtype], tuple(notes))


def weights_dtype(weights: Mapping[str, Tensor]) -> str:
    """The dtype of a model's weights, as `ModelSpec.dtype` names it ("float32", "bfloat16", "float16")."""
    return _DTYPES[_dtype_of(weights)]


def _dtype_of(weights: Mapping[str, Tensor]) -> torch.dtype:
    floats = {t.dtype for t in weights.values() if t.is_floating_point()}
    if len(floats) != 1 or next(iter(floats)) not in _DTYPES:
        raise ValueError(f"cannot export weights of dtypes {sorted(map(str, floats))}: a model has one of "
                         f"{', '.join(_DTYPES.values())}")
    return floats.pop()


def _config(spec: ModelSpec) -> tuple[Any, Any]:
    """The causal LM's config of `spec` and a function writing its tokenizer into a directory."""
    if spec.source in ("tiny:gpt2", "tiny:llama"):
        tok = tiny_tokenizer(spec.config)
        config = tiny_config(spec.source.split(":", 1)[1], spec.config, tok)
        context = int(config.max_position_embeddings)  # GPT2Config maps it to n_positions
        return config, lambda where: save_hf_tokenizer(tok, where, context)
    if spec.source.startswith("hf:") and len(spec.source) > 3:
        from transformers import AutoConfig

        path = spec.source[3:]
        problem = hf_source_problem(path)
        if problem is not None:
            raise FlowError(Diagnostic(f"cannot export a model from {spec.source}: {problem}",
                                       hint="the export takes the architecture and the tokenizer from the source "
                                            "directory the run started from; restore it there"))
        return AutoConfig.from_pretrained(path, local_files_only=True), lambda where: _copy_tokenizer(path, where)
    raise ValueError(f"cannot export a model from source {spec.source!r}")


def _copy_tokenizer(source: str, where: Path) -> None:
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), where / name)
    templates = os.path.join(source, "additional_chat_templates")  # transformers' named chat templates
    if os.path.isdir(templates):
        shutil.copytree(templates, where / "additional_chat_templates")


def _causal_lm(config: Any, weights: Mapping[str, Tensor], dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _load(model, weights, "the model")
    return model.eval()


def _classifier(config: Any, weights: Mapping[str, Tensor], dtype: torch.dtype, spec: ModelSpec,
                notes: list[str]) -> Any:
    """The backbone + value head of a `ValueModel` as a one-label `...ForSequenceClassification`."""
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        # transformers' classifier scores each row's last token that is not pad: it needs the id (TRL sets it too)
        config.pad_token_id = _flowrl_tokenizer_ids(spec)[2]
    if hasattr(config, "score_bias"):  # an exported reward model's, re-exported: this head's bias replaces it
        del config.score_bias
    try:
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    except ValueError as e:
        raise FlowError(Diagnostic(f"cannot export a {spec.role} of {getattr(config, 'model_type', '?')}: "
                                   f"transformers has no sequence classifier for it ({e})")) from None
    score = getattr(model, "score", None)
    if not isinstance(score, nn.Linear) or score.bias is not None:
        raise FlowError(Diagnostic(f"cannot export a {spec.role} as {type(model).__name__}: it has no bias-free "
                                   "`score` layer to hold the value head"))
    backbone = {k.removeprefix(BACKBONE): v for k, v in weights.items() if k.startswith(BACKBONE)}
    _load(model.base_model, backbone, "the backbone")
    head_w, head_b = weights[HEAD + "weight"], weights[HEAD + "bias"]  # (1, H), (1,)
    with torch.no_grad():
        score.weight.copy_(head_w)
        bias = float(head_b.float().item())
        if bias != 0.0 and not _fold_bias(model.base_model, head_w[0], head_b[0]):
            config.score_bias = bias
            notes.append(f"the value head's bias ({bias:.6g}) is not in transformers' `score`, which has none, and "
                         f"{type(model.base_model).__name__} ends in a norm without a bias to fold it into: its scores "
                         f"are flowrl's {'minus' if bias > 0 else 'plus'} {abs(bias):.6g} (a constant: rankings and "
                         "preference probabilities are unchanged); config.json keeps it as `score_bias`, which "
                         "flowrl's `hf:` loader adds back")
    return model.eval()


def _fold_bias(backbone: nn.Module, weight: Tensor, bias: Tensor) -> bool:
    """Fold the head's bias into the backbone's final LayerNorm bias (see the module docstring); False when the
    backbone does not end in one (or the head's weight is zero)."""
    norm = next((m for name in _FINAL_NORMS if isinstance(m := getattr(backbone, name, None), nn.LayerNorm)), None)
    w = weight.double()  # (H,)
    square = float(w @ w)
    if norm is None or norm.bias is None or square == 0.0:
        return False
    norm.bias.copy_((norm.bias.double() + bias.double() * w / square).to(norm.bias.dtype))
    return True


def _load(module: nn.Module, state: Mapping[str, Tensor], what: str) -> None:
    ours = module.state_dict()
    missing = sorted(set(ours) - set(state))
    extra = sorted(set(state) - set(ours))
    shaped = sorted(k for k in set(ours) & set(state) if ours[k].shape != state[k].shape)
    if missing or extra or shaped:
        raise ValueError(f"the weights do not fit {what} ({type(module).__name__}): missing {missing[:4]}, "
                         f"unexpected {extra[:4]}, shaped differently {shaped[:4]}")
    module.load_state_dict({k: v.to(ours[k].dtype) for k, v in state.items()})


def _flowrl_tokenizer_ids(spec: ModelSpec) -> tuple[int | None, int, int]:
    """(bos, eos, pad) as flowrl uses them for `spec` (an HF tokenizer without pad pads with EOS)."""
    if spec.source.startswith("hf:"):
        tok: Any = HFTokenizer(spec.source[3:])
    else:
        tok = tiny_tokenizer(spec.config)
    return tok.bos_id, tok.eos_id, tok.pad_id


def _write_generation_config(where: Path, spec: ModelSpec) -> None:
    """generation_config.json: an `hf:` source's own (its sampling defaults are its authors'; copied as written, not
    re-validated by this transformers), else the one transformers made from the config; the bos, eos and pad ids
    flowrl generates with filled in where it leaves them out."""
    path = where / "generation_config.json"
    source = Path(spec.source[3:]) / "generation_config.json" if spec.source.startswith("hf:") else None
    read = source if source is not None and source.is_file() else path
    body = json.loads(read.read_text(encoding="utf-8")) if read.is_file() else {}
    bos, eos, pad = _flowrl_tokenizer_ids(spec)
    for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if body.get(key) is None and value is not None:
            body[key] = value
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
