"""Property: a flow that `flowrl check` accepts does not fail `run` with an internal error.

3,000 mutations of the shipped examples (examples/*.flow; seeded, so a failure reproduces): numbers and strings
replaced by edge values (0, -1, 1, huge, tiny, unknown names and devices), keys added to a block with such
values, tokens and lines deleted or duplicated, the text cut. Each one is checked as `flowrl check` does (parse,
lower, the checks across keys; then the default passes, as `run` compiles it). A rejection must be a FlowError
whose every diagnostic renders; any other exception fails the test.

Each flow that passes goes on through what `run` does before and at its first step, with the real components:
the data loaders (`flowrl.runtime.runner.loaders_of`) give their first batch; every model passes the engine check
a worker makes first (`check_engine`: a FlowError there fails the test unless `check` warned of that very
message, as it does for vLLM where this machine cannot run it); each
generation's model is built as a worker builds it (`flowrl.runtime.worker.init_model`, on the flow's device) and
runs its first forward at the full length a step needs: the longest prompt of the batch, encoded by the worker's
`PromptEncoder`, plus `max_tokens` positions. What is not run: sampling, the rewards, the updates (a real step
takes tens of seconds here; tests/runtime run real steps). Models over 20M parameters, or forwards over 4,096
positions, are not built (accepted by `check` and legitimate, just too slow here); built models are cached by
what makes them and a forward of the same model and length runs once, so repeats cost nothing.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import torch

from flowrl.compiler import optimize
from flowrl.dsl import compile_flow
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph, ModelDecl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEEDS = {p.name: p.read_text(encoding="utf-8") for p in sorted(EXAMPLES.glob("*.flow"))}
MUTATIONS = 3000
NUMBERS = ["0", "-1", "1", "2", "3", "5", "7", "12", "13", "100000", "1e-9", "0.0", "0.5", "1.0", "1.5", "600",
           "-0.5", "2..8", "8..2"]
STRINGS = ['"tiny:llama"', '"tiny:foo"', '"hf:nowhere"', '"cuda"', '"gpu"', '"cpu"', '"auto"', '"abc"',
           '"float16"', '"bfloat16"', '"deepspeed"', '"vllm"', '"zero"', '"k2"', '"seq-mean-token-sum"', '""',
           '"0123456789+= "']
ADDED = {  # keys added to a block, with values worth trying
    "model": ["context = 8", "context = 3", "dim = 48", "heads = 3", "heads = 6", "layers = 1", "vocab = 7",
              "dropout = 0.5", 'dtype = "bfloat16"', 'dtype = "float16"', 'charset = "0123456789"', "lr = 0",
              'source = "tiny:llama"', 'engine = "vllm"', 'engine = "deepspeed"', "offload = true", "zero_stage = 2"],
    "data": ["batch = 1", "batch = 64", "limit = 2", "limit = 1", "shuffle = false", 'prompt_key = "answer"'],
    "run": ['device = "cpu"', 'device = "cuda"', "max_staleness = 2", "seed = 7", "steps = 1"],
}
NUMBER = re.compile(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?(?![\w.])")
STRING = re.compile(r'"[^"\n]*"')
BLOCK = re.compile(r"^(model \w+ : \w+ \{|data \w+ = jsonl\([^)]*\) \{|run \{)", re.M)
WORD = re.compile(r"\w+|\S")


def mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["number", "number", "number", "string", "string", "add", "add", "token", "line", "cut"])
        if kind in ("number", "string"):
            found = list((NUMBER if kind == "number" else STRING).finditer(text))
            if found:
                m = rng.choice(found)
                text = text[:m.start()] + rng.choice(NUMBERS if kind == "number" else STRINGS) + text[m.end():]
        elif kind == "add":
            blocks = list(BLOCK.finditer(text))
            if blocks:
                m = rng.choice(blocks)
                what = "model" if m.group().startswith("model") else "data" if m.group().startswith("data") else "run"
                text = text[:m.end()] + " " + rng.choice(ADDED[what]) + "," + text[m.end():]
        elif kind == "token":
            tokens = list(WORD.finditer(text))
            m = rng.choice(tokens)
            text = text[:m.start()] + (m.group() * 2 if rng.random() < 0.3 else "") + text[m.end():]
        elif kind == "line":
            lines = text.split("\n")
            del lines[rng.randrange(len(lines))]
            text = "\n".join(lines)
        else:
            text = text[:rng.randrange(len(text) + 1)]
    return text


def _params(m: ModelDecl) -> int:
    """Roughly how many parameters a tiny model has (0 for other sources)."""
    c = m.config
    dim, layers = int(c.get("dim", 64)), int(c.get("layers", 2))
    return 12 * layers * dim * dim + (int(c.get("vocab", 0) or 0) + 300 + int(c.get("context", 512))) * dim


class FirstStep:
    """Runs what `run` does up to each generation's first forward, building each distinct model once."""

    def __init__(self) -> None:
        self.built: dict[Any, Any] = {}
        self.ran: set[Any] = set()  # (model, length) forwards already run: the same again proves nothing new
        self.forwards = self.skipped = self.refused = 0

    def __call__(self, graph: Graph) -> None:
        from flowrl.engines.select import check_engine
        from flowrl.runtime.runner import loaders_of
        from flowrl.runtime.worker import PromptEncoder, init_model, resolve_device

        seed = int(str(graph.run.get("seed", 0)))
        batches = {name: loader.next_batch() for name, loader in loaders_of(graph, seed).items()}
        device = resolve_device(str(graph.run.get("device", "auto")))
        decls = {m.name: m for m in graph.models}
        for m in graph.models:  # what each worker checks before it builds its models
            try:
                check_engine(m.engine, m.role, model=m.name, trainable=m.trainable, source=m.source,
                             device=str(device), options=m.options, loc=m.loc)
            except FlowError as e:  # fine only where check warned that run refuses it (vLLM on this machine)
                warned = [w.message for w in graph.warnings]
                if not all(any(d.message in w for w in warned) for d in e.diagnostics):
                    raise
                self.refused += 1
                return
        for node in graph.nodes:
            if node.op != "generate":
                continue
            decl = decls[str(node.model)]
            if any(_params(m) > 20_000_000 for m in graph.models):
                self.skipped += 1
                continue
            built = (decl.name, decl.source, decl.source_model, tuple(sorted(decl.config.items())),
                   tuple(sorted(decl.options.items())), tuple((m.name, m.source, tuple(sorted(m.config.items())))
                                                              for m in graph.models), seed)
            if built not in self.built:
                self.built[built] = init_model(decl, decls, seed)
            loaded = self.built[built]
            data = dict(node.inputs)["prompts"]
            key_of = {d.name: str(d.options.get("prompt_key", "prompt")) for d in graph.data}
            texts = [str(row[key_of[data]]) for _, row in batches[data]]
            max_tokens = int(str(node.attrs["max_tokens"]))
            context = int(loaded.module.config.n_positions if hasattr(loaded.module.config, "n_positions")
                          else loaded.module.config.max_position_embeddings)
            ids = PromptEncoder(loaded.tokenizer, context).ids(texts, max_tokens)
            length = max(len(i) for i in ids) + max_tokens
            if length > 4096:
                self.skipped += 1
                continue
            self.forwards += 1
            if (built, length, device) in self.ran:
                continue
            self.ran.add((built, length, device))
            longest = max(ids, key=len)
            row = longest + [loaded.tokenizer.eos_id] * max_tokens  # (T,) the prompt and a full response
            with torch.no_grad():
                loaded.module.to(device)(torch.tensor([row], device=device))


def _check(text: str, path: str) -> Graph | None:
    """The flow's graph as `check` and then `run` compile it; None when `check` rejects it (located)."""
    try:
        return optimize(compile_flow(text, path))
    except FlowError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            assert d.render()
        return None


def test_no_checked_flow_fails_its_first_step() -> None:
    first_step = FirstStep()
    rng = random.Random(25)
    names = sorted(SEEDS)
    accepted = 0
    failures: list[str] = []
    for i in range(MUTATIONS):
        name = rng.choice(names)
        text = mutate(rng, SEEDS[name])
        graph = _check(text, str(EXAMPLES / name))
        if graph is None:
            continue
        accepted += 1
        try:
            first_step(graph)
        except Exception as e:  # noqa: BLE001 — anything here is a flow `check` let through and `run` can't do
            failures.append(f"mutation {i} of {name}: {type(e).__name__}: {e}\n{text}")
    assert not failures, f"{len(failures)} flows passed check and failed their first step:\n" + "\n\n".join(
        failures[:3])
    assert accepted > MUTATIONS // 10  # the mutations reach the run path, not only the parser
    assert first_step.forwards > accepted // 2  # most accepted flows reach a forward (the rest: too big, refused)
