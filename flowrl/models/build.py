"""Model construction for flowrl (flowrl.models): turns a `ModelSpec` into a torch module plus tokenizer.

Sources: `tiny:gpt2` / `tiny:llama` build a randomly initialised HF causal LM from a few keys (no files, for tests
and CPU runs); `hf:/abs/path` loads a local HF checkpoint (never downloads). Critics and reward models wrap the
LM's base transformer in `ValueModel` (backbone + scalar head, verl-style; from a reward model's checkpoint,
a one-label `...ForSequenceClassification`, the head is its `score`). Every model is returned in eval mode:
RLHF trains with dropout off so rollout log-probs and training log-probs come from the same function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flowrl.models.attention import install as install_attention
from flowrl.models.sources import hf_score_head, hf_source_problem, tiny_shape_problem, tiny_tokenizer
from flowrl.models.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer

__all__ = ["ROLES", "SOURCES", "LoadedModel", "ModelSpec", "ValueModel", "build_model", "cache_kw", "copy_backbone",
           "tiny_config"]

SOURCES = ("tiny:gpt2", "tiny:llama", "hf:/abs/path")
ROLES = ("policy", "reference", "critic", "reward_model")
_VALUE_ROLES = ("critic", "reward_model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TINY_KEYS = {"layers", "dim", "heads", "vocab", "context", "dropout", "charset"}


@dataclass(frozen=True)
class ModelSpec:
    """What to build: `source` picks the weights, `config` sizes tiny models, `role` picks the head."""

    source: str
    config: Mapping[str, object] = field(default_factory=dict)
    role: str = "policy"
    dtype: str = "float32"


@dataclass(frozen=True)
class LoadedModel:
    """A built model; `kind` is "causal_lm" (policy/reference) or "value" (critic/reward_model)."""

    module: nn.Module
    tokenizer: Tokenizer
    kind: str


class ValueModel(nn.Module):
    """A causal LM's base transformer plus a linear value head; forward returns (B, T) values."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Exposed so engines can read model_type / attention implementation like they do for LMs.
        self.config = getattr(backbone, "config", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """With `cache` (a KV cache, updated in place), `input_ids` continue what it holds."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=cache is not None, **cache_kw(self.backbone, cache),
        )
        hidden = out.last_hidden_state  # (B, T, H)
        return self.value_head(hidden).squeeze(-1)  # (B, T)


def cache_kw(module: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that hands `module` a KV cache: `cache` where its forward takes it (transformers >= 5.2x,
    which deprecates the old name), else `past_key_values` (older releases, as vLLM's pin installs)."""
    inner: nn.Module = getattr(module, "module", module)  # DeepSpeed's engine wraps the model as `.module`
    return {_cache_param(type(inner).forward): cache}


@functools.cache
def _cache_param(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def build_model(spec: ModelSpec, seed: int) -> LoadedModel:
    """Build the model `spec` describes; `seed` fixes random init without touching global RNG state."""
    if spec.role not in ROLES:
        raise ValueError(f"unknown model role {spec.role!r}; expected one of {', '.join(ROLES)}")
    if spec.dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {spec.dtype!r}; expected one of {', '.join(_DTYPES)}")
    dtype = _DTYPES[spec.dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lm, tokenizer = _build_lm(spec, dtype)
        install_attention(lm)  # SDPA, with a faster one-query (decode) path on CPU
        module: nn.Module = lm
        kind = "causal_lm"
        if spec.role in _VALUE_ROLES:
            # The head is created inside the forked scope too, so its init is also a function of `seed`.
            module = ValueModel(_backbone_of(lm), int(lm.config.hidden_size)).to(dtype)
            kind = "value"
            if type(lm).__name__.endswith("ForSequenceClassification"):  # a reward model's checkpoint (_build_lm)
                _take_score_head(module, lm)
    module.eval()
    if spec.role == "reference":
        module.requires_grad_(False)
    return LoadedModel(module=module, tokenizer=tokenizer, kind=kind)


def copy_backbone(dst: nn.Module, src: nn.Module) -> int:
    """Copy `src`'s weights into `dst` where they correspond (step-0 init of reference/critic from the actor).

    LM -> LM copies every tensor (lm_head included); any pairing with a `ValueModel` copies the base transformer
    only, leaving the value head alone. Returns the number of tensors copied; raises `ValueError` when a
    destination backbone tensor has no same-named, same-shaped source.
    """
    lm_to_lm = not isinstance(dst, ValueModel) and not isinstance(src, ValueModel)
    dst_part = dst if lm_to_lm else _backbone_of(dst)
    src_part = src if lm_to_lm else _backbone_of(src)
    src_state = src_part.state_dict()
    copied = 0
    missing: list[str] = []
    with torch.no_grad():
        for name, tensor in dst_part.state_dict().items():
            source = src_state.get(name)
            if source is None or source.shape != tensor.shape:
                missing.append(name)
                continue
            tensor.copy_(source.to(dtype=tensor.dtype, device=tensor.device))
            copied += 1
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"copy_backbone: {len(missing)} tensors have no matching source ({shown})")
    return copied


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while the block runs:
    they would interleave with flowrl's progress output, once per model and rank."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _build_lm(spec: ModelSpec, dtype: torch.dtype) -> tuple[Any, Tokenizer]:
    source = spec.source
    if source in ("tiny:gpt2", "tiny:llama"):
        tokenizer = tiny_tokenizer(spec.config)
        return _tiny_lm(source.split(":", 1)[1], spec.config, tokenizer).to(dtype), tokenizer
    if source.startswith("hf:") and len(source) > 3:
        from transformers import AutoModelForCausalLM

        path = source[3:]
        problem = hf_source_problem(path)
        if problem is not None:  # before transformers, which would take the path for a hub repo id
            raise ValueError(f"cannot load {source}: {problem}")
        auto: Any = AutoModelForCausalLM
        if spec.role in _VALUE_ROLES and hf_score_head(path):
            from transformers import AutoModelForSequenceClassification

            auto = AutoModelForSequenceClassification  # loaded as a causal LM, its `score` head would be dropped
        with quiet_transformers():
            model = auto.from_pretrained(path, local_files_only=True, dtype=dtype)
        hf_tokenizer = HFTokenizer(path)
        _check_special_ids(source, hf_tokenizer, int(model.get_input_embeddings().num_embeddings))
        return model, hf_tokenizer
    raise ValueError(f"unknown model source {source!r}; expected one of {', '.join(SOURCES)}")


def _tiny_lm(family: str, config: Mapping[str, object], tokenizer: ByteTokenizer | CharTokenizer) -> Any:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    cfg = tiny_config(family, config, tokenizer)
    return GPT2LMHeadModel(cfg) if family == "gpt2" else LlamaForCausalLM(cfg)


def tiny_config(family: str, config: Mapping[str, object], tokenizer: ByteTokenizer | CharTokenizer) -> Any:
    """The Hugging Face config (`GPT2Config` or `LlamaConfig`) of the `tiny:FAMILY` model `config` describes, whose
    special ids are `tokenizer`'s: what `build_model` builds, and what `flowrl export` writes as config.json."""
    unknown = set(config) - _TINY_KEYS
    if unknown:
        raise ValueError(f"unknown tiny model keys {sorted(unknown)}; allowed: {sorted(_TINY_KEYS)}")
    # the defaults are the language's (flowrl.ir.signatures.MODEL_KEYS), for specs made without a flow
    layers, dim, heads = _int(config, "layers", 2), _int(config, "dim", 64), _int(config, "heads", 4)
    context = _int(config, "context", 512)
    dropout = float(config.get("dropout", 0.0))  # type: ignore[arg-type]
    vocab = max(_int(config, "vocab", tokenizer.vocab_size), tokenizer.vocab_size)
    problem = tiny_shape_problem(family, config)
    if problem is not None:
        raise ValueError(f"tiny:{family}: {problem[1]}")
    if family == "gpt2":
        from transformers import GPT2Config

        # gelu_pytorch_tanh is GPT-2's tanh-approximate GELU as one fused kernel (gelu_new is four ops).
        return GPT2Config(
            vocab_size=vocab, n_positions=context, n_embd=dim, n_layer=layers, n_head=heads,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
            activation_function="gelu_pytorch_tanh",
            bos_token_id=tokenizer.BOS, eos_token_id=tokenizer.EOS, pad_token_id=tokenizer.PAD,
        )  # fmt: skip
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
        attention_dropout=dropout,
        bos_token_id=tokenizer.BOS, eos_token_id=tokenizer.EOS, pad_token_id=tokenizer.PAD,
    )  # fmt: skip


def _int(config: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config {key!r} must be a positive int, got {value!r}")
    return value


def _check_special_ids(source: str, tokenizer: HFTokenizer, rows: int) -> None:
    """flowrl writes the pad, BOS and EOS ids into every batch itself: one past the model's embeddings (a token added
    to the tokenizer without resizing the model) would fail deep in a forward as an IndexError."""
    specials = {"pad": tokenizer.pad_id, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id}
    for name, i in specials.items():
        if i is not None and i >= rows:
            token = tokenizer.hf.convert_ids_to_tokens(i)
            raise ValueError(f"cannot load {source}: its tokenizer's {name} token {token!r} has id {i}, and the model "
                             f"has {rows} token embeddings (ids 0..{rows - 1}); resize the model's embeddings to the "
                             "tokenizer (`model.resize_token_embeddings(len(tokenizer))`) and save it again, or give "
                             f"the tokenizer a {name} token the model has")


def _take_score_head(value: ValueModel, lm: nn.Module) -> None:
    """`value`'s head from a one-label sequence classifier's `score` (a bias-free (1, H) linear: bias 0, or the
    `score_bias` config.json keeps where `flowrl export` could not fold a value head's bias, flowrl.models.export)."""
    score = getattr(lm, "score", None)
    if not isinstance(score, nn.Linear) or score.weight.shape != value.value_head.weight.shape:
        raise ValueError(f"cannot find the one-label `score` head of {type(lm).__name__} to score with")
    kept = getattr(getattr(lm, "config", None), "score_bias", None)
    bias = float(kept) if isinstance(kept, (int, float)) and not isinstance(kept, bool) else 0.0
    with torch.no_grad():
        value.value_head.weight.copy_(score.weight)
        value.value_head.bias.copy_(score.bias if score.bias is not None else torch.full_like(value.value_head.bias, bias))


def _backbone_of(module: nn.Module) -> nn.Module:
    """The base transformer (no LM head) of a HF causal LM or a ValueModel."""
    if isinstance(module, ValueModel):
        return module.backbone
    base = getattr(module, "base_model", None)
    if isinstance(base, nn.Module) and base is not module:
        return base
    raise ValueError(f"cannot find the base transformer of {type(module).__name__}")
