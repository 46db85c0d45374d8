"""Checks across keys, declarations and nodes (lowering, after `dsl.steps`): what would otherwise only fail, or
silently go wrong, once a flow runs — a tiny model's shape, an `hf:` directory, the device, prompts plus
`max_tokens` within the model's positions, a batch larger than its data, a charset missing the data's characters,
a generation's `n` against its advantage's `group`, GRPO with groups of one.

Each check reads the lowered declarations and nodes plus where each value was written (`Flow`), and reports,
located, through the Reporter; none builds a model. The model-side facts (what a tiny shape needs, what a device
or a local checkpoint needs) come from `flowrl.models.build`, which `run` checks with the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowrl.errors import FlowError
from flowrl.ir.graph import DataDecl, ModelDecl, Node
from flowrl.ir.signatures import LOGGERS, TINY_SOURCES
from flowrl.models.sources import (
    device_problem,
    hf_positions,
    hf_source_problem,
    tiny_shape_problem,
    tiny_tokenizer,
)

from . import ast
from .diagnostics import Reporter, Source, did_you_mean
from .environments import EnvInfo
from .keys import Entry

Block = Mapping[str, Entry]


def check_source(rep: Reporter, at: Entry, source: str, folder: str) -> bool:
    """A `tiny:` name that exists, an `hf:` directory that exists and holds a config.json; True when fine."""
    written = str(at.entry.value.value) if isinstance(at.entry.value, ast.Literal) else source
    if source.startswith("tiny:"):
        if source in TINY_SOURCES:
            return True
        rep.error(at.src, f"unknown tiny model \"{source}\"", at.entry.value,
                  hint=did_you_mean(source, TINY_SOURCES) or f"tiny models: {', '.join(TINY_SOURCES)}")
        return False
    problem = hf_source_problem(source[3:])
    if problem is None:
        return True
    hint = (f"an hf: source is a local Hugging Face directory, relative to the flow file's folder ({folder}); "
            "flowrl never downloads" if "found" in problem else
            "a Hugging Face checkpoint directory holds config.json next to its weights "
            "(`model.save_pretrained(DIR)` writes one)")
    rep.error(at.src, f"cannot load \"{written}\": {problem} ({source[3:]})", at.entry.value, hint=hint)
    return False


def check_shape(rep: Reporter, src: Source, decl: ast.ModelDecl, block: Block, source: str,
                config: Mapping[str, Any]) -> None:
    """A tiny config that can make a model (`dim` divisible by `heads`, an even head size for llama)."""
    if source not in TINY_SOURCES:
        return
    found = tiny_shape_problem(source.split(":", 1)[1], config)
    if found is None:
        return
    key, why = found
    dim = int(config.get("dim", 64))
    fits = [h for h in range(1, min(dim, 32) + 1) if dim % h == 0 and (source != "tiny:llama" or (dim // h) % 2 == 0)]
    hint = f"heads that fit dim = {dim}: {', '.join(map(str, fits[-6:]))}" if fits else "choose another dim"
    at = block.get(key) or block.get("dim")
    if at is not None:
        rep.error(at.src, why, at.entry.value, hint=hint)
    else:
        rep.error(src, why, decl.name, hint=hint)


def check_device(rep: Reporter, block: Block, device: object) -> None:
    """`run { device }`: known, and usable on this machine (`cuda` where torch has no CUDA is an error)."""
    at = block.get("device")
    problem = device_problem(str(device)) if at is not None else None
    if at is not None and problem is not None:
        rep.error(at.src, problem[0], at.entry.value, hint=problem[1])


def check_loggers(rep: Reporter, block: Block, value: object) -> tuple[str, ...]:
    """`run { log }`: a tracker's name or a list of them, each one of LOGGERS; the names (none after an error)."""
    at = block.get("log")
    names = (value,) if isinstance(value, str) else value if isinstance(value, tuple) else ()
    if at is None:
        return ()
    if not isinstance(value, (str, tuple)) or not all(isinstance(n, str) for n in names):
        rep.error(at.src, "`log` must be a tracker's name or a list of them", at.entry.value,
                  hint=f'for example `log = ["wandb", "mlflow"]` (trackers: {", ".join(LOGGERS)})')
        return ()
    unknown = [str(n) for n in names if n not in LOGGERS]
    items = at.entry.value.items if isinstance(at.entry.value, ast.ListLit) else ()
    for name in unknown:
        item = next((i for i in items if isinstance(i, ast.Literal) and i.value == name), at.entry.value)
        rep.error(at.src, f"unknown tracker \"{name}\" in `log`", item,
                  hint=did_you_mean(name, LOGGERS) or f"trackers: {', '.join(LOGGERS)}")
    return () if unknown else tuple(dict.fromkeys(str(n) for n in names))


@dataclass(frozen=True)
class Flow:
    """What the checks across declarations and nodes read: the lowered declarations and nodes, each model's
    and data's block as written, each data set's prompts, and where each node's literals were written."""

    src: Source
    models: Sequence[ModelDecl]
    model_blocks: Mapping[str, Block]
    data: Sequence[DataDecl]
    data_decls: Mapping[str, ast.DataDecl]
    data_blocks: Mapping[str, Block]
    prompts: Mapping[str, Sequence[str]]  # data name -> its prompts (after `limit`)
    shown: Mapping[str, str]  # data name -> its file as the flow names it
    nodes: Sequence[Node]
    written: Mapping[tuple[str, str], tuple[Source, ast.Located]]
    device: str = "auto"  # run { device }
    envs: Mapping[str, EnvInfo] = field(default_factory=dict)  # env and tool declarations by name
    eval_data: frozenset[str] = frozenset()  # data sets only `eval` blocks read (their `batch` is not a step's)


def check_flow(rep: Reporter, flow: Flow) -> None:
    _check_batches(rep, flow)
    for m in flow.models:
        if m.engine != "torch":
            _check_engine(rep, flow, m)
        at = flow.model_blocks.get(m.name, {}).get("missing_eos_penalty")
        if at is not None and m.role != "reward_model":
            rep.error(at.src, f"missing_eos_penalty is a reward model's, and `{m.name}` is a {m.role}",
                      at.entry.key, hint="set it on the reward_model that scores the rollouts")
    by_id = {n.id: n for n in flow.nodes}
    used: set[str] = set()
    for node in flow.nodes:
        if node.op == "generate":
            _check_generation(rep, flow, node)
            spec = node.attrs.get("env")
            if isinstance(spec, Mapping):
                used.add(str(spec["name"]))
                check_env_generation(rep, flow, node, flow.envs[str(spec["name"])])
        if node.op == "fn" and node.attrs.get("fn") in ("group_advantage", "rloo_advantage"):
            _check_group(rep, flow, node, by_id)
    check_envs_used(rep, flow, used)


def _check_batches(rep: Reporter, flow: Flow) -> None:
    for d in flow.data:
        if d.name in flow.eval_data:  # an evaluation reads every row; `batch` is no step's size there
            continue
        rows = len(flow.prompts.get(d.name, ()))
        batch = d.options.get("batch")
        if not rows or not isinstance(batch, int) or batch <= rows:
            continue
        # A batch the flow wrote past its data is an error (a batch of 100,000 from 64 rows ran for minutes,
        # every prompt repeated in every step); the default batch past a small data set is a warning: the flow
        # asked for no size, and a step that repeats prompts still runs (small test flows rely on it).
        at = flow.data_blocks.get(d.name, {}).get("batch")
        repeats = -(-batch // rows)
        why = (f"`batch = {batch}` prompts a step is more than the {rows} rows of {flow.shown[d.name]}"
               + (" (after `limit`)" if d.options.get("limit") else "")
               + f": each step would repeat prompts (up to {repeats} times each)")
        hint = f"a step of different prompts takes at most `batch = {rows}`; or add rows"
        if at is not None:
            rep.error(at.src, why, at.entry.value, hint=hint)
        else:  # the default batch, which the flow never wrote: point at the data declaration
            rep.warn(flow.src, why.replace("`batch", "the default `batch").replace("would repeat", "repeats"),
                     flow.data_decls[d.name].name, hint=hint)


# What check_engine says about this machine or about a graph still worth compiling to look at (a vLLM flow
# written on a laptop for a GPU cluster): a warning here, `run` refuses it where it runs. The rest is an error.
_ENGINE_WARNINGS = ("which is not installed", "needs a CUDA device", "needs an hf: source")


def _check_engine(rep: Reporter, flow: Flow, m: ModelDecl) -> None:
    """What a worker checks before it builds `m` with an engine other than torch (flowrl.engines.select:
    the right role, trainable, its options; installed, an hf: source and a CUDA device for vLLM), reported at the
    `engine` entry: errors for the flow's own mistakes, warnings for what depends on the machine."""
    import torch

    from flowrl.engines.select import check_engine  # imports torch: only for flows naming another engine

    at = flow.model_blocks.get(m.name, {}).get("engine")
    if at is None:
        return
    # the device a worker here resolves `auto` to (runtime.worker.resolve_device), so messages are the run's own
    device = ("cuda" if torch.cuda.is_available() else "cpu") if flow.device == "auto" else flow.device
    try:
        check_engine(m.engine, m.role, model=m.name, trainable=m.trainable, source=m.source, device=device,
                     options=m.options)
    except FlowError as e:
        for d in e.diagnostics:
            if any(w in d.message for w in _ENGINE_WARNINGS):
                rep.warn(at.src, d.message + " (`run` refuses it)", at.entry.value, hint=d.hint)
            else:
                rep.error(at.src, d.message, at.entry.value, hint=d.hint)


def _root(flow: Flow, name: str) -> ModelDecl | None:
    by_name = {m.name: m for m in flow.models}
    m = by_name.get(name)
    seen: set[str] = set()
    while m is not None and m.source_model is not None and m.source_model in by_name and m.name not in seen:
        seen.add(m.name)
        m = by_name[m.source_model]
    return m


def _check_generation(rep: Reporter, flow: Flow, node: Node) -> None:
    max_tokens, min_tokens = node.attrs.get("max_tokens"), node.attrs.get("min_tokens")
    if isinstance(max_tokens, int) and isinstance(min_tokens, int) and min_tokens > max_tokens:
        src, where = flow.written[(node.id, "min_tokens")]
        rep.error(src, f"`min_tokens = {min_tokens}` is more than `max_tokens = {max_tokens}`", where,
                  hint="a response cannot be required to be longer than it may be")
    root = _root(flow, str(node.model))
    data = dict(node.inputs).get("prompts")
    if root is None or not isinstance(max_tokens, int) or data is None or data not in flow.prompts:
        return
    if isinstance(node.attrs.get("env"), Mapping):  # a trajectory's positions: check_env_generation
        return
    prompts = flow.prompts[data]
    lengths: list[int] = []
    if root.source in TINY_SOURCES:
        context = root.config.get("context")
        tok = tiny_tokenizer(root.config)
        lengths = [len(tok.encode(p)) + (tok.bos_id is not None) for p in prompts]
        longest = max(lengths, default=1)
        _check_charset(rep, flow, root, data, prompts)
    else:  # an hf: checkpoint: its positions from config.json; its tokenizer is not loaded to check
        context, longest = hf_positions(root.source[3:]), 1
    if not isinstance(context, int) or longest + max_tokens <= context:
        return
    src, where = flow.written[(node.id, "max_tokens")]
    over = sum(n + max_tokens > context for n in lengths)
    if over < len(lengths):  # some fit: the run leaves the others out (flowrl.runtime.overlong), as verl filters
        rep.warn(src, f"`max_tokens = {max_tokens}` leaves the prompts of `{data}` {context - max_tokens} of model "
                      f"`{root.name}`'s {context} positions: {over} of {len(lengths)} prompts are longer (the "
                      f"longest has {longest} tokens with <bos>) and are left out of the run", where,
                 hint=f"to keep them, give `{root.name}` more positions (`context = {longest + max_tokens}`) or "
                      f"lower `max_tokens`")
        return
    what = (f"the longest prompt of `{data}` ({longest} tokens with <bos>)" if root.source in TINY_SOURCES
            else "a prompt's first token")
    room = context - longest
    hint = (f"`max_tokens` can be at most {room} here, or give `{root.name}` more positions (`context = "
            f"{longest + max_tokens}`)" if room >= 1 else
            f"the prompts alone fill the positions: give `{root.name}` more (`context = {longest + max_tokens}`)")
    if root.source not in TINY_SOURCES:
        hint = f"`max_tokens` can be at most {room} for this checkpoint"
    if src.path != flow.src.path and room >= 1:  # the template's default: the user sets it in their `use`
        hint = f"pass `max_tokens = {room}` (or less) in the `use`, or give `{root.name}` more positions"
    rep.error(src, f"`max_tokens = {max_tokens}` and {what} need {longest + max_tokens} positions; "
                   f"model `{root.name}` has {context}", where, hint=hint)


def _check_charset(rep: Reporter, flow: Flow, root: ModelDecl, data: str, prompts: Sequence[str]) -> None:
    charset = root.config.get("charset")
    at = flow.model_blocks.get(root.name, {}).get("charset")
    if not isinstance(charset, str) or not charset or at is None:
        return
    have = set(charset)
    missing = sorted({c for p in prompts for c in p} - have)
    if not missing:
        return
    shown = "".join(missing)
    rep.error(at.src, f"`charset` lacks {len(missing)} character{'s' if len(missing) > 1 else ''} the prompts of "
                      f"`{data}` use: {shown!r}", at.entry.value,
              hint="each would become <unk>, the same token for all of them: add them "
                   f"(`charset = {_flow_string(charset + shown)}`)" if len(charset) + len(shown) <= 60 else
                   "each would become <unk>, the same token for all of them: add them to `charset`")


def _flow_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def _check_group(rep: Reporter, flow: Flow, node: Node, by_id: Mapping[str, Node]) -> None:
    group = node.attrs.get("group")
    if not isinstance(group, int) or (node.id, "group") not in flow.written:
        return
    src, where = flow.written[(node.id, "group")]
    gen = _generation_of(node, by_id)
    n = gen.attrs.get("n") if gen is not None else None
    if gen is not None and isinstance(n, int) and n != group:
        rep.error(src, f"`group = {group}` but `{gen.id}` samples {n} response{'s' if n > 1 else ''} per prompt "
                       "(`n`)", where, hint=f"the groups are the responses to one prompt: `group = {n}`")
    elif group == 1 and node.attrs.get("fn") == "group_advantage":
        rep.warn(src, "`group = 1`: each response is alone in its group, so every advantage is 0 and the policy "
                      "cannot learn", where,
                 hint="GRPO compares the responses to one prompt with each other: sample several (`group = 8`)")


def _generation_of(node: Node, by_id: Mapping[str, Node]) -> Node | None:
    """The generate node a node's inputs come from (scores <- reward <- rollout), if one."""
    todo, seen = [src for _, src in node.inputs], set()
    while todo:
        cur = by_id.get(todo.pop(0))
        if cur is None or cur.id in seen:
            continue
        if cur.op == "generate":
            return cur
        seen.add(cur.id)
        todo.extend(src for _, src in cur.inputs)
    return None


# ---- environments (`env` / `tool` declarations, flowrl.envs) ------------------------------------------------


def check_envs_used(rep: Reporter, flow: Flow, used: set[str]) -> None:
    for name, info in flow.envs.items():
        if name not in used:
            rep.warn(flow.src, f"{info.kind} `{name}` is declared but no `generate` uses it", info.decl.name,
                     hint=f"pass it to one: `actor.generate(prompts, env = {name})` or `use grpo(..., env = {name})`")


def check_env_generation(rep: Reporter, flow: Flow, node: Node, info: EnvInfo) -> None:
    """A generate running `info`: the torch engine; its stop texts or markers in the model's characters; a
    trajectory (the longest prompt, then max_turns x max_tokens, or max_total) within the model's positions."""
    src, where = flow.written[(node.id, "env")]
    root = _root(flow, str(node.model))
    if root is None:
        return
    # the model that generates runs the decode loop, whatever its source's engine (a worker would otherwise run
    # it on the torch engine without a word)
    own = next((m for m in flow.models if m.name == node.model), root)
    if own.engine != "torch":
        rep.error(src, f"`{info.name}` needs the torch engine, but model `{own.name}` uses engine = "
                       f"\"{own.engine}\"", where,
                  hint="multi-turn generation runs on the torch engine only, for now: drop `engine` from the model")
        return
    _check_env_charset(rep, flow, root, info)
    max_tokens = node.attrs.get("max_tokens")
    data = dict(node.inputs).get("prompts")
    if not isinstance(max_tokens, int) or data is None or data not in flow.prompts:
        return
    if root.source in TINY_SOURCES:
        context = root.config.get("context")
        tok = tiny_tokenizer(root.config)
        longest = max((len(tok.encode(p)) for p in flow.prompts[data]), default=0) + (tok.bos_id is not None)
    else:
        context, longest = hf_positions(root.source[3:]), 1
    turns = int(info.spec["max_turns"])
    total = info.max_total or turns * max_tokens
    if not isinstance(context, int) or longest + total <= context:
        return
    room = context - longest
    if info.max_total:
        at = info.block["max_total"]
        rep.error(at.src, f"`max_total = {info.max_total}` and the longest prompt of `{data}` ({longest} tokens) "
                          f"need {longest + total} positions; model `{root.name}` has {context}", at.entry.value,
                  hint=f"`max_total` can be at most {room} here" if room >= 1 else
                  f"the prompts alone fill the positions: give `{root.name}` more (`context = {longest + total}`)")
        return
    msrc, mwhere = flow.written[(node.id, "max_tokens")]
    rep.error(msrc, f"`max_tokens = {max_tokens}` per turn x `max_turns = {turns}` of `{info.name}` and the longest "
                    f"prompt of `{data}` ({longest} tokens) need {longest + total} positions; model `{root.name}` "
                    f"has {context}", mwhere,
              hint=f"set `max_total = {room}` in `{info.name}` (a trajectory's response tokens), lower `max_tokens` "
                   f"to {room // turns}, or give `{root.name}` more positions" if room >= turns else
              f"give `{root.name}` more positions (`context = {longest + total}`)")


def _check_env_charset(rep: Reporter, flow: Flow, root: ModelDecl, info: EnvInfo) -> None:
    """Stop texts and tool markers a tiny model can write: each character in its `charset` (else <unk>)."""
    charset = root.config.get("charset")
    if root.source not in TINY_SOURCES or not isinstance(charset, str) or not charset:
        return
    keys = ("call", "end") if info.kind == "tool" else ("stop",)
    for key in keys:
        at = info.block.get(key)
        if at is None:
            continue
        texts = (info.spec["call"],) if key == "call" else tuple(info.spec["stop"])
        for text in texts:
            missing = sorted(set(text) - set(charset))
            if not missing:
                continue
            what = "stop text" if key == "stop" else "marker"
            rep.error(at.src, f"the {what} {_flow_string(text)} uses {_flow_string(''.join(missing))}, which is not "
                              f"in the charset of model `{root.name}`", at.entry.value,
                      hint=f"the model could never write it (each missing character is <unk>): add "
                           f"{'it' if len(missing) == 1 else 'them'} to `charset`, or use characters it has")
            break
