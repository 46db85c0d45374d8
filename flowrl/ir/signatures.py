"""Signatures of model methods and built-in step functions: the contract between lowering and the runtime.

Lowering checks calls in a flow against these tables (unknown keyword, wrong type, missing argument);
the runtime implements each entry. A parameter of kind `node` takes a name bound in the step; every
other kind takes a literal (or a template parameter that resolves to one).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl.ir.graph import Value

KINDS = ("node", "int", "float", "bool", "str", "number", "any")


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS; "number" accepts int or float; "float" accepts ints too
    required: bool = False
    default: Value = None
    positional: bool = False  # may be passed positionally (only node parameters are)
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Signature:
    name: str
    params: tuple[Param, ...]
    op: str  # the graph op a call of this becomes

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    @property
    def positional(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.positional)


def _n(name: str, required: bool = True, positional: bool = True) -> Param:
    return Param(name, "node", required=required, positional=positional)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")

_TRAIN_COMMON = (
    Param("agg", "str", default="token-mean", choices=AGG_MODES),
    Param("epochs", "int", default=1),
    Param("mini_batches", "int", default=1),
    Param("micro_batch", "int", default=0),  # rows per micro-batch; 0 = the whole mini-batch
    Param("max_grad_norm", "float", default=1.0),
)

GENERATE = Signature(
    "generate",
    (
        _n("prompts"),
        Param("n", "int", default=1),
        Param("max_tokens", "int", default=256),
        Param("min_tokens", "int", default=0),
        Param("temperature", "float", default=1.0),
        Param("top_p", "float", default=1.0),
    ),
    op="generate",
)
LOGPROBS = Signature("logprobs", (_n("rollout"),), op="logprobs")
VALUES = Signature("values", (_n("rollout"),), op="values")
SCORE = Signature("score", (_n("rollout"),), op="score")
POLICY_UPDATE = Signature(
    "update",
    (
        _n("rollout"),
        _n("advantages", positional=False),
        _n("old_logp", required=False, positional=False),
        _n("ref_logp", required=False, positional=False),
        Param("loss", "str", default="ppo_clip", choices=("ppo_clip",)),
        Param("clip", "float", default=0.2),
        Param("clip_high", "float", default=None),
        Param("dual_clip", "float", default=None),
        Param("kl_coef", "float", default=0.0),
        Param("kl", "str", default="k3", choices=KL_KINDS),
        Param("entropy_coef", "float", default=0.0),
    )
    + _TRAIN_COMMON,
    op="update",
)
CRITIC_UPDATE = Signature(
    "update",
    (
        _n("rollout"),
        _n("returns", positional=False),
        _n("values", required=False, positional=False),
        Param("loss", "str", default="value", choices=("value",)),
        Param("clip", "float", default=0.2),  # value clipping around the old values
    )
    + _TRAIN_COMMON,
    op="update",
)

# role -> method -> signature
METHODS: dict[str, dict[str, Signature]] = {
    "policy": {"generate": GENERATE, "logprobs": LOGPROBS, "update": POLICY_UPDATE},
    "reference": {"logprobs": LOGPROBS},
    "critic": {"values": VALUES, "update": CRITIC_UPDATE},
    "reward_model": {"score": SCORE},
}

# Built-in step functions (implemented in flowrl.runtime.functions). User functions registered with
# `@flowrl.function` get a signature built from their Python signature.
FUNCTIONS: dict[str, Signature] = {
    "group_advantage": Signature(
        "group_advantage",
        (_n("scores"), Param("group", "int", required=True), Param("norm_std", "bool", default=True),
         Param("eps", "float", default=1e-6)),
        op="fn",
    ),
    "rloo_advantage": Signature(
        "rloo_advantage", (_n("scores"), Param("group", "int", required=True)), op="fn"
    ),
    "gae": Signature(
        "gae",
        (_n("scores"), _n("values"), Param("gamma", "float", default=1.0), Param("lam", "float", default=0.95),
         Param("whiten", "bool", default=True)),
        op="fn",
    ),
    "reinforce_pp_advantage": Signature(
        "reinforce_pp_advantage",
        (_n("scores"), _n("logp", required=False), _n("ref_logp", required=False),
         Param("gamma", "float", default=1.0), Param("kl_coef", "float", default=0.0),
         Param("kl", "str", default="k1", choices=KL_KINDS)),
        op="fn",
    ),
}

# A reward (declared with `reward NAME = ...`) is called as `NAME(rollout)`.
REWARD = Signature("reward", (_n("rollout"),), op="reward")


# Keys the passes add to nodes (never written in a flow), with the value a node without the key has.
PASS_KEYS: dict[str, Value] = {
    "share_prefix": False,  # share-prefix: run each prompt prefix once
    "prefix_min_len": 16,  # share-prefix: shortest common opening worth computing once
    "stream_chunk": 0,  # fuse-gen-inference: samples per hand-off (0: one chunk at the end)
    "flush_steps": 0,  # fuse-gen-inference: decode steps after which finished samples go out anyway (0: never)
    "partial_below": 0.0,  # score-tail: unfinished fraction under which growing samples go out (0: never)
    "chunk_forwards": "own-rank",  # fuse-gen-inference: who runs a chunk's forwards on the generation group
    "migrate_below": 0.2,  # fuse-gen-inference: unfinished fraction under which the long tail migrates
}


# Keys allowed in declarations: name -> (kind, default). Unknown keys are declaration errors (with a
# did-you-mean hint), so typos never pass silently. Tiny-model keys only apply to `tiny:` sources.
MODEL_KEYS: dict[str, tuple[str, Value]] = {
    "source": ("any", None),
    "trainable": ("bool", None),  # default: true for policy and critic, false otherwise
    "lr": ("float", 1e-5),
    "weight_decay": ("float", 0.0),
    "engine": ("str", "torch"),
    "gpus": ("number", 0),
    "replicas": ("any", 1),  # int, `auto`, or a range for elastic pools
    "dtype": ("str", "float32"),
    "layers": ("int", None),
    "dim": ("int", None),
    "heads": ("int", None),
    "vocab": ("int", None),
    "context": ("int", 512),
    "charset": ("str", None),  # tiny models: a character tokenizer over these characters (default: bytes)
    "dropout": ("float", 0.0),
    "warmup_steps": ("int", 0),  # linear LR warm-up
    "zero_stage": ("int", 0),  # engine = "deepspeed": ZeRO stage 0-3
    "offload": ("bool", False),  # engine = "deepspeed": ZeRO optimizer offload to CPU
}
ENGINES = ("torch", "vllm", "deepspeed")

DATA_KEYS: dict[str, tuple[str, Value]] = {
    "batch": ("int", 8),  # prompts per step
    "shuffle": ("bool", True),
    "prompt_key": ("str", "prompt"),
    "limit": ("int", 0),  # use only the first N rows (0 = all)
}

ON_ERROR = ("fail", "zero")  # a reward that times out or crashes: fail the step, or score 0 and count it
# `reward NAME = "pkg.fn" { ... }`: only the keys written are kept (none: called inline, as a plain function).
REWARD_KEYS: dict[str, tuple[str, Value]] = {
    "workers": ("int", 0),  # worker processes scoring samples in parallel (0: inline on the controller)
    "timeout": ("float", 0.0),  # seconds a sample may take (0: no limit); needs workers >= 1
    "on_error": ("str", "fail"),  # one of ON_ERROR
}
# `reward NAME = http("url") { ... }`
HTTP_REWARD_KEYS: dict[str, tuple[str, Value]] = {
    "batch": ("int", 32),  # samples per POST
    "timeout": ("float", 10.0),  # seconds per request
    "retries": ("int", 2),  # tries after the first, on refused connections, timeouts and 5xx
    "concurrency": ("int", 4),  # requests in flight at once
    "on_error": ("str", "fail"),
}
REWARD_KINDS = ("http",)

RUN_KEYS: dict[str, tuple[str, Value]] = {
    "steps": ("int", 100),
    "seed": ("int", 0),
    "checkpoint_every": ("int", 0),  # 0 = only at the end
    "device": ("str", "auto"),  # auto | cpu | cuda
    "log_every": ("int", 10),  # steps between progress lines when stderr is not a terminal
}
