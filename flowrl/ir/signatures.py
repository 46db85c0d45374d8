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
class Limit:
    """The numbers a key or parameter accepts: at least `lo` (above it with `above`), at most `hi`; `why` is the
    hint shown with the error. Lowering checks every literal against its limit (dsl/keys.py), once, at check time,
    so no engine meets a value out of range."""

    lo: float | None = None
    hi: float | None = None
    above: bool = False  # `lo` itself is excluded (a learning rate above 0)
    why: str | None = None
    below: bool = False  # `hi` itself is excluded (a dropout probability below 1)

    def holds(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.above else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.below else v <= self.hi)

    def __str__(self) -> str:
        lo = None if self.lo is None else f"{_num(self.lo)}"
        if lo is not None and self.hi is not None and self.below:
            return f"{'above' if self.above else 'at least'} {lo} and below {_num(self.hi)}"
        if lo is not None and self.hi is not None:
            return (f"above {lo} and at most {_num(self.hi)}" if self.above
                    else f"between {lo} and {_num(self.hi)}")
        if lo is not None:
            return f"above {lo}" if self.above else f"at least {lo}"
        return f"at most {_num(self.hi)}" if self.hi is not None else "any number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Limit(1)
NON_NEGATIVE = Limit(0)
ABOVE_ZERO = Limit(0, above=True)
FRACTION = Limit(0, 1)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS; "number" accepts int or float; "float" accepts ints too
    required: bool = False
    default: Value = None
    positional: bool = False  # may be passed positionally (only node parameters are)
    choices: tuple[str, ...] = ()
    limit: Limit | None = None  # numbers outside it are errors at check time


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
# A policy's losses on a rollout (need `advantages`): PPO's clipped surrogate and CISPO's clipped, stop-gradient IS
# weight (MiniMax-M1); = flowrl.algos.ratios.ROLLOUT_LOSSES (ir sits below algos; a test keeps them equal)
ROLLOUT_LOSSES = ("ppo_clip", "cispo")
RATIO_LEVELS = ("token", "sequence")  # ppo_clip's importance ratio: per token (PPO), per sequence (GSPO)
IS_CORRECTIONS = ("auto", "none", "decoupled", "tis")

_TRAIN_COMMON = (
    Param("agg", "str", default="token-mean", choices=AGG_MODES),
    Param("epochs", "int", default=1, limit=POSITIVE),
    Param("mini_batches", "int", default=1, limit=POSITIVE),
    Param("micro_batch", "int", default=0, limit=NON_NEGATIVE),  # rows per micro-batch; 0 = the whole mini-batch
    Param("max_grad_norm", "float", default=1.0, limit=Limit(0, why="0 clips nothing")),
    # this update's learning rate (0: the model's `lr`): a stage of a pipeline trains the same model at its own
    Param("lr", "float", default=0.0, limit=Limit(0, why="0 keeps the model's lr")),
)

GENERATE = Signature(
    "generate",
    (
        _n("prompts"),
        Param("n", "int", default=1, limit=POSITIVE),
        Param("max_tokens", "int", default=256, limit=POSITIVE),
        Param("min_tokens", "int", default=0, limit=NON_NEGATIVE),
        Param("temperature", "float", default=1.0, limit=Limit(0, why="0 samples greedily")),
        Param("top_p", "float", default=1.0, limit=Limit(0, 1, above=True, why="1 keeps every token")),
        # an `env` or `tool` declaration's name: each sample then acts over turns (`max_tokens` is per turn);
        # "" (the templates' `none`) generates one completion per sample
        Param("env", "str", default=""),
    ),
    op="generate",
)
LOGPROBS = Signature("logprobs", (_n("rollout"),), op="logprobs")
VALUES = Signature("values", (_n("rollout"),), op="values")
SCORE = Signature("score", (_n("rollout"),), op="score")
# Losses on a data node of rows instead of a rollout (flowrl.runtime.preference_update): a policy's "sft" on
# demonstrations (prompt/response) and "dpo" on preference pairs (prompt/chosen/rejected), a reward model's
# "bradley_terry" on pairs. `ppo_clip` and `cispo` train on a rollout and need `advantages` (dsl/steps.py checks).
DATA_LOSSES = ("sft", "dpo", "bradley_terry")
DPO_KINDS = ("sigmoid", "ipo", "simpo")  # = flowrl.algos.preference.DPO_KINDS (ir sits below algos; a test keeps them equal)
# `eval_every`: a preference update on data with `held_out` rows scores them every N steps (0: never)
_EVAL = Param("eval_every", "int", default=1, limit=Limit(0, why="0 never evaluates the held-out rows"))
POLICY_UPDATE = Signature(
    "update",
    (
        _n("rollout"),
        _n("advantages", required=False, positional=False),  # required by ppo_clip and cispo (dsl/steps.py)
        _n("old_logp", required=False, positional=False),
        _n("ref_logp", required=False, positional=False),
        Param("loss", "str", default="ppo_clip", choices=(*ROLLOUT_LOSSES, "sft", "dpo")),
        Param("beta", "float", default=0.1, limit=ABOVE_ZERO),  # dpo: the implicit reward's scale
        Param("dpo", "str", default="sigmoid", choices=DPO_KINDS),
        Param("label_smoothing", "float", default=0.0,
              limit=Limit(0, 0.5, why="cDPO's ε: the share of labels taken to be flipped; 0 is DPO")),
        Param("gamma", "float", default=0.5, limit=NON_NEGATIVE),  # dpo = "simpo": the target margin γ
        _EVAL,
        Param("clip", "float", default=0.2, limit=ABOVE_ZERO),
        Param("clip_high", "float", default=None, limit=ABOVE_ZERO),
        Param("dual_clip", "float", default=None, limit=Limit(1, above=True, why="dual-clip bounds negative "
                                                                                  "advantages' ratio at c > 1")),
        Param("kl_coef", "float", default=0.0, limit=Limit(0, why="0 leaves the KL term out")),
        Param("kl", "str", default="k3", choices=KL_KINDS),
        Param("entropy_coef", "float", default=0.0, limit=NON_NEGATIVE),
        # Off-policy correction for samples generated by older weights (run { max_staleness }): "decoupled"
        # (AReaL), "tis" (truncated IS), "none"; "auto" is "decoupled" in an asynchronous run, else "none".
        Param("is_correction", "str", default="auto", choices=IS_CORRECTIONS),
        Param("is_cap", "float", default=5.0, limit=ABOVE_ZERO),  # the cap on the behaviour importance weight (AReaL: 5)
        # ppo_clip: "sequence" is GSPO's ratio (pi/pi_old)^(1/|y|) for every token of a response, clipped as one
        Param("ratio", "str", default="token", choices=RATIO_LEVELS),
        # agg = "seq-mean-token-sum-norm": the constant the token sum is divided by (verl's loss_scale_factor; Dr.
        # GRPO's max_tokens); 0: the batch's response width, as verl without it
        Param("loss_scale_factor", "int", default=0, limit=Limit(0, why="0 divides by the batch's response width")),
        # DAPO's overlong filtering: samples cut at max_tokens without EOS are masked out of the loss
        Param("mask_truncated", "bool", default=False),
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
        Param("clip", "float", default=0.2, limit=ABOVE_ZERO),  # value clipping around the old values
    )
    + _TRAIN_COMMON,
    op="update",
)

# A reward model trained on preference pairs (a data node): −log σ(r_chosen − r_rejected − margin).
REWARD_UPDATE = Signature(
    "update",
    (
        _n("rollout"),
        Param("loss", "str", default="bradley_terry", choices=("bradley_terry",)),
        Param("margin", "float", default=0.0),
        _EVAL,
    )
    + _TRAIN_COMMON,
    op="update",
)

# A policy update's keys that only one loss reads: a node keeps those of its own loss (the others' defaults are
# left out of its attrs, so a PPO graph prints as before), and writing another loss's key is an error.
LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "ppo_clip": ("clip", "clip_high", "dual_clip", "kl_coef", "kl", "entropy_coef", "is_correction", "is_cap",
                 "ratio", "loss_scale_factor", "mask_truncated"),
    # clip and clip_high bound CISPO's IS weight: [1 - clip, 1 + clip_high]
    "cispo": ("clip", "clip_high", "kl_coef", "kl", "entropy_coef", "is_correction", "is_cap", "loss_scale_factor",
              "mask_truncated"),
    "dpo": ("beta", "dpo", "label_smoothing", "gamma", "eval_every"),
    "sft": ("eval_every",),
}
# Keys added after graphs were first printed: a node holds them only where the flow writes them (the runtime reads
# the default otherwise, flowrl.ir.attrs), so every graph that does not use them prints as before.
WRITTEN_ONLY = frozenset({"ratio", "loss_scale_factor", "mask_truncated", "overlong_buffer", "overlong_penalty"})

# role -> method -> signature
METHODS: dict[str, dict[str, Signature]] = {
    "policy": {"generate": GENERATE, "logprobs": LOGPROBS, "update": POLICY_UPDATE},
    "reference": {"logprobs": LOGPROBS},
    "critic": {"values": VALUES, "update": CRITIC_UPDATE},
    "reward_model": {"score": SCORE, "update": REWARD_UPDATE},  # trainable when a step updates it (dsl/steps.py)
}

# Credit of the group advantages: one advantage per trajectory, or per turn (flowrl.algos.turn_advantages).
TURNS = ("trajectory", "turn")
# filter_groups (DAPO's dynamic sampling): "mixed" keeps the groups whose samples' total scores differ, "all" every
# group; = flowrl.algos.dapo.KEEP (ir sits below algos; a test keeps them equal)
KEEP_GROUPS = ("mixed", "all")

# Built-in step functions (implemented in flowrl.runtime.functions). User functions registered with
# `@flowrl.function` get a signature built from their Python signature.
FUNCTIONS: dict[str, Signature] = {
    "group_advantage": Signature(
        "group_advantage",
        (_n("scores"), Param("group", "int", required=True, limit=POSITIVE),
         Param("norm_std", "bool", default=True), Param("eps", "float", default=1e-6, limit=NON_NEGATIVE),
         Param("turns", "str", default="trajectory", choices=TURNS)),
        op="fn",
    ),
    "rloo_advantage": Signature(
        "rloo_advantage",
        (_n("scores"), Param("group", "int", required=True, limit=POSITIVE),
         Param("turns", "str", default="trajectory", choices=TURNS)),
        op="fn",
    ),
    "gae": Signature(
        "gae",
        (_n("scores"), _n("values"), Param("gamma", "float", default=1.0, limit=FRACTION),
         Param("lam", "float", default=0.95, limit=FRACTION),
         Param("whiten", "bool", default=True)),
        op="fn",
    ),
    "reinforce_pp_advantage": Signature(
        "reinforce_pp_advantage",
        (_n("scores"), _n("logp", required=False), _n("ref_logp", required=False),
         Param("gamma", "float", default=1.0, limit=FRACTION), Param("kl_coef", "float", default=0.0, limit=NON_NEGATIVE),
         Param("kl", "str", default="k1", choices=KL_KINDS)),
        op="fn",
    ),
    # DAPO's dynamic sampling (flowrl.runtime.refill): the rollout's groups whose samples did not all score the same,
    # `batch` of them (0: the prompts a step draws), drawing more prompts, at most `max_gen_batches` draws a step
    "filter_groups": Signature(
        "filter_groups",
        (_n("rollout"), _n("scores"), Param("keep", "str", default="mixed", choices=KEEP_GROUPS),
         Param("batch", "int", default=0, limit=Limit(0, why="0 trains on as many groups as a step draws prompts")),
         Param("max_gen_batches", "int", default=10, limit=Limit(1, why="each step draws its prompts at least "
                                                                       "once; verl's 0 (no limit) could loop forever "
                                                                       "once every group scores alike"))),
        op="fn",
    ),
}

# A reward (declared with `reward NAME = ...`) is called as `NAME(rollout)`. DAPO's soft overlong punishment
# (flowrl.algos.dapo.overlong_penalty) adds 0 down to -overlong_penalty over the last `overlong_buffer` tokens
# before the generation's max_tokens (0: off).
REWARD = Signature("reward", (
    _n("rollout"),
    Param("overlong_buffer", "int", default=0, limit=Limit(0, why="0 punishes no length")),
    Param("overlong_penalty", "float", default=1.0, limit=Limit(0, why="the reward a response at max_tokens loses")),
), op="reward")


# Keys the passes add to nodes (never written in a flow), with the value a node without the key has.
PASS_KEYS: dict[str, Value] = {
    "share_prefix": False,  # share-prefix: run each prompt prefix once
    "prefix_min_len": 16,  # share-prefix: shortest common opening worth computing once
    "stream_chunk": 0,  # fuse-gen-inference: samples per hand-off (0: one chunk at the end)
    "flush_steps": 0,  # fuse-gen-inference: decode steps after which finished samples go out anyway (0: never)
    "partial_below": 0.0,  # score-tail: unfinished fraction under which growing samples go out (0: never)
    "chunk_forwards": "own-rank",  # fuse-gen-inference: who runs a chunk's forwards on the generation group
    "migrate_below": 0.2,  # fuse-gen-inference: unfinished fraction under which the long tail migrates
    "phase": "",  # async-rollout: "rollout" on the nodes that run ahead of training
    "max_staleness": 0,  # async-rollout: on the generate node, how many updates old its samples are when trained
    "async_inputs": "",  # async-rollout: the inputs a train-phase node takes from the queue (comma-separated)
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
    "layers": ("int", 2),  # tiny models' shape; the defaults are examples/grpo_arith.flow's
    "dim": ("int", 64),
    "heads": ("int", 4),
    "vocab": ("int", None),
    "context": ("int", 512),
    "charset": ("str", None),  # tiny models: a character tokenizer over these characters (default: bytes)
    "dropout": ("float", 0.0),
    "warmup_steps": ("int", 0),  # linear LR warm-up
    "zero_stage": ("int", 0),  # engine = "deepspeed": ZeRO stage 0-3
    "offload": ("bool", False),  # engine = "deepspeed": ZeRO optimizer offload to CPU
    # a reward_model's score of a response cut off before EOS (at max_tokens), less this (TRL's missing_eos_penalty)
    "missing_eos_penalty": ("float", 0.0),
    # LoRA (verl's names): a rank trains low-rank adapters on a frozen base instead of every weight (peft)
    "lora_rank": ("int", None),  # none: no adapters, the model trains all its weights
    "lora_alpha": ("float", 16.0),  # the adapters' scale is lora_alpha / lora_rank
    "lora_dropout": ("float", 0.0),  # dropout on the adapters' input while the model trains
    "lora_targets": ("any", None),  # none: the architecture's attention and MLP projections; "all-linear"; names
}
ENGINES = ("torch", "vllm", "deepspeed")
DTYPES = ("float32", "bfloat16", "float16")
TINY_SOURCES = ("tiny:gpt2", "tiny:llama")
DEVICES = ("auto", "cpu", "cuda")  # also "cuda:N"

DATA_KEYS: dict[str, tuple[str, Value]] = {
    "batch": ("int", 8),  # prompts per step
    "shuffle": ("bool", True),
    "prompt_key": ("str", "prompt"),
    "limit": ("int", 0),  # use only the first N rows (0 = all)
    "held_out": ("str", None),  # a bool column: its true rows are never trained on, only evaluated (none: no column)
    # "NAME = PATH" strings (one, or a list): each row gets keyword NAME read from the dotted PATH of its nested
    # columns (`answer = reward_model.ground_truth`, verl's layout; flowrl.data.paths); none: the rows as they are
    "columns": ("any", None),
}

SANDBOX = ("auto", "strict")  # code_tests: the best isolation here (warned when degraded), or refuse without it
ON_ERROR = ("fail", "zero")  # a reward that times out or crashes: fail the step, or score 0 and count it
# `reward NAME = "pkg.fn" { ... }`: only the keys written are kept (none: called inline, as a plain function).
REWARD_KEYS: dict[str, tuple[str, Value]] = {
    "workers": ("int", 0),  # worker processes scoring samples in parallel (0: inline on the controller)
    "timeout": ("float", 0.0),  # seconds a sample may take (0: no limit); alone, it means workers = 1
    "on_error": ("str", "fail"),  # one of ON_ERROR
    "sandbox": ("str", "auto"),  # one of SANDBOX (flowrl.rewards.sandbox)
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

# `env NAME = "module.Class" { ... }` and `tool NAME = "module.fn" { ... }` (flowrl.envs.EnvSpec's fields).
ENV_ON_ERROR = ("observe", "end", "raise")  # = flowrl.envs.ON_ERROR (ir sits below envs; a test keeps them equal)
ENV_KEYS: dict[str, tuple[str, Value]] = {
    "max_turns": ("int", 4),  # actions per trajectory
    "stop": ("any", ()),  # a string or a list of strings that end a turn (the stop text is part of the action)
    "workers": ("int", 2),  # warm processes running the environments (0: threads of the generating process)
    "timeout": ("float", 30.0),  # seconds per reset or step call
    "on_error": ("str", "observe"),  # one of ENV_ON_ERROR
    "overlap": ("bool", True),  # false: the barrier loop (every sample's turn, then every environment)
    "max_total": ("int", 0),  # response tokens of a whole trajectory, observations too (0: the model's positions)
    "decode_batch": ("int", 0),  # trajectories decoding at once, the others queued with their caches (0: all)
}
TOOL_KEYS: dict[str, tuple[str, Value]] = {
    "call": ("str", None),  # the marker that opens the tool's arguments (required)
    "end": ("str", None),  # the marker that closes them and ends the turn (required)
    **{k: v for k, v in ENV_KEYS.items() if k != "stop"},
}

# serverless: who computes a prompt prefix shared across generation instances (backends/serverless/prefill.py)
DEDUP_PREFILL = ("auto", "handover", "local", "off")
EXPORT = ("none", "final", "every")  # run { export }: when the run writes its model as a Hugging Face directory
RUN_KEYS: dict[str, tuple[str, Value]] = {
    "steps": ("int", 100),
    "seed": ("int", 0),
    "checkpoint_every": ("int", 0),  # 0 = only at the end
    "device": ("str", "auto"),  # auto | cpu | cuda
    "log_every": ("int", 10),  # steps between progress lines when stderr is not a terminal
    "max_staleness": ("int", 0),  # 0: synchronous; K >= 1: generation runs ahead, samples at most K updates old
    "cost_weight": ("float", 0.5),  # serverless: 1 buys the fastest generation, 0 the fewest device-seconds
    "prewarm": ("bool", True),  # serverless: start instances ahead of their stage, from the step history
    "prewarm_margin": ("float", 0.05),  # serverless: seconds before the stage's earliest start they are ready
    "keep_warm": ("bool", True),  # serverless: instances keep their models in host memory between tasks
    "migrate_at": ("float", 0.7),  # serverless: an instance hands its unfinished rows over at this fraction done
    "dedup_prefill": ("str", "auto"),  # serverless: a prompt prefix shared across instances runs once (DEDUP_PREFILL)
    "acquire_timeout": ("float", 60.0),  # serverless on a joined cluster: seconds a pool may wait for its lower bound
    "gpu_hour": ("float", 0.0),  # price of a device-hour, for money in the cost report (0: device-seconds only)
    "cpu_hour": ("float", 0.0),  # price of the controller's host per hour of the run
    "log": ("any", ()),  # experiment trackers: a name of LOGGERS or a list of them (`flowrl run --log`)
    "project": ("str", "flowrl"),  # the trackers' project (wandb) / experiment (MLflow)
    "name": ("str", ""),  # the trackers' run name ("": the run directory's name)
    "log_samples": ("int", 0),  # rollout samples a step to OUT/samples.jsonl and the trackers (the step's first K)
    "export": ("str", "none"),  # write OUT/hf/MODEL/ (a Hugging Face directory) at the last checkpoint or at each (EXPORT)
}
# run { log }: the experiment trackers flowrl writes to (flowrl.runtime.tracking), each an optional extra
LOGGERS = ("wandb", "mlflow", "tensorboard")

# `eval NAME { ... }`: a held-out evaluation between steps (flowrl.runtime.evaluation). The keys without a default
# take the flow's: `data` is required, `reward` the step's reward, `model` the policy it generates with,
# `max_tokens` that generate's, `every` the run's `checkpoint_every`.
EVAL_KEYS: dict[str, tuple[str, Value]] = {
    "data": ("any", None),  # a data declaration's name (not one the step trains on)
    "every": ("int", None),  # steps between evaluations (0: the last step only); default: checkpoint_every
    "n": ("int", 1),  # samples per prompt (pass@k for k = 1, 2, 4, ... n)
    "temperature": ("float", 0.0),  # 0: greedy
    "max_tokens": ("int", None),  # default: the flow's generate's
    "reward": ("any", None),  # a reward declaration's name; default: the reward the step scores with
    "model": ("any", None),  # default: the policy the step generates with (or trains)
    "at_start": ("bool", False),  # also evaluate the step-0 weights
}


# What each declaration key accepts beyond its kind, by block ("model", "data", "run", "reward", "http reward"):
# numbers within a `Limit`, strings among choices. Lowering checks every key written (or overridden) against
# these tables at check time (dsl/keys.py); a key not listed takes any value of its kind.
KEY_LIMITS: dict[str, dict[str, Limit]] = {
    "model": {
        "lr": ABOVE_ZERO, "weight_decay": NON_NEGATIVE, "gpus": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE,
        "missing_eos_penalty": Limit(0, why="0 scores a cut-off response as it is"),
        "zero_stage": Limit(0, 3, why="ZeRO stages are 0, 1, 2 and 3"),
        "layers": POSITIVE, "dim": POSITIVE, "heads": POSITIVE, "vocab": POSITIVE,
        "context": Limit(2, why="the prompt's first token and one generated token need two positions"),
        "dropout": Limit(0, 0.99),
        "lora_rank": POSITIVE, "lora_alpha": ABOVE_ZERO,
        "lora_dropout": Limit(0, 1, below=True, why="the share of the adapters' inputs dropped while training"),
    },
    "data": {"batch": POSITIVE, "limit": Limit(0, why="0 uses every row")},
    "run": {
        "steps": POSITIVE, "seed": NON_NEGATIVE,
        "checkpoint_every": Limit(0, why="0 writes a checkpoint at the end only"),
        "log_every": POSITIVE,
        "max_staleness": Limit(0, why="0 is a synchronous run"),
        "cost_weight": Limit(0, 1, why="1 buys the fastest generation, 0 the fewest device-seconds"),
        "prewarm_margin": Limit(0, why="seconds before the stage"),
        "migrate_at": Limit(0, 1, above=True, why="1 never migrates"),
        "acquire_timeout": Limit(0, above=True, why="seconds a pool may wait for its lower bound on a joined cluster"),
        "gpu_hour": Limit(0, why="a price per hour; 0 leaves money out of the cost report"),
        "cpu_hour": Limit(0, why="a price per hour; 0 leaves money out of the cost report"),
        "log_samples": Limit(0, why="0 writes no samples"),
    },
    "reward": {"workers": NON_NEGATIVE, "timeout": Limit(0, why="seconds; 0: no limit")},
    "http reward": {"batch": POSITIVE, "timeout": Limit(0, why="seconds; 0: no limit"), "retries": NON_NEGATIVE,
                    "concurrency": POSITIVE},
    "env": {"max_turns": POSITIVE, "workers": Limit(0, why="0 runs the environments in threads"),
            "timeout": Limit(0, above=True, why="seconds per reset or step call"),
            "max_total": Limit(0, why="0: up to the model's positions"),
            "decode_batch": Limit(0, why="0: every trajectory decodes at once")},
    "eval": {"n": POSITIVE, "every": Limit(0, why="0 evaluates at the last step only"),
             "temperature": Limit(0, why="0 samples greedily"), "max_tokens": POSITIVE},
}
KEY_LIMITS["tool"] = KEY_LIMITS["env"]
KEY_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {
    "model": {"engine": ENGINES, "dtype": DTYPES},
    "run": {"dedup_prefill": DEDUP_PREFILL, "export": EXPORT},
    "reward": {"on_error": ON_ERROR, "sandbox": SANDBOX},
    "http reward": {"on_error": ON_ERROR},
    "env": {"on_error": ENV_ON_ERROR},
    "tool": {"on_error": ENV_ON_ERROR},
}
