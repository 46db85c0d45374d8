"""Model shapes for the simulator (flowrl.backends.sim): sizes that set FLOPs, weight bytes and KV bytes.

A shape comes from a flow's model declaration (a tiny config's layers/dim/heads, or an `hf:` directory's
config.json), from an HF config.json directory given on the command line, or from the built-in table of
well-known shapes by name (`flowrl simulate --model actor=qwen2.5-7b`). A reference or another copy (`source =
actor`) takes its source model's shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError

BYTES = 2  # bf16 weights, activations and KV cache


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool = True  # SwiGLU (3 MLP matrices, Llama/Qwen) or a plain MLP (2, GPT-2)
    tied: bool = False  # input and output embeddings shared

    @property
    def params(self) -> float:
        head_dim = self.hidden // self.heads
        attn = self.hidden * (self.hidden + 2 * self.kv_heads * head_dim) + self.hidden * self.hidden
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return float(self.layers * (attn + mlp) + self.vocab * self.hidden * (1 if self.tied else 2))

    @property
    def weight_bytes(self) -> float:
        return self.params * BYTES

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * (self.hidden // self.heads) * BYTES

    def flops_per_token(self, context: float = 0.0) -> float:
        """Forward FLOPs for one token attending to `context` earlier tokens."""
        return 2.0 * self.params + 4.0 * self.layers * self.hidden * context


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int,
           tied: bool = False) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv, ffn, vocab, True, tied)


KNOWN: dict[str, ModelShape] = {s.name: s for s in (
    _llama("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True),
    _llama("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied=True),
    _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000),
    _llama("llama-33b", 60, 6656, 52, 52, 17920, 32000),
    _llama("llama-65b", 80, 8192, 64, 64, 22016, 32000),
)}


def known(name: str) -> ModelShape:
    shape = KNOWN.get(name.lower())
    if shape is None:
        raise FlowError(Diagnostic(f"no built-in model shape {name!r}",
                                   hint=f"one of {', '.join(KNOWN)}, or a directory holding an HF config.json"))
    return shape


def from_hf_config(cfg: Mapping[str, Any], name: str) -> ModelShape:
    """An HF config.json's shape (Llama/Qwen/Mistral keys, or GPT-2's n_layer/n_embd/n_head)."""
    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise FlowError(Diagnostic(f"{name}: config.json has none of {', '.join(keys)}"))
        return default
    layers, hidden = int(get("num_hidden_layers", "n_layer")), int(get("hidden_size", "n_embd"))
    heads = int(get("num_attention_heads", "n_head"))
    gpt2 = "n_embd" in cfg
    return ModelShape(name, layers, hidden, heads, int(get("num_key_value_heads", default=heads)),
                      int(get("intermediate_size", "n_inner", default=4 * hidden)), int(get("vocab_size")),
                      gated=not gpt2, tied=bool(cfg.get("tie_word_embeddings", gpt2)))


def from_dir(path: str | Path, name: str | None = None) -> ModelShape:
    file = Path(path) / "config.json"
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except OSError:
        raise FlowError(Diagnostic(f"no config.json in {path}", hint="an HF model directory, or a built-in "
                                   f"shape name ({', '.join(KNOWN)})")) from None
    except json.JSONDecodeError as e:
        raise FlowError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
    return from_hf_config(cfg, name or Path(path).name)


def resolve(spec: str) -> ModelShape:
    """A `--model NAME=SPEC` value: a built-in shape name or an HF model directory."""
    return from_dir(spec) if Path(spec).is_dir() else known(spec)


def from_decl(model: Mapping[str, Any], models: Mapping[str, Mapping[str, Any]]) -> ModelShape:
    """The shape of a model as graph.json declares it (see `flowrl.ir.printer.to_json`)."""
    source = str(model["source"])
    if source in models and source != model["name"]:  # `source = actor`: the same network
        return from_decl(models[source], models)
    if source.startswith("hf:"):
        return from_dir(source[3:], model["name"])
    if source.startswith("tiny:"):
        c = model.get("config", {})
        layers, dim, heads = int(c["layers"]), int(c["dim"]), int(c["heads"])
        charset = c.get("charset")
        vocab = max(int(c.get("vocab", 0)), len(str(charset)) + 4 if charset else 260)
        gpt2 = source == "tiny:gpt2"
        return ModelShape(f"{model['name']} ({source})", layers, dim, heads, heads, 4 * dim, vocab,
                          gated=not gpt2, tied=gpt2)
    raise FlowError(Diagnostic(f"model {model['name']}: cannot tell the shape of source {source!r}",
                               hint="give it with --model NAME=SHAPE (a built-in name or an HF directory)"))
