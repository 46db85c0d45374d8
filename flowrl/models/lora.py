"""LoRA adapters on a built model (flowrl.models), with peft: a trainable policy, critic or reward model whose
declaration has `lora_rank` trains low-rank adapters on its frozen weights, and a reference whose `source` is such a
policy computes with that policy's own weights, adapters off (verl and TRL do the same: `disable_adapter()` around the
reference's forward), so a process holds one copy of the base.

`apply_lora` injects the adapters into the module in place (`peft.inject_adapter_in_model`: the module keeps its class,
so every engine runs it as before) and returns its `Adapters`: the modules adapted, the parameters trained (the
adapters, and a value model's head), and a digest of the base, which a checkpoint keeps (only the trained tensors
travel and are saved; the base is rebuilt from the source and the seed, and the digest says whether it is the same).
`base_view` makes the reference: a module without parameters of its own whose forward runs the adapted model with
the adapters switched off. `AdapterSwitch` makes that safe where ranks run forwards on threads (the threads
backend): forwards of one kind run together, one of the other kind waits for them, then the adapters switch.

`import peft` happens only here, lazily, with an error naming the extra to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.models.build import cache_kw
from flowrl.models.lora_spec import LoraSpec, unmatched_targets

__all__ = ["INSTALL_HINT", "AdapterSwitch", "Adapters", "BaseView", "adapters_of", "apply_lora", "base_view",
           "import_peft", "linear_modules", "lora_config", "merged_state", "resolve_targets", "save_adapter"]

INSTALL_HINT = "pip install 'flowrl[lora]'"
_HEADS = ("lm_head", "value_head", "score")  # output layers: never adapted (peft's all-linear leaves them out too)
_BASE_LAYER = ".base_layer"  # where peft keeps an adapted layer's own weights


def import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError(f"LoRA (`lora_rank`) needs peft, which is not installed: {INSTALL_HINT}") from exc
    return peft


def linear_modules(module: nn.Module, heads: bool = False) -> list[str]:
    """Dotted names of `module`'s linear layers (torch's Linear, GPT-2's Conv1D) but its output heads; `heads`: with a
    causal LM's output layer (`lm_head`), which a target may name (a value head trains whole, never adapted)."""
    from transformers.pytorch_utils import Conv1D

    outputs = getattr(module, "get_output_embeddings", None)
    out = outputs() if callable(outputs) else None
    return [name for name, m in module.named_modules()
            if isinstance(m, (nn.Linear, Conv1D)) and (heads and name.rsplit(".", 1)[-1] == "lm_head"
                                                        or m is not out and name.rsplit(".", 1)[-1] not in _HEADS)]


def resolve_targets(module: nn.Module, spec: LoraSpec, family: str | None, what: str = "the model") -> list[str]:
    """The dotted names of the linear layers `spec` adapts in `module`; `ValueError` naming the layers there are when
    a target matches none (peft would drop it silently when another matches)."""
    wanted = () if spec.all_linear else spec.default_targets(family)
    if not wanted:
        return linear_modules(module)
    linear = linear_modules(module, heads=True)
    missing = unmatched_targets(wanted, linear)
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(f"`lora_targets` {', '.join(repr(t) for t in missing)} match no linear module of {what}; "
                         f"its linear modules are {', '.join(short)} (or write \"all-linear\")")
    return [n for n in linear if any(n == t or n.endswith("." + t) for t in wanted)]


def lora_config(spec: LoraSpec, targets: Sequence[str], module: nn.Module, **more: Any) -> Any:
    """peft's LoraConfig of `spec` on the layers `targets` names (GPT-2's Conv1D keep their weight transposed);
    `more`: further LoraConfig fields (an exported adapter's task type and base)."""
    from transformers.pytorch_utils import Conv1D

    peft = import_peft()
    named = dict(module.named_modules())
    conv = any(isinstance(named.get(t), Conv1D) for t in targets)
    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                           target_modules=list(targets), bias="none", fan_in_fan_out=conv, **more)


@contextlib.contextmanager
def _known_warnings() -> Iterator[None]:
    """peft's warnings about what flowrl handles: GPT-2's Conv1D beside Linear layers (peft sets `fan_in_fan_out` per
    layer), and an adapted `lm_head` tied to the embeddings (the adapter adds to the output alone; `merged_state`
    unties them for an export); and, saving adapters, no config yet at the base's path (an export writes the base
    after its adapters: the vocabulary is the base's own either way)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
        warnings.filterwarnings("ignore", message="Could not find a config file in")
        yield


class AdapterSwitch:
    """Which function of a LoRA model runs now: the adapted model's (adapters on) or its base's (off, for a reference
    sharing the weights). Forwards of one kind run at once; one of the other kind waits until they are done (and holds
    off new ones of theirs), then the adapters switch (peft's `enable_adapters` on every adapted layer). A forward
    inside one this thread runs (the base view calls the model) takes the outer one's kind."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = list(layers)
        self.cond = threading.Condition()
        self.on = True
        self.running = 0
        self.waiting = {True: 0, False: 0}
        self.local = threading.local()

    def enter(self, on: bool) -> None:
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        if depth:
            return
        with self.cond:
            self.waiting[on] += 1
            while self.running and (self.on != on or self.waiting[not on]):
                self.cond.wait()
            self.waiting[on] -= 1
            if self.on != on:
                for layer in self.layers:
                    layer.enable_adapters(on)
                self.on = on
            self.running += 1

    def exit(self) -> None:
        self.local.depth -= 1
        if self.local.depth:
            return
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    @contextlib.contextmanager
    def using(self, on: bool) -> Iterator[None]:
        self.enter(on)
        try:
            yield
        finally:
            self.exit()


@dataclass
class Adapters:
    """A LoRA model's adapters: its spec, the layers adapted, the parameters trained and the digest of its base."""

    spec: LoraSpec
    targets: tuple[str, ...]
    trainable: tuple[str, ...]  # parameter names: the adapters', and a value model's head
    digest: str
    switch: AdapterSwitch | None = None  # made with the first base view

    def state(self, module: nn.Module) -> dict[str, Tensor]:
        """The trained tensors of `module` (what a checkpoint and a weight sync hold), detached."""
        params = dict(module.named_parameters())
        return {name: params[name].detach() for name in self.trainable}

    def load(self, module: nn.Module, state: Mapping[str, Tensor]) -> None:
        """Load `state` (as `state` returns it) into `module`; `ValueError` when its tensors are not the trained ones."""
        missing, extra = sorted(set(self.trainable) - set(state)), sorted(set(state) - set(self.trainable))
        if missing or extra:
            raise ValueError(f"the weights are not this LoRA model's adapters: missing {missing[:3]}, "
                             f"unexpected {extra[:3]} ({len(state)} tensors given, {len(self.trainable)} trained)")
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name in self.trainable:
                params[name].copy_(state[name])

    def parameters(self, module: nn.Module) -> Iterator[nn.Parameter]:
        """`module`'s base parameters (every one it does not train)."""
        trained = set(self.trainable)
        return (p for n, p in module.named_parameters() if n not in trained)

    @contextlib.contextmanager
    def dropout(self, module: nn.Module) -> Iterator[None]:
        """`lora_dropout` in force while the block runs (an update): the adapters' dropout layers in training mode,
        the rest of the model in eval mode as flowrl runs it (old and new log-probs must come from one function)."""
        layers = [m for name, m in module.named_modules() if ".lora_dropout." in f".{name}." and
                  isinstance(m, nn.Dropout)] if self.spec.dropout > 0 else []
        for m in layers:
            m.train()
        try:
            yield
        finally:
            for m in layers:
                m.eval()


_ADAPTERS: weakref.WeakKeyDictionary[nn.Module, Adapters] = weakref.WeakKeyDictionary()


def adapters_of(module: nn.Module) -> Adapters | None:
    """The adapters `apply_lora` gave `module` (None for a model without)."""
    return _ADAPTERS.get(module)


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (`...c_attn.base_layer.weight` -> `...c_attn.weight`)."""
    return name.replace(_BASE_LAYER + ".", ".")


def base_digest(named: Iterator[tuple[str, Tensor]]) -> str:
    """A digest of a base's weights, by their names without adapters: each tensor's shape, dtype, sum and sum of
    squares in float64 (computed where the weights are, once per build: a different checkpoint or init shows)."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, t in sorted(named, key=lambda item: base_name(item[0])):
            x = t.detach().double()
            h.update(f"{base_name(name)}:{tuple(t.shape)}:{t.dtype}:{float(x.sum())!r}:{float((x * x).sum())!r};"
                     .encode())
    return h.hexdigest()


def apply_lora(module: nn.Module, spec: LoraSpec, *, family: str | None, seed: int, what: str = "the model") -> Adapters:
    """Inject `spec`'s adapters into `module` in place (their init a function of `seed`); only they, and a value
    model's head, stay trainable."""
    peft = import_peft()
    targets = resolve_targets(module, spec, family, what)
    head = [p for n, p in module.named_parameters() if n.split(".", 1)[0] == "value_head"]
    config = lora_config(spec, targets, module)
    with torch.random.fork_rng(devices=[]), _known_warnings():
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, module)
    for p in head:  # a critic's or reward model's new head is trained whole (peft froze it with the base)
        p.requires_grad_(True)
    trainable = tuple(n for n, p in module.named_parameters() if p.requires_grad)
    adapters = Adapters(spec, tuple(targets), trainable,
                        base_digest((n, p) for n, p in module.named_parameters() if n not in set(trainable)))
    _ADAPTERS[module] = adapters
    return adapters


class BaseView(nn.Module):
    """A LoRA model's base with the adapters off: a reference computing with the adapted model's own weights. It
    holds no parameters, state or submodules of its own (the adapted model is not registered in it): its
    `parameters()` are the base's, so helpers that ask a module for its device find them."""

    adapted: nn.Module
    adapters: Adapters

    def __init__(self, adapted: nn.Module, adapters: Adapters) -> None:
        super().__init__()
        self.__dict__["adapted"] = adapted  # outside `_modules`: state_dict, to(), requires_grad_ leave it alone
        self.__dict__["adapters"] = adapters
        self.config = getattr(adapted, "config", None)  # engines read model_type, attention implementation

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "past_key_values" in kwargs:  # cache_kw names the cache for this forward; hand it as the model takes it
            kwargs.update(cache_kw(self.adapted, kwargs.pop("past_key_values")))
        switch = self.adapters.switch
        assert switch is not None  # made by base_view
        with switch.using(False):
            return self.adapted(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.adapters.parameters(self.adapted)


def base_view(adapted: nn.Module) -> BaseView:
    """The reference on the LoRA model `adapted`: its base, adapters off, sharing its weights."""
    adapters = adapters_of(adapted)
    if adapters is None:
        raise ValueError(f"{type(adapted).__name__} has no LoRA adapters to switch off")
    if adapters.switch is None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        switch = AdapterSwitch([m for m in adapted.modules() if isinstance(m, BaseTunerLayer)])
        # every forward of the adapted model itself runs with the adapters on (it waits for the base's to finish)
        adapted.register_forward_pre_hook(lambda _m, _a: switch.enter(True))
        adapted.register_forward_hook(lambda _m, _a, _o: switch.exit(), always_call=True)
        adapters.switch = switch
    return BaseView(adapted, adapters)


def merged_state(module: nn.Module) -> tuple[dict[str, Tensor], bool]:
    """The weights of the LoRA model `module` with its adapters merged into the base (peft's `merge`, in place: the
    module is spent), named as the model without adapters: what `flowrl export` writes; and whether a merged layer
    was tied to another (an adapted `lm_head` tied to the input embeddings: merged apart, the model is then untied,
    as flowrl ran it, the adapter adding to the output layer alone)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    untied = False
    with torch.no_grad():
        for m in module.modules():
            if not isinstance(m, BaseTunerLayer) or m.merged:
                continue
            base: Any = m.get_base_layer()
            if uses.get(id(base.weight), 0) > 1:  # merging in place would change the embeddings too
                base.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
                untied = True
            merge: Any = m.merge
            merge()
    return {base_name(k): v for k, v in module.state_dict().items() if ".lora_" not in k}, untied


def save_adapter(base: nn.Module, adapted: nn.Module, out: str, base_path: str) -> None:
    """Write the adapters of `adapted` (a LoRA model) as a peft adapter directory (adapter_config.json,
    adapter_model.safetensors) over `base` (the same model without adapters, which this spends), which
    `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), out)` loads."""
    adapters = adapters_of(adapted)
    if adapters is None:
        raise ValueError(f"{type(adapted).__name__} has no LoRA adapters to save")
    peft = import_peft()
    config = lora_config(adapters.spec, adapters.targets, base, task_type="CAUSAL_LM",
                         base_model_name_or_path=base_path)
    base.__dict__["name_or_path"] = base_path  # peft writes it as base_model_name_or_path (from a config: "")
    with _known_warnings():
        wrapped = peft.get_peft_model(base, config)
    adapters.load(wrapped.base_model.model, adapters.state(adapted))  # peft names them as flowrl's injection does
    with _known_warnings():
        wrapped.save_pretrained(out)
