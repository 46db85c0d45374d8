"""What a model's source and config need before anything is built (flowrl.models): a tiny config that makes a
model, a local Hugging Face directory that can be loaded, a device this machine has. Torch-free (but for a
device other than auto and cpu), so `flowrl check` calls the same functions `build_model` raises from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from flowrl.models.tokenizer import ByteTokenizer, CharTokenizer

__all__ = ["device_problem", "hf_model_type", "hf_positions", "hf_score_head", "hf_source_problem",
           "tiny_shape_problem", "tiny_tokenizer"]


def tiny_shape_problem(family: str, config: Mapping[str, object]) -> tuple[str, str] | None:
    """(the key to blame, why) when a tiny config cannot make a model (checked by `flowrl check` too), else None."""
    dim, heads = config.get("dim", 64), config.get("heads", 4)
    if isinstance(dim, int) and isinstance(heads, int) and dim > 0 and heads > 0:
        if dim % heads:
            return "heads", f"`dim = {dim}` is not divisible by `heads = {heads}`"
        if family == "llama" and (dim // heads) % 2:
            return "heads", (f"tiny:llama's rotary embedding needs an even head size, and `dim = {dim}` over "
                             f"`heads = {heads}` is {dim // heads}")
    return None


def hf_source_problem(path: str) -> str | None:
    """Why the local Hugging Face directory `path` cannot be loaded (no directory, no config.json), else None."""
    if not os.path.isdir(path):
        return "directory not found" if not os.path.exists(path) else "not a directory"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "no config.json in the directory"
    return None


def _hf_config(path: str) -> dict[str, object]:
    """A local HF checkpoint's config.json ({} when it cannot be read)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def hf_positions(path: str) -> int | None:
    """The positions (context length) a local HF checkpoint's config.json declares, if it says."""
    cfg = _hf_config(path)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:  # `true` is no context
            return value
    return None


def hf_model_type(path: str) -> str | None:
    """A local HF checkpoint's architecture family (config.json's `model_type`: "gpt2", "llama", "qwen2"...)."""
    kind = _hf_config(path).get("model_type")
    return kind if isinstance(kind, str) and kind else None


def hf_score_head(path: str) -> bool:
    """Whether a local HF checkpoint is a one-label sequence classifier (`...ForSequenceClassification`, one
    label), as TRL's RewardTrainer trains a reward model: its `score` head gives the reward."""
    cfg = _hf_config(path)
    archs = cfg.get("architectures")
    id2label = cfg.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) and id2label else cfg.get("num_labels", 2)
    return (isinstance(archs, list) and any(str(a).endswith("ForSequenceClassification") for a in archs)
            and labels == 1)


def device_problem(device: str) -> tuple[str, str] | None:
    """(why, what to write instead) when `device` cannot be used on this machine, else None."""
    if device in ("auto", "cpu"):
        return None
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        return f"unknown device \"{device}\"", 'write `device = "auto"`, `"cpu"` or `"cuda"` (or `"cuda:N"`)'
    import torch  # only for a device other than auto and cpu: checking a flow needs no torch otherwise

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        return (f"device \"{device}\" is not available on this machine: torch {torch.__version__} is {build}",
                'write `device = "auto"` (a GPU when there is one, else the CPU) or `"cpu"`')
    if index and int(index) >= torch.cuda.device_count():
        return (f"device \"{device}\" is not available: this machine has {torch.cuda.device_count()} CUDA devices",
                'write `device = "cuda"`')
    return None


def tiny_tokenizer(config: Mapping[str, object]) -> ByteTokenizer | CharTokenizer:
    """A tiny model's tokenizer: characters of `charset`, else UTF-8 bytes."""
    charset = config.get("charset")
    return CharTokenizer(str(charset)) if charset else ByteTokenizer()
