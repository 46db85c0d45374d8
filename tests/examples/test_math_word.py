"""The math word-problem example: its data set is what its generator makes, every prompt is in the flow's
charset, `math_equal` grades the answers as written, and the documented real-checkpoint variant of the flow
(the README's GPU recipe) runs, here on a small local Hugging Face checkpoint on CPU."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import flowrl
from flowrl import run
from flowrl.rewards.math import math_equal

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLOW = EXAMPLES / "math_word.flow"
DATA = EXAMPLES / "data" / "math_word.jsonl"


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("make_math", EXAMPLES / "data" / "make_math.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_data_set_is_what_the_generator_makes() -> None:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    assert rows == _generator().problems()  # type: ignore[attr-defined]
    charset = flowrl.load(str(FLOW)).model("actor").config["charset"]
    assert _generator().CHARSET == charset  # type: ignore[attr-defined]
    for row in rows:
        assert set(row["prompt"]) <= set(charset), row["prompt"]


def test_math_equal_grades_every_answer_as_a_student_would_write_it() -> None:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    halves = 0
    for row in rows:
        prompt, gold = row["prompt"], row["answer"]
        frac = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", gold)
        if frac:
            halves += 1
            num, den = int(frac[1]), int(frac[2])
            right = [f"{num}/{den}", str(num / den), f"each gets \\boxed{{\\frac{{{num}}}{{{den}}}}}"]
            wrong = [f"{num + 1}/{den}", str(num)]
        else:
            right = [gold, f"{gold}.", f"the answer is {gold}"]
            wrong = [str(int(gold) + 1), ""]
        for text in right:
            assert math_equal(prompt, text, gold) == 1.0, (prompt, text, gold)
        for text in wrong:
            assert math_equal(prompt, text, gold) == 0.0, (prompt, text, gold)
    assert halves >= 3


def _tiny_checkpoint(path: Path, charset: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    n = len(charset)
    vocab = {c: i for i, c in enumerate(charset)} | {"<pad>": n, "<eos>": n + 1, "<unk>": n + 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(path)
    GPT2LMHeadModel(GPT2Config(vocab_size=n + 3, n_embd=32, n_layer=1, n_head=2, n_positions=128,
                               bos_token_id=None, eos_token_id=n + 1, pad_token_id=n)).save_pretrained(path)


def test_the_documented_real_checkpoint_variant_runs(tmp_path: Path) -> None:
    """The flow's comment says: replace the actor block with an `hf:` one and raise max_tokens. Done literally
    (a one-layer checkpoint standing in for Qwen), the flow runs and math_equal scores its answers."""
    text = FLOW.read_text(encoding="utf-8")
    documented = re.search(r"^#\s+(model actor : policy \{ source = \"hf:[^\n]*\})$", text, re.M)
    assert documented, "the flow documents its real-checkpoint actor block"
    ckpt = tmp_path / "ckpt"
    _tiny_checkpoint(ckpt, flowrl.load(str(FLOW)).model("actor").config["charset"])
    block = documented[1].replace("hf:/models/Qwen2.5-0.5B-Instruct", f"hf:{ckpt}")
    actor = re.search(r"^model actor : policy \{.*?^\}", text, re.M | re.S)
    assert actor
    flow = tmp_path / "math_word.flow"
    flow.write_text(text.replace(actor[0], block).replace("data/math_word.jsonl", str(DATA)), encoding="utf-8")
    graph = flowrl.load(str(flow), overrides={"use.max_tokens": "8", "run.steps": "2"})
    assert graph.model("actor").source == f"hf:{ckpt}"
    res = run(graph, out_dir=tmp_path / "out")
    assert len(res.metrics) == 2 and res.metrics[-1]["gen_tokens"] > 0
    assert res.metrics[-1]["reward/correct/errors"] == 0
