"""`flowrl export RUN_DIR -o DIR` on real runs (flowrl.runtime.export_run, flowrl.runtime.export): a tiny run and an
`hf:` run on the local backend, a run on the process backend with two ranks and DeepSpeed ZeRO-3 runs on one rank
and on two (whose checkpoints keep partitioned tensors as empty placeholders) each export whole weights, which a
fresh Python without flowrl (tests/models/hf_elsewhere.py) loads with the logits and greedy answers of flowrl's
model built from the run's checkpoint. A trained reward model exports as a one-label classifier that transformers
and a flow's `hf:` source both score as flowrl did. A pipeline's run exports from the last stage holding the model;
`run { export }` writes OUT/hf/MODEL/ without changing the run; every mistake is one rendered error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import flowrl
from flowrl import cli
from flowrl.engines.generation import generate
from flowrl.models.build import LoadedModel, ValueModel
from flowrl.runtime.carry import checkpoint_weights
from flowrl.runtime.model_init import init_model
from flowrl.runtime.prompts import PromptEncoder
from tests.models.hf_elsewhere import load_elsewhere

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHARSET = "0123456789+="
PROMPTS = ["1+2=", "7+8=", "4+"]
IDS = [[13, 1, 10, 2, 11], [13, 7, 10, 8, 11]]  # 13: tiny:gpt2's <bos> over CHARSET, hf_source's <unk>
MAX_NEW = 4

GRPO = """flow tiny
model actor : policy {{ source = {source}, lr = 3e-3{shape} }}
model ref : reference {{ source = actor }}
reward digits = "digits.reward"
data prompts = jsonl("{data}") {{ batch = 4 }}
use grpo(reward = digits, group = 4, max_tokens = 3, kl_coef = 0.01)
run {{ steps = 2, seed = 7{run} }}
"""
TINY = ', layers = 1, dim = 32, heads = 2, charset = "0123456789+="'
# dim 160: ZeRO-3 partitions tensors over 1e5 values (the MLP's 160 x 640), as tests/engines/test_deepspeed.py
DS3 = ', layers = 1, dim = 160, heads = 2, charset = "0123456789+=", engine = "deepspeed", zero_stage = 3'


def write_flow(folder: Path, *, source: str = '"tiny:gpt2"', shape: str = TINY, run: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # a reward that differs within a group from the first step (arith_exact is 0 for an untrained policy: no update)
    (folder / "digits.py").write_text("def reward(prompt, response, **_):\n"
                                      "    return float(sum(c.isdigit() for c in response))\n", encoding="utf-8")
    flow = folder / "tiny.flow"
    flow.write_text(GRPO.format(source=source, shape=shape, data=folder / "data.jsonl", run=run), encoding="utf-8")
    return flow


def train(flow: Path, out: Path, backend: str = "local", **overrides: Any) -> Path:
    flowrl.run(flowrl.load(str(flow), overrides=overrides), out_dir=out, backend=backend)
    return out


def flowrl_model(flow: Path, out: Path, name: str = "actor", **overrides: Any) -> LoadedModel:
    """`name` as the run's workers build it (init_model), with the weights of the run's last checkpoint, read here
    without the export's code: the trainer's gathered copy where ZeRO-3 left the module's tensor empty."""
    graph = flowrl.load(str(flow), overrides=overrides)
    decls = {m.name: m for m in graph.models}
    loaded = init_model(decls[name], decls, seed=0)
    state = torch.load(sorted((out / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)
    held = next(g[name] for g in state["groups"].values() if name in g)
    gathered = (held.get("optim") or {}).get("module", {})
    loaded.module.load_state_dict({k: gathered[k] if v.numel() == 0 else v for k, v in held["module"].items()})
    return loaded


def export(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["export", *args])
    got = capsys.readouterr()
    return code, got.out, got.err


def greedy(loaded: LoadedModel) -> list[list[int]]:
    ids = PromptEncoder(loaded.tokenizer, 64).ids(PROMPTS, MAX_NEW)
    out = generate(loaded.module, loaded.tokenizer, ids, max_tokens=MAX_NEW, temperature=0.0)
    return [row[:n] for row, n in zip(out.response_ids.tolist(), out.response_lens.tolist(), strict=True)]


def hf_source(path: Path) -> None:
    """A 1-layer GPT-2 with a character tokenizer and a chat template, written with `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARSET)} | {"<eos>": 12, "<unk>": 13, "<pad>": 14}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(path)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=15, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=12,
                               pad_token_id=14)).save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case's run exported with `flowrl export`, flowrl's model from the run, and what a fresh Python without
    flowrl read from the export (one such process for every case)."""
    root = tmp_path_factory.mktemp("runs")
    hf_source(root / "source")
    cases: dict[str, tuple[Path, str, dict[str, Any]]] = {
        "tiny": (write_flow(root / "tiny"), "local", {}),
        "hf": (write_flow(root / "hf", source=f'"hf:{root / "source"}"', shape=""), "local", {}),
        "process x2": (write_flow(root / "process"), "process", {"actor.replicas": 2}),
        "zero-3": (write_flow(root / "zero3", shape=DS3), "local", {}),
        "zero-3 process x2": (write_flow(root / "zero3x2", shape=DS3), "process", {"actor.replicas": 2}),
    }
    out: dict[str, Any] = {}
    jobs = []
    for name, (flow, backend, overrides) in cases.items():
        run_dir = train(flow, flow.parent / "run", backend, **overrides)
        code = cli.main(["export", str(run_dir), "-o", str(flow.parent / "hf")])
        assert code == 0
        out[name] = {"flow": flow, "run": run_dir, "hf": flow.parent / "hf",
                     "loaded": flowrl_model(flow, run_dir, **overrides)}
        jobs.append({"dir": str(flow.parent / "hf"), "kind": "causal", "ids": IDS, "texts": PROMPTS,
                     "prompts": PROMPTS, "max_new_tokens": MAX_NEW})
    for case, result in zip(out.values(), load_elsewhere(jobs, root / "elsewhere"), strict=True):
        case["there"] = result
    return out


@pytest.mark.parametrize("case", ["tiny", "hf", "process x2", "zero-3", "zero-3 process x2"])
def test_an_exported_run_gives_flowrls_logits_and_greedy_answers_without_flowrl(runs: dict[str, Any],
                                                                               case: str) -> None:
    loaded, there = runs[case]["loaded"], runs[case]["there"]
    with torch.no_grad():
        ours = loaded.module(torch.tensor(IDS)).logits.float()
    assert there["class"] == "GPT2LMHeadModel"
    torch.testing.assert_close(there["logits"], ours, atol=1e-5, rtol=1e-5)
    assert there["answers"] == greedy(loaded)
    assert there["prompt_ids"] == PromptEncoder(loaded.tokenizer, 64).ids(PROMPTS, MAX_NEW)


@pytest.mark.parametrize("case", ["tiny", "hf", "process x2", "zero-3", "zero-3 process x2"])
def test_the_export_holds_the_checkpoints_whole_weights(runs: dict[str, Any], case: str) -> None:
    exported = load_file(str(runs[case]["hf"] / "model.safetensors"))
    ours = runs[case]["loaded"].module.state_dict()
    assert exported and all(v.numel() > 0 for v in exported.values())
    for key, tensor in exported.items():
        assert torch.equal(tensor, ours[key]), key
    graph = flowrl.load(str(runs[case]["flow"]))
    decls = {m.name: m for m in graph.models}
    initial = init_model(decls["actor"], decls, seed=int(str(graph.run["seed"]))).module.state_dict()
    assert any(not torch.equal(ours[k], initial[k]) for k in exported)  # the trained weights, not step 0's


def test_a_zero3_checkpoint_keeps_partitioned_tensors_as_placeholders(runs: dict[str, Any]) -> None:
    """What the export had to read past: the module's own state of a ZeRO-3 model holds empty tensors."""
    state = torch.load(sorted((runs["zero-3"]["run"] / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)
    held = next(g["actor"] for g in state["groups"].values() if "actor" in g)
    assert [k for k, v in held["module"].items() if v.numel() == 0]
    assert all(v.numel() > 0 for v in checkpoint_weights(
        sorted((runs["zero-3"]["run"] / "checkpoints").glob("step_*.pt"))[-1])["actor"].values())


def test_an_hf_runs_export_keeps_the_sources_tokenizer(runs: dict[str, Any]) -> None:
    source = runs["hf"]["flow"].parent.parent / "source"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (runs["hf"]["hf"] / name).read_bytes() == (source / name).read_bytes()


def test_checkpoint_weights_prefers_the_group_that_trains(tmp_path: Path) -> None:
    """A model in two groups (split placement) is read from its trainer's group; a ZeRO-3 placeholder from the
    trainer's gathered copy."""
    stale, fresh = {"w": torch.zeros(2), "p": torch.zeros(3)}, {"w": torch.ones(2), "p": torch.ones(3)}
    state = {"groups": {"gen": {"actor": {"module": stale, "optim": None}},
                        "train": {"actor": {"module": {"w": fresh["w"], "p": torch.empty(0)},
                                            "optim": {"module": fresh, "optimizer": {}}}}}}
    torch.save(state, tmp_path / "step_000001.pt")
    got = checkpoint_weights(tmp_path / "step_000001.pt")["actor"]
    assert torch.equal(got["w"], fresh["w"]) and torch.equal(got["p"], fresh["p"])


RM_TRAIN = """flow rm_train
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=" }
model rm : reward_model { source = actor, lr = 1e-3 }
data pairs = jsonl("DATA/sum_pairs.jsonl") { batch = 16 }
use reward_model(margin = 0.0)
run { steps = 2, seed = 1 }
"""
RM_USE = """flow rm_use
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
model rm : reward_model { source = "hf:RM" }
data prompts = jsonl("DATA/sums.jsonl") { batch = 2 }
use grpo(reward = rm, group = 2, max_tokens = 2)
run { steps = 2, seed = 1 }
"""


def reward_flow(folder: Path, text: str, rm: Path | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "f.flow").write_text(text.replace("DATA", str(EXAMPLES / "data")).replace("RM", str(rm)),
                                   encoding="utf-8")
    return folder / "f.flow"


def test_a_reward_model_exports_as_a_classifier_that_scores_as_flowrl(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    flow = reward_flow(tmp_path / "rm", RM_TRAIN)
    run_dir = train(flow, tmp_path / "rm" / "run")
    code, out, _ = export(str(run_dir), "-o", str(tmp_path / "rm-hf"), capsys=capsys)  # the trained model: rm
    assert code == 0 and out == (f"wrote {tmp_path / 'rm-hf'}: `rm` (step 2) as GPT2ForSequenceClassification, "
                                 "float32\n")
    ours = flowrl_model(flow, run_dir, "rm")
    assert isinstance(ours.module, ValueModel)
    ids = [[13, 1, 10, 2, 11, 3, 14], [13, 7, 10, 8, 11, 1, 5]]  # <bos> a+b=c <eos>, and one cut off

    def scores(loaded: LoadedModel) -> torch.Tensor:
        with torch.no_grad():
            return loaded.module(torch.tensor(ids))[:, -1].float()  # (B,) on the last token, as `score` reads

    there = load_elsewhere([{"dir": str(tmp_path / "rm-hf"), "kind": "classifier", "ids": ids}], tmp_path / "else")[0]
    torch.testing.assert_close(there["logits"][:, 0], scores(ours), atol=1e-5, rtol=1e-5)
    # the same directory as a flow's reward model: built as the flow's workers build it, and run
    used = reward_flow(tmp_path / "use", RM_USE, tmp_path / "rm-hf")
    graph = flowrl.load(str(used))
    decls = {m.name: m for m in graph.models}
    torch.testing.assert_close(scores(init_model(decls["rm"], decls, seed=3)), scores(ours), atol=1e-5, rtol=1e-5)
    rows = flowrl.run(graph, out_dir=tmp_path / "use" / "run", backend="local").metrics
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["reward_mean"])) for r in rows)


PIPE = """flow staged
model actor : policy { source = "tiny:gpt2", layers = 1, dim = 32, heads = 2, charset = "0123456789+=", lr = 1e-3 }
model ref : reference { source = actor }
model rm : reward_model { source = actor, lr = 1e-3 }
reward correct = "flowrl.rewards.arith_exact"
data prompts = jsonl("data.jsonl") { batch = 4 }
data pairs = jsonl("PAIRS") { batch = 8 }
run { steps = 2, seed = 3, checkpoint_every = 1 }
stage rl { use grpo(reward = correct, group = 4, max_tokens = 3, kl_coef = 0.01) }
stage rm { use reward_model(pairs = pairs) }
"""


def test_a_pipelines_run_exports_from_the_last_stage_holding_the_model(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from flowrl import backends
    from flowrl.compiler import compile_any
    from flowrl.runtime.pipeline import run_pipeline

    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(3) for b in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "p.flow").write_text(PIPE.replace("PAIRS", str(EXAMPLES / "data" / "sum_pairs.jsonl")),
                                     encoding="utf-8")
    pipe = compile_any(str(tmp_path / "p.flow"))
    run_pipeline(pipe, out_dir=tmp_path / "out", backend=lambda stage: backends.make("local"))
    out = tmp_path / "out"
    # the trained policy, from the last stage that holds it: `rm` (its weights are the end of `rl`'s, carried)
    assert export(str(out), "-o", str(tmp_path / "a"), capsys=capsys)[1] == \
        f"wrote {tmp_path / 'a'}: `actor` (stage rm, step 2) as GPT2LMHeadModel, float32\n"
    end_of_rl = checkpoint_weights(out / "stages" / "rl" / "checkpoints" / "step_000002.pt")["actor"]
    assert all(torch.equal(v, end_of_rl[k]) for k, v in load_file(str(tmp_path / "a" / "model.safetensors")).items())
    assert export(str(out), "-o", str(tmp_path / "b"), "--model", "rm", capsys=capsys)[1] == \
        f"wrote {tmp_path / 'b'}: `rm` (stage rm, step 2) as GPT2ForSequenceClassification, float32\n"
    assert export(str(out), "-o", str(tmp_path / "c"), "--stage", "rl", "--step", "1", capsys=capsys)[1] == \
        f"wrote {tmp_path / 'c'}: `actor` (stage rl, step 1) as GPT2LMHeadModel, float32\n"
    step1 = checkpoint_weights(out / "stages" / "rl" / "checkpoints" / "step_000001.pt")["actor"]
    assert all(torch.equal(v, step1[k]) for k, v in load_file(str(tmp_path / "c" / "model.safetensors")).items())
    assert export(str(out), "-o", str(tmp_path / "d"), "--stage", "rll", capsys=capsys)[2] == (
        f"error: no stage named `rll` in the pipeline's run in {out} (its stages: `rl` or `rm`)\n"
        "hint: did you mean `rl`?\n")
    assert export(str(out), "-o", str(tmp_path / "d"), "--stage", "rl", "--model", "rm", capsys=capsys)[2] == (
        f"error: no model named `rm` in stage `rl` of the pipeline's run in {out} (its models: `actor` or `ref`)\n")


@pytest.mark.parametrize("mode", ["final", "every"])
def test_run_export_writes_the_model_during_the_run_and_changes_nothing_else(tmp_path: Path, mode: str) -> None:
    flow = write_flow(tmp_path, run=f', checkpoint_every = 1, export = "{mode}"')
    seen: list[bool] = []
    graph = flowrl.load(str(flow))
    rows = flowrl.run(graph, out_dir=tmp_path / "run", backend="local",
                      on_step=lambda step, row: seen.append((tmp_path / "run" / "hf" / "actor").exists())).metrics
    assert seen == [False, mode == "every"]  # at step 2's row: written at step 1's checkpoint only with "every"
    exported = load_file(str(tmp_path / "run" / "hf" / "actor" / "model.safetensors"))
    final = checkpoint_weights(tmp_path / "run" / "checkpoints" / "step_000002.pt")["actor"]
    assert all(torch.equal(v, final[k]) for k, v in exported.items())
    # the same run without the export, over it (--overwrite): the same numbers, and the replaced run's export gone
    plain = flowrl.run(flowrl.load(str(flow), overrides={"run.export": '"none"'}), out_dir=tmp_path / "run",
                       backend="local", overwrite=True).metrics
    times = ("step_time_s", "tokens_per_s")
    strip = [[{k: v for k, v in r.items() if k not in times and not k.startswith(("time/", "cost/"))} for r in rs]
             for rs in (rows, plain)]
    assert strip[0] == strip[1]
    assert not (tmp_path / "run" / "hf").exists()


def test_mistakes_are_one_rendered_error(runs: dict[str, Any], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = runs["tiny"]["run"]
    (tmp_path / "bare").mkdir()
    shutil.copy(run_dir / "graph.json", tmp_path / "bare" / "graph.json")  # a run that has not checkpointed yet
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("", encoding="utf-8")
    cases = [
        ([str(tmp_path / "nope"), "-o", str(tmp_path / "o")],
         f"error: no run directory at {tmp_path / 'nope'}\nhint: give the --out directory of `flowrl run`\n"),
        ([str(tmp_path / "busy"), "-o", str(tmp_path / "o")],
         f"error: {tmp_path / 'busy'} holds no run (no graph.json)\nhint: give the --out directory of `flowrl run`\n"),
        ([str(tmp_path / "bare"), "-o", str(tmp_path / "o")],
         f"error: {tmp_path / 'bare'} holds no checkpoint (checkpoints/step_*.pt)\n"
         "hint: a run writes one every `checkpoint_every` steps and at its last step\n"),
        ([str(run_dir), "-o", str(tmp_path / "o"), "--model", "actr"],
         f"error: no model named `actr` in the run in {run_dir} (its models: `actor` or `ref`)\n"
         "hint: did you mean `actor`?\n"),
        ([str(run_dir), "-o", str(tmp_path / "o"), "--step", "7"],
         f"error: {run_dir} holds no checkpoint of step 7 (it has steps 2)\nhint: leave --step out for the last\n"),
        ([str(run_dir), "-o", str(tmp_path / "busy")],
         f"error: cannot write the export to {tmp_path / 'busy'}: it is not empty\n"
         "hint: choose a new or empty directory, or replace the model directory there with --overwrite\n"),
        ([str(run_dir), "-o", str(tmp_path / "busy"), "--overwrite"],
         f"error: cannot write the export to {tmp_path / 'busy'}: it is not empty and is not a model directory (no "
         "config.json), so --overwrite leaves it alone\nhint: choose a new or empty directory\n"),
        ([str(run_dir), "-o", str(tmp_path / "o"), "--stage", "rl"],
         f"error: --stage picks a stage of a pipeline's run; {run_dir} holds one run (no pipeline.json)\n"),
    ]
    for args, message in cases:
        assert export(*args, capsys=capsys) == (1, "", message), args
    assert not (tmp_path / "o").exists()
    assert export(str(run_dir), "-o", str(runs["tiny"]["hf"]), "--overwrite", capsys=capsys)[0] == 0
