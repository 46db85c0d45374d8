"""Data as verl's preprocessing writes it (issue 33, item 5): a parquet file laid out as verl's
`examples/data_preprocess/gsm8k.py` writes it — chat-message `prompt`, `data_source`, `ability`, nested
`reward_model = {"style": "rule", "ground_truth": ...}` and `extra_info = {split, index, answer, question}` —
trains unchanged with `flowrl.rewards.math_equal`, through `columns = ["answer = reward_model.ground_truth"]` or
with no mapping at all (math_equal reads verl's `ground_truth`); a path a row lacks is a located check error; and
prompts longer than the model leaves them are left out of the run with a count (verl's filter_overlong_prompts),
the count checked against transformers' own tokenisation of the chat template for an `hf:` model."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.dsl import compile_flow
from flowrl.errors import FlowError
from flowrl.ir.graph import Graph
from flowrl.runtime.batch import Batch
from flowrl.runtime.overlong import filter_overlong
from flowrl.runtime.runner import close_scorers, loaders_of, scorers_of

pytestmark = pytest.mark.usefixtures("in_tmp")

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py's
# GSM8K-style problems (question, worked answer ending "#### N"), written for this test
PROBLEMS = [
    ("Tom has 3 boxes with 4 apples in each. How many apples does Tom have?", "3 * 4 = <<3*4=12>>12\n#### 12"),
    ("A pen costs $2. How much do 5 pens cost?", "5 * 2 = <<5*2=10>>10\n#### 10"),
    ("Ann read 7 pages on Monday and 9 on Tuesday. How many pages did she read?", "7 + 9 = <<7+9=16>>16\n#### 16"),
    ("A farm has 1,200 hens and sells 200. How many hens are left?", "1200 - 200 = <<1200-200=1000>>1000\n#### 1,000"),
    ("Sam splits 18 sweets among 3 friends. How many does each get?", "18 / 3 = <<18/3=6>>6\n#### 6"),
    ("A train goes 60 miles an hour for 2 hours. How far does it go?", "60 * 2 = <<60*2=120>>120\n#### 120"),
    ("A shop had " + ", then ".join(f"{k} more crates" for k in range(1, 30)) + ". How many crates were there?",
     "#### 435"),  # far longer than the others: past the tiny model's context below
]


def extract_solution(answer: str) -> str:
    """The final answer after "####", commas dropped (what verl's gsm8k.py stores as ground_truth)."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    assert found is not None
    return found.group(0).split("#### ")[1].replace(",", "")


def verl_rows(split: str, problems: list[tuple[str, str]] = PROBLEMS) -> list[dict[str, Any]]:
    """Rows as verl's gsm8k.py `process_fn(example, idx)` makes them."""
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
    } for idx, (question, answer) in enumerate(problems)]


def write_gsm8k(folder: Path) -> Path:
    """`train.parquet` as `datasets.Dataset.to_parquet` writes those rows (nested structs, a list of structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(verl_rows("train")), folder / "train.parquet")
    return folder / "train.parquet"


# context 224 leaves 220 prompt tokens beside max_tokens = 4: every problem fits but the last (byte tokens + <bos>)
FLOW = """flow gsm8k_verl
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, context = 224, lr = 1e-3 }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.math_equal"
data train = parquet("gsm8k/train.parquet") {{ batch = 2{keys} }}
use grpo(prompts = train, reward = correct, group = 2, max_tokens = 4)
run {{ steps = 2, seed = 0 }}
"""
MAPPED = ', columns = ["answer = reward_model.ground_truth"]'


def compile_in(folder: Path, keys: str = MAPPED) -> Graph:
    """The flow compiled as `folder/t.flow` (messages name it `t.flow`: the tests run in `folder`)."""
    write_gsm8k(folder / "gsm8k")
    (folder / "t.flow").write_text(FLOW.format(keys=keys), encoding="utf-8")
    return compile_flow(FLOW.format(keys=keys), "t.flow")


def scores(graph: Graph, responses: list[str]) -> list[float]:
    """The flow's reward on `responses` to its data's first rows, through the scorer a run uses."""
    rows = loaders_of(graph, seed=0)["train"].rows[:len(responses)]
    scorers = scorers_of(graph)
    try:
        batch = Batch(len(rows), {}, {"prompt": [str(r["prompt"]) for r in rows], "response": responses, "row": rows})
        return [float(v) for v in next(iter(scorers.values())).score(batch)["scores"].tolist()]
    finally:
        close_scorers(scorers)


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


RIGHT = ["3 * 4 = 12 apples. #### 12", "#### 10", "#### 16", "She has #### 1000 hens"]
WRONG = ["#### 13", "#### 11", "I don't know", "#### 100"]


def test_rows_keep_every_column_and_gain_the_mapped_answer(tmp_path: Path) -> None:
    graph = compile_in(tmp_path)
    assert dict(graph.data[0].options)["columns"] == ("answer = reward_model.ground_truth",)
    row = loaders_of(graph, seed=0)["train"].rows[3]
    assert row["answer"] == "1000" and row["reward_model"] == {"style": "rule", "ground_truth": "1000"}
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["extra_info"]["index"] == 3 and row["extra_info"]["split"] == "train"


@pytest.mark.parametrize("keys", [MAPPED, ""], ids=["columns", "no-mapping"])
def test_math_equal_scores_the_right_answer_one_through_the_nested_path(tmp_path: Path, keys: str) -> None:
    graph = compile_in(tmp_path, keys)
    assert scores(graph, RIGHT) == [1.0, 1.0, 1.0, 1.0]
    assert scores(graph, WRONG) == [0.0, 0.0, 0.0, 0.0]


def test_a_verl_gsm8k_parquet_trains_and_leaves_the_overlong_prompt_out(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    graph = compile_in(tmp_path)
    assert [w.message for w in graph.warnings] == [
        "`max_tokens = 4` leaves the prompts of `train` 220 of model `actor`'s 224 positions: 1 of 7 prompts are "
        "longer (the longest has 701 tokens with <bos>) and are left out of the run"]
    result = flowrl.run(graph, out_dir=tmp_path / "out", backend="local")
    assert [r["step"] for r in result.metrics] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["actor/grad_norm"] >= 0.0 for r in result.metrics)
    # the count, measured apart from flowrl: UTF-8 bytes of the rendered prompt (the tiny template is the
    # message's content) plus <bos>, against the context less max_tokens
    longer = sum(len(r["prompt"][0]["content"].encode()) + 1 > 224 - 4 for r in verl_rows("train"))
    assert longer == 1
    about = json.loads((tmp_path / "out" / "run.json").read_text())
    assert about["overlong_prompts"] == [{"data": "train", "model": "actor", "dropped": longer, "rows": 7,
                                          "room": 220, "context": 224, "max_tokens": 4, "longest": 701}]
    assert ("warning: data `train`: 1 of 7 prompts are longer than the 220 tokens model `actor` leaves them "
            "(context 224, max_tokens 4; the longest has 701); they are left out of the run") in capsys.readouterr().err


def test_a_path_no_row_has_is_located_at_the_mapping(tmp_path: Path) -> None:
    with pytest.raises(FlowError) as info:
        compile_in(tmp_path, ', columns = ["answer = reward_model.ground_truht"]')
    assert info.value.render() == textwrap.dedent("""\
        t.flow:5:69: error: gsm8k/train.parquet, row 1: no `reward_model.ground_truht`
            data train = parquet("gsm8k/train.parquet") { batch = 2, columns = ["answer = reward_model.ground_truht"] }
                                                                                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        hint: `reward_model` holds style, ground_truth; `columns` reads `reward_model.ground_truht`""")


@pytest.mark.parametrize(("value", "message"), [
    ('"answer reward_model.ground_truth"',
     '`columns`: "answer reward_model.ground_truth": write `NAME = PATH`, e.g. "answer = reward_model.ground_truth"'),
    ('["prompt = extra_info.question"]', "`columns` cannot set `prompt`: it is the prompt column"),
    ("[3]", "`columns` holds strings `NAME = PATH`, got the integer 3"),
    ('["a = data_source", "a = ability"]', "`columns` sets `a` twice"),
    ('["2x = ability"]', '`columns`: "2x = ability": `2x` is not a keyword a reward can take (letters, digits and _)'),
])
def test_a_malformed_mapping_is_located(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(FlowError) as info:
        compile_in(tmp_path, f", columns = {value}")
    head = info.value.render().splitlines()[0]
    assert head.startswith("t.flow:5:") and head.endswith(f"error: {message}"), head


def test_an_hf_models_overlong_count_agrees_with_transformers(tmp_path: Path) -> None:
    """The prompts `filter_overlong` leaves out are those whose chat-templated token count, as transformers'
    `apply_chat_template` counts it, exceeds the checkpoint's positions less `max_tokens`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    chars = sorted({c for q, _ in PROBLEMS for c in q + " " + INSTRUCTION} | set("<>userasint"))
    vocab = {c: i for i, c in enumerate(chars)} | {"<eos>": len(chars), "<unk>": len(chars) + 1}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    hf = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>",
                            chat_template=template).save_pretrained(hf)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2, n_positions=160)).save_pretrained(hf)
    write_gsm8k(tmp_path / "gsm8k")
    flow = FLOW.format(keys=MAPPED).replace(
        'source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, context = 224, lr = 1e-3', 'source = "hf:hf"')
    graph = compile_flow(flow, str(tmp_path / "t.flow"))
    assert not graph.warnings  # an hf: model's tokenizer is not loaded to check: the run counts
    loaders = loaders_of(graph, seed=0)
    dropped = filter_overlong(graph, loaders)

    tok = AutoTokenizer.from_pretrained(hf)
    counted = [tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True)
               for r in verl_rows("train")]
    lengths = [len(c["input_ids"] if isinstance(c, dict) or hasattr(c, "keys") else c) for c in counted]
    longer = [n > 160 - 4 for n in lengths]
    assert 0 < sum(longer) < len(longer), lengths  # the test means something: some fit, some don't
    assert [(d.data, d.dropped, d.rows, d.room, d.longest) for d in dropped] == [
        ("train", sum(longer), 7, 156, max(lengths))]
    kept = [r["extra_info"]["index"] for r in loaders["train"].rows]
    assert kept == [i for i, too_long in enumerate(longer) if not too_long]


def test_every_prompt_too_long_is_an_error_before_the_run(tmp_path: Path) -> None:
    graph = compile_in(tmp_path)
    loaders = loaders_of(graph, seed=0)
    loaders["train"].rows = loaders["train"].rows[-1:]  # the long one only
    with pytest.raises(FlowError) as info:
        filter_overlong(graph, loaders)
    assert info.value.render() == (
        "error: every prompt of data `train` is longer than the 220 tokens model `actor` leaves them (context 224, "
        "max_tokens 4; the shortest has 701)\nhint: lower `max_tokens`, or use a model with more positions")


def test_paths_step_into_lists_and_name_what_a_row_holds() -> None:
    from flowrl.data.paths import with_columns
    from flowrl.errors import DataError

    rows = verl_rows("test")[:2]
    got = with_columns(rows, {"q": "prompt.0.content", "i": "extra_info.index"}, "t.parquet")
    assert [(r["q"].split(" ")[0], r["i"]) for r in got] == [("Tom", 0), ("A", 1)]
    assert got[0]["reward_model"] == rows[0]["reward_model"] and "q" not in rows[0]  # the rows read are left as they are
    for path, shown in [("prompt.1.content", "t.parquet, row 1: no `prompt.1.content` (`prompt` is a list of 1)"),
                        ("ability.kind", "t.parquet, row 1: no `ability.kind` (`ability` is str, not an object)")]:
        with pytest.raises(DataError) as info:
            with_columns(rows, {"x": path}, "t.parquet")
        d = info.value.diagnostics[0]
        assert f"{d.message} ({d.hint})" == shown
    nulls = [{**rows[0], "reward_model": {"style": "rule", "ground_truth": None}}]
    with pytest.raises(DataError) as info:
        with_columns(nulls, {"answer": "reward_model.ground_truth"}, "t.parquet")
    assert info.value.diagnostics[0].message == "t.parquet, row 1: `reward_model.ground_truth` is null"


TEST_PROBLEMS = [  # verl's test split: other problems, written as gsm8k.py writes them
    ("Kim has 5 bags with 2 pens in each. How many pens does Kim have?", "5 * 2 = <<5*2=10>>10\n#### 10"),
    ("A cup costs $3. How much do 4 cups cost?", "4 * 3 = <<4*3=12>>12\n#### 12"),
    ("Eve has 20 stickers and gives away 5. How many are left?", "20 - 5 = <<20-5=15>>15\n#### 15"),
]


def test_an_eval_block_on_the_test_split_and_flowrl_eval_agree(tmp_path: Path) -> None:
    """verl's train and test parquet files: an `eval` block on the test split writes per-`data_source` figures,
    `flowrl eval RUN --data test.parquet --n 4` gives the run's last ones, and on another file its overlong-prompt
    warning names that file (not the eval block, whose data it is not)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_gsm8k(tmp_path / "gsm8k")
    pq.write_table(pa.Table.from_pylist(verl_rows("test", TEST_PROBLEMS)), tmp_path / "gsm8k" / "test.parquet")
    flow = FLOW.format(keys="").replace("use grpo", 'data test = parquet("gsm8k/test.parquet")\nuse grpo') + \
        "eval test { data = test, n = 4, temperature = 1.0 }\n"
    result = flowrl.run(compile_flow(flow, "t.flow"), out_dir=tmp_path / "out", backend="local")
    last = result.metrics[-1]
    assert {k for k in last if k.startswith("eval/test/openai/gsm8k/")} == {
        f"eval/test/openai/gsm8k/{m}" for m in ("mean@4", "pass@1", "pass@2", "pass@4", "maj@4", "response_len_mean")}
    got = flowrl.evaluate(str(tmp_path / "out"), data="gsm8k/test.parquet", n=4)
    assert (got.name, got.step, got.rows, got.left_out) == ("test", 2, 3, None)
    assert {f"eval/test/{k}": v for k, v in got.metrics.items()} == {k: v for k, v in last.items()
                                                                    if k.startswith("eval/test/")}
    other = flowrl.evaluate(str(tmp_path / "out"), data="gsm8k/train.parquet", n=4)
    assert other.rows == 6 and other.left_out == (
        "eval `gsm8k/train.parquet`: 1 of 7 prompts are longer than the 220 tokens model `actor` leaves them "
        "(context 224, max_tokens 4; the longest has 701); they are left out of the evaluation")
