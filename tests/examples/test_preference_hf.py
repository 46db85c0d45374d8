"""The preference pipelines on a real Hugging Face checkpoint: examples/sums_dpo.flow (SFT -> DPO) and
examples/sums_pipeline.flow (SFT -> reward model -> PPO) with their policy's `source` replaced by `hf:DIR`, a
2-layer GPT-2 (and a Llama, for the pipeline) written in tmp_path by `save_pretrained` with a character-level
`PreTrainedTokenizerFast` (its own EOS and pad ids, or none for pad; no BOS, or one; nothing downloaded). A few
steps a stage: every stage runs, its metrics are finite, the weights pass from stage to stage, and the reward model
built from the causal LM gets a value head and reports its held-out accuracy. Data longer than the checkpoint's
positions is fitted to them; a trained reward model's checkpoint scores PPO's rollouts with its own head."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch

import flowrl
from examples.judge_sums import Judge  # a flow's policy answering the 100 sums greedily
from flowrl import backends
from flowrl.compiler import compile_any
from flowrl.dsl.stages import Pipeline
from flowrl.errors import FlowError
from flowrl.models.tokenizer import CharTokenizer
from flowrl.runtime.model_init import init_model
from flowrl.runtime.pipeline import PipelineResult, run_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHARSET = "0123456789+="
POSITIONS = 64
UNK = len(CHARSET) + 1  # the id of <unk> in hf_checkpoint's vocabulary
TIMES = ("step_time_s", "tokens_per_s")


def save_tokenizer(path: Path, charset: str, specials: list[str]) -> dict[str, int]:
    """A character-level `PreTrainedTokenizerFast` saved to `path`: the characters, then `specials` (of `<eos>`,
    `<unk>`, `<pad>`, `<bos>`) in that order; its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(charset)} | {s: len(charset) + i for i, s in enumerate(specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # without it a word-level tokenizer decodes "15" as "1 5"
    named = {f"{s[1:-1]}_token": s for s in specials}
    PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(path)
    return vocab


def hf_checkpoint(path: Path, charset: str, *, bos: bool = False, pad: bool = True, family: str = "gpt2") -> None:
    """A 2-layer GPT-2 (or Llama, tied embeddings) with 64 positions and a character-level tokenizer over `charset`,
    saved as a Hugging Face directory: specials after the characters; with `bos` a BOS token (Llama's tokenizers
    have one), without `pad` no pad token (GPT-2's and Llama's ship without one)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    vocab = save_tokenizer(path, charset, ["<eos>", "<unk>", *(["<pad>"] if pad else []), *(["<bos>"] if bos else [])])
    ids: dict[str, Any] = {"bos_token_id": vocab.get("<bos>"), "eos_token_id": vocab["<eos>"],
                           "pad_token_id": vocab.get("<pad>")}
    torch.manual_seed(0)
    if family == "llama":
        LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=POSITIONS,
                                     tie_word_embeddings=True, **ids)).save_pretrained(path)
    else:
        GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=2, n_positions=POSITIONS,
                                   **ids)).save_pretrained(path)


def example(name: str, folder: Path) -> Path:
    """examples/NAME.flow written to `folder`, its data read from examples/data by absolute path."""
    text = (EXAMPLES / f"{name}.flow").read_text(encoding="utf-8")
    flow = folder / f"{name}.flow"
    flow.parent.mkdir(parents=True, exist_ok=True)
    flow.write_text(text.replace('jsonl("data/', f'jsonl("{EXAMPLES}/data/'), encoding="utf-8")
    return flow


def hf_flow(name: str, tmp_path: Path, *, ckpt: Path | None = None, **checkpoint: Any) -> tuple[Path, Path]:
    """examples/NAME.flow in tmp_path with the actor's block replaced by one on an `hf:` checkpoint (`ckpt`, else
    one `hf_checkpoint` makes; the shape keys belong to tiny sources); (flow, checkpoint)."""
    if ckpt is None:
        ckpt = tmp_path / "ckpt"
        hf_checkpoint(ckpt, CHARSET, **checkpoint)
    flow = example(name, tmp_path)
    text = flow.read_text(encoding="utf-8")
    actor = re.search(r"^model actor : policy \{.*?^\}", text, re.M | re.S)
    assert actor and 'source  = "tiny:gpt2"' in actor[0]
    flow.write_text(text.replace(actor[0], f'model actor : policy {{ source = "hf:{ckpt}", lr = 1e-3 }}'),
                    encoding="utf-8")
    return flow, ckpt


def run_staged(flow: Path, out: Path, overrides: dict[str, str]) -> tuple[Pipeline, PipelineResult]:
    pipe = compile_any(str(flow), overrides)
    assert isinstance(pipe, Pipeline)
    return pipe, run_pipeline(pipe, out_dir=out, backend=lambda stage: backends.make("local"))


def initial_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(ckpt).state_dict())




def greedy_answers(judge: Any, checkpoint: Path | None) -> list[str]:
    """The text of the policy's greedy answer (up to 3 tokens) to each sum, with `checkpoint`'s weights (None: the
    step-0 weights)."""
    return list(judge.responses(None if checkpoint is None else judge.checkpoint(checkpoint)))


def without_times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "cost/")) and k not in TIMES}


def finite(row: dict[str, Any]) -> bool:
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


# three steps a stage, DPO's held-out pairs scored at the third
DPO_STEPS = {"stage.sft.steps": "3", "stage.dpo.steps": "3", "stage.dpo.use.eval_every": "3",
             "run.checkpoint_every": "100", "pairs.batch": "16"}


@pytest.mark.parametrize("tokenizer", [{"bos": False, "pad": True}, {"bos": True, "pad": False}],
                         ids=["pad-no-bos", "bos-no-pad"])
def test_sft_then_dpo_on_a_hf_checkpoint(tmp_path: Path, tokenizer: dict[str, Any]) -> None:
    flow, ckpt = hf_flow("sums_dpo", tmp_path, **tokenizer)
    pipe, result = run_staged(flow, tmp_path / "out", DPO_STEPS)
    assert pipe.names == ("sft", "dpo")
    for stage in pipe.stages:
        assert stage.graph.model("actor").source == f"hf:{ckpt}"
    rows = result.metrics
    assert [(r["stage"], r["stage_step"]) for r in rows] == [("sft", 1), ("sft", 2), ("sft", 3),
                                                             ("dpo", 1), ("dpo", 2), ("dpo", 3)]
    assert all(finite(r) for r in rows)
    assert all(r["actor/sft_loss"] > 0 for r in rows[:3])
    assert "actor/eval/rewards/accuracies" in rows[-1]
    out = result.out_dir
    sft = torch.load(out / "stages/sft/models.pt")["actor"]
    dpo = torch.load(out / "stages/dpo/models.pt")
    # the reference is first used by DPO with source = actor: SFT's actor, never trained
    assert all(torch.equal(dpo["ref"][k], sft[k]) for k in sft)
    assert not all(torch.equal(dpo["actor"][k], sft[k]) for k in sft)
    initial = initial_weights(ckpt)
    assert not all(torch.equal(sft[k], initial[k]) for k in sft)  # SFT trained the checkpoint's weights on
    # DPO's first step: the policy is the reference, so its implicit rewards are 0 and its loss log 2
    assert rows[3]["actor/rewards/margins"] == 0.0
    assert abs(rows[3]["actor/dpo_loss"] - math.log(2)) < 1e-6


def test_the_tiny_actor_saved_as_a_checkpoint_trains_exactly_as_the_tiny_actor(tmp_path: Path) -> None:
    """The hf: path computes what the tiny path does: examples/sums_dpo.flow as it is, and the same flow on a
    checkpoint of its tiny actor's step-0 weights (as the workers build them) with a tokenizer of the same ids
    (CharTokenizer's: <pad>, <bos>, <eos>, <unk> after the characters) give the same metrics, bit for bit, at every
    step of SFT and DPO."""
    pipe = compile_any(str(example("sums_dpo", tmp_path / "tiny")), DPO_STEPS)
    assert isinstance(pipe, Pipeline)
    decls = {m.name: m for m in pipe.stage("sft").graph.models}
    actor = init_model(decls["actor"], decls, seed=0)  # the run's seed
    tok = actor.tokenizer
    assert isinstance(tok, CharTokenizer)
    ckpt = tmp_path / "ckpt"
    vocab = save_tokenizer(ckpt, tok.chars, ["<pad>", "<bos>", "<eos>", "<unk>"])
    assert (vocab["<pad>"], vocab["<bos>"], vocab["<eos>"], vocab["<unk>"]) == (tok.PAD, tok.BOS, tok.EOS, tok.UNK)
    cast(Any, actor.module).save_pretrained(ckpt)  # a GPT2LMHeadModel
    tiny = run_pipeline(pipe, out_dir=tmp_path / "tiny" / "out", backend=lambda stage: backends.make("local"))
    flow, _ = hf_flow("sums_dpo", tmp_path / "hf", ckpt=ckpt)
    _, hf = run_staged(flow, tmp_path / "hf" / "out", DPO_STEPS)
    assert len(hf.metrics) == 6
    assert [without_times(r) for r in hf.metrics] == [without_times(r) for r in tiny.metrics]
    # and the policy writes the same greedy answers to the 100 sums, as text, through either tokenizer (trained 3
    # + 3 steps it answers with EOS at once: its step-0 weights, whose answers are 3 characters long)
    last = max((tmp_path / "hf" / "out" / "stages" / "dpo" / "checkpoints").glob("step_*.pt"))
    judges = [Judge(str(f)) for f in (tmp_path / "tiny" / "sums_dpo.flow", flow)]
    for weights in (None, last):
        answers = [greedy_answers(j, weights) for j in judges]
        assert answers[0] == answers[1] and len(answers[0]) == 100
    assert all(len(a) == 3 for a in greedy_answers(judges[1], None))


# a causal LM's base transformer and its token embeddings, by family (a value model holds the base as `backbone.`)
FAMILIES = {"gpt2": ("transformer.", "wte.weight"), "llama": ("model.", "embed_tokens.weight")}


@pytest.mark.parametrize(("family", "bos"), [("gpt2", False), ("llama", True)])
def test_sft_then_reward_model_then_ppo_on_a_hf_checkpoint(tmp_path: Path, family: str, bos: bool) -> None:
    flow, ckpt = hf_flow("sums_pipeline", tmp_path, family=family, bos=bos)
    base, embed = FAMILIES[family]
    pipe, result = run_staged(flow, tmp_path / "out", {
        "run.steps": "3", "run.checkpoint_every": "100", "pairs.batch": "16", "prompts.batch": "4",
        "stage.rm.use.eval_every": "3", "stage.rm_anneal.use.eval_every": "3"})
    assert pipe.names == ("sft", "rm", "rm_anneal", "ppo")
    for stage in pipe.stages:
        assert all(m.source == f"hf:{ckpt}" for m in stage.graph.models)  # rm, critic, ref: source = actor
    rows = result.metrics
    assert [r["stage"] for r in rows] == ["sft"] * 3 + ["rm"] * 3 + ["rm_anneal"] * 3 + ["ppo"] * 3
    assert all(finite(r) for r in rows)
    held = [r["rm/eval_accuracy"] for r in rows if "rm/eval_accuracy" in r]
    assert len(held) == 2  # rm's and rm_anneal's third steps, each over the 200 held-out pairs
    assert all(0.0 <= a <= 1.0 and abs(a * 200 - round(a * 200)) < 1e-4 for a in held), held
    ppo = [r for r in rows if r["stage"] == "ppo"]
    assert all(r["gen_tokens"] > 0 for r in ppo)
    out = result.out_dir
    sft = torch.load(out / "stages/sft/models.pt")["actor"]
    rm = torch.load(out / "stages/rm/models.pt")["rm"]
    final = torch.load(out / "stages/ppo/models.pt")
    initial = initial_weights(ckpt)
    # the reward model is the causal LM's base transformer and a value head, its LM head dropped
    assert {k for k in rm if not k.startswith("backbone.")} == {"value_head.weight", "value_head.bias"}
    assert {k.removeprefix("backbone.") for k in rm if k.startswith("backbone.")} == {
        k.removeprefix(base) for k in sft if k.startswith(base)}
    assert sorted(final) == ["actor", "critic", "ref", "rm"]
    # ref is first used by PPO (source = actor): SFT's actor, never trained
    assert all(torch.equal(final["ref"][k], sft[k]) for k in sft)
    # The reward model starts the rm stage from SFT's backbone: the embedding row of <unk>, in no pair, gets no
    # gradient in a value model (no LM head), so it stays what SFT made it through the LM head (tied to the
    # embeddings), which is not the checkpoint's.
    wte = base + embed
    assert not torch.equal(sft[wte][UNK], initial[wte][UNK])
    assert torch.equal(rm["backbone." + embed][UNK], sft[wte][UNK])
    # PPO scores with the annealed reward model and never trains it
    annealed = torch.load(out / "stages/rm_anneal/models.pt")["rm"]
    assert all(torch.equal(final["rm"][k], annealed[k]) for k in annealed)
    assert not all(torch.equal(annealed[k], rm[k]) for k in rm)


LONG_FLOW = """flow long
model actor  : policy       {{ source = "hf:{ckpt}", lr = 1e-3 }}
model ref    : reference    {{ source = actor }}
model rm     : reward_model {{ source = actor, lr = 1e-3 }}
model critic : critic       {{ source = actor, lr = 1e-3 }}
data demos   = jsonl("demos.jsonl") {{ batch = 2 }}
data pairs   = jsonl("pairs.jsonl") {{ batch = 2 }}
data prompts = jsonl("prompts.jsonl") {{ batch = 2 }}
run {{ seed = 0, steps = 1 }}
stage sft {{ use sft(demos = demos) }}
stage rm  {{ use reward_model(pairs = pairs) }}
stage ppo {{ use ppo(reward = rm, group = 2, max_tokens = 4) }}
"""


def test_pairs_longer_than_the_checkpoints_positions_are_cut_and_prompts_left_out(tmp_path: Path) -> None:
    """A demonstration and a pair longer than the checkpoint's 64 positions are fitted to them, as a tiny model's
    are to its `context`: the graph's config carries the checkpoint's positions (the workers used 512 for every
    hf: model, and the position embeddings' lookup failed with an IndexError). A prompt too long to generate from
    is left out of the run, said in run.json (flowrl.runtime.overlong), and the prompt that fits trains."""
    ckpt = tmp_path / "ckpt"
    hf_checkpoint(ckpt, CHARSET)
    long_prompt = "12+34=" * 12  # 72 tokens
    rows: dict[str, list[dict[str, object]]] = {
        "demos": [{"prompt": long_prompt, "response": "46" * 20}] * 2,
        "pairs": [{"prompt": long_prompt, "chosen": "46" * 20, "rejected": "47" * 20}] * 2,
        "prompts": [{"prompt": long_prompt, "answer": 46}, {"prompt": "12+34=", "answer": 46}]}
    for name, table in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table), encoding="utf-8")
    (tmp_path / "long.flow").write_text(LONG_FLOW.format(ckpt=ckpt), encoding="utf-8")
    pipe, result = run_staged(tmp_path / "long.flow", tmp_path / "out", {})
    for stage in pipe.stages:
        assert {m.name: m.config.get("context") for m in stage.graph.models} == dict.fromkeys(
            (m.name for m in stage.graph.models), POSITIONS)
    assert [r["stage"] for r in result.metrics] == ["sft", "rm", "ppo"]
    assert all(finite(r) for r in result.metrics)
    assert result.metrics[-1]["gen_tokens"] > 0
    left_out = json.loads((tmp_path / "out" / "stages" / "ppo" / "run.json").read_text())["overlong_prompts"]
    assert [(o["data"], o["dropped"], o["rows"], o["room"]) for o in left_out] == [("prompts", 1, 2, POSITIONS - 4)]


def test_ppo_scores_with_a_reward_model_checkpoints_own_head(tmp_path: Path) -> None:
    """A reward model's `source` may be a trained reward model's checkpoint (a one-label GPT2ForSequenceClassification,
    as TRL's RewardTrainer saves one), scoring PPO's rollouts with no training here: its `score` head gives the
    reward. Built so its reward is 0.5 for any text (final layer norm 0 * x + 1, head 0.5 / 32 per unit), it scores
    every rollout 0.5; a fresh value head (what flowrl used to give it) scores something else."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    hf_checkpoint(tmp_path / "policy", CHARSET)
    hf_checkpoint(tmp_path / "rm", CHARSET)  # the same tokenizer; the model replaced by a reward model
    cfg = GPT2Config.from_pretrained(tmp_path / "rm")
    cfg.num_labels = 1
    rm = GPT2ForSequenceClassification(cfg)
    with torch.no_grad():
        rm.transformer.ln_f.weight.zero_()
        rm.transformer.ln_f.bias.fill_(1.0)
        rm.score.weight.fill_(0.5 / cfg.n_embd)
    rm.save_pretrained(tmp_path / "rm")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": 2 * a}) + "\n"
                                                    for a in range(4)), encoding="utf-8")
    (tmp_path / "ppo.flow").write_text(f"""flow ppo_hf_rm
model actor  : policy       {{ source = "hf:{tmp_path / 'policy'}", lr = 1e-3 }}
model ref    : reference    {{ source = actor }}
model critic : critic       {{ source = actor, lr = 1e-3 }}
model rm     : reward_model {{ source = "hf:{tmp_path / 'rm'}" }}
data prompts = jsonl("prompts.jsonl") {{ batch = 4 }}
run {{ seed = 0, steps = 2 }}
use ppo(reward = rm, group = 2, max_tokens = 3)
""", encoding="utf-8")
    graph = flowrl.load(str(tmp_path / "ppo.flow"))
    assert graph.model("rm").trainable is False  # scores only: flowrl check lets an hf: reward model score at once
    rows = flowrl.run(graph, out_dir=tmp_path / "out").metrics
    assert [r["reward_mean"] for r in rows] == pytest.approx([0.5, 0.5], abs=1e-6)
    assert [r["reward_std"] for r in rows] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert all(finite(r) and r["gen_tokens"] > 0 for r in rows)


def test_a_pipeline_scoring_with_an_untrained_head_on_a_causal_lms_checkpoint_is_an_error(tmp_path: Path) -> None:
    """`flowrl check` lets a reward model score before any stage trains it only from a reward model's checkpoint:
    a causal LM's gets a new value head, as `tiny:` or `source = actor` ones do, and is refused as they are."""
    from transformers import GPT2ForSequenceClassification

    hf_checkpoint(tmp_path / "lm", CHARSET)
    hf_checkpoint(tmp_path / "rm", CHARSET)
    GPT2ForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=1).save_pretrained(tmp_path / "rm")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n", encoding="utf-8")
    text = f"""flow scored
model actor  : policy       {{ source = "hf:{tmp_path / 'lm'}" }}
model ref    : reference    {{ source = actor }}
model critic : critic       {{ source = actor }}
model rm     : reward_model {{ source = "hf:RM" }}
data prompts = jsonl("prompts.jsonl") {{ batch = 1 }}
stage ppo {{ use ppo(reward = rm, max_tokens = 3) }}
"""
    flow = tmp_path / "scored.flow"
    flow.write_text(text.replace("RM", str(tmp_path / "lm")), encoding="utf-8")
    with pytest.raises(FlowError) as e:
        compile_any(str(flow))
    assert e.value.render() == f"""{flow}:7:17: error: reward model `rm` scores rollouts in stage `ppo`, but no earlier stage trains it and its checkpoint "{tmp_path / 'lm'}" is not a reward model's (a one-label ...ForSequenceClassification): it gets a new value head
    stage ppo {{ use ppo(reward = rm, max_tokens = 3) }}
                    ^^^
hint: train it in an earlier stage, or give it a checkpoint source"""
    flow.write_text(text.replace("RM", str(tmp_path / "rm")), encoding="utf-8")
    assert isinstance(compile_any(str(flow)), Pipeline)  # a reward model's checkpoint scores as it is
