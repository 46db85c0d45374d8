"""`data NAME = parquet(...)` and `data NAME = datasets(...)` beside `jsonl(...)`, and chat-message prompts in any
kind: compiled, checked (located errors) and run for a step on the local backend, on files the tests make."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import flowrl
from flowrl.data.jsonl import PromptLoader
from flowrl.data.tables import read_data
from flowrl.dsl import compile_flow
from flowrl.errors import DataError, FlowError
from flowrl.ir.graph import Graph
from flowrl.models.tokenizer import CharTokenizer
from flowrl.runtime.batch import Batch
from flowrl.runtime.controller import _prompt_batch
from flowrl.runtime.worker import prompt_texts

ROWS: list[dict[str, Any]] = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]
CHAT: list[dict[str, Any]] = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in ROWS]

FLOW = """flow t
model actor : policy {{ source = "tiny:gpt2", layers = 1, dim = 16, heads = 2, charset = "0123456789+=" }}
model ref : reference {{ source = actor }}
reward correct = "flowrl.rewards.arith_exact"
data prompts = {data} {{ batch = 4 }}
use grpo(reward = correct, group = 2, max_tokens = 2)
run {{ steps = 1, seed = 0 }}
"""


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def write_datasets(path: Path, rows: list[dict[str, Any]]) -> None:
    """A `save_to_disk` directory as the `datasets` package lays it out: state.json naming Arrow stream files."""
    import pyarrow as pa

    path.mkdir()
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def compile_in(folder: Path, data: str) -> Graph:
    return compile_flow(FLOW.format(data=data), str(folder / "t.flow"))


@pytest.mark.parametrize("kind, rows", [("parquet", ROWS), ("datasets", ROWS), ("parquet", CHAT),
                                        ("datasets", CHAT), ("jsonl", CHAT)])
def test_each_kind_compiles_and_runs_a_step(tmp_path: Path, kind: str, rows: list[dict[str, Any]]) -> None:
    name = {"parquet": "p.parquet", "datasets": "ds", "jsonl": "p.jsonl"}[kind]
    {"parquet": write_parquet, "datasets": write_datasets, "jsonl": write_jsonl}[kind](tmp_path / name, rows)
    graph = compile_in(tmp_path, f'{kind}("{name}")')
    assert [(d.kind, Path(d.path).name) for d in graph.data] == [(kind, name)]
    result = flowrl.run(graph, out_dir=tmp_path / "out", backend="local")
    assert len(result.metrics) == 1 and "reward_mean" in result.metrics[0]


def test_chat_prompts_reach_the_model_rendered_and_rewards_as_text(tmp_path: Path) -> None:
    chat = [{"prompt": [{"role": "system", "content": "1+1"}, {"role": "user", "content": "2+3="}], "answer": 5},
            {"prompt": "4+4=", "answer": 8}]
    write_jsonl(tmp_path / "c.jsonl", chat)
    rows = read_data("jsonl", tmp_path / "c.jsonl")
    batch = _prompt_batch(PromptLoader(rows, 2, False, 0))
    assert batch.meta["prompt"] == ["1+1\n2+3=", "4+4="]  # the tiny template, for rewards and logs
    assert batch.meta["messages"] == [chat[0]["prompt"], None]
    tok = CharTokenizer("0123456789+=\n")
    assert prompt_texts(batch, tok) == ["1+1\n2+3=", "4+4="]
    plain = _prompt_batch(PromptLoader([{"prompt": "1+2="}], 1, False, 0))
    assert "messages" not in plain.meta and prompt_texts(plain, tok) == ["1+2="]


class _Templated:
    """A tokenizer whose `hf` has a chat template (as `HFTokenizer` wraps one): what `render_chat` uses."""

    class hf:  # noqa: N801
        chat_template = "x"

        @staticmethod
        def apply_chat_template(messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_chat_prompts_use_the_models_chat_template() -> None:
    batch = Batch(1, {}, {"prompt": ["2+3="], "messages": [[{"role": "user", "content": "2+3="}]]})
    assert prompt_texts(batch, _Templated()) == ["<user>2+3=<assistant>"]  # type: ignore[arg-type]


def test_missing_file_and_directory_are_located_at_the_path(tmp_path: Path) -> None:
    for data, shown in [('parquet("no.parquet")', "data file not found: no.parquet"),
                        ('datasets("no_dir")', "datasets directory not found: no_dir")]:
        with pytest.raises(FlowError) as info:
            compile_in(tmp_path, data)
        head = info.value.render().split("\n")[0]
        assert head.endswith(f"error: {shown}") and ":5:" in head, head


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_bad_row_names_the_file_and_row(tmp_path: Path, kind: str) -> None:
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": None, "answer": 3}, {"prompt": "2+2=", "answer": 4}]
    name = "p.parquet" if kind == "parquet" else "ds"
    (write_parquet if kind == "parquet" else write_datasets)(tmp_path / name, rows)
    with pytest.raises(FlowError) as info:
        compile_in(tmp_path, f'{kind}("{name}")')
    text = info.value.render()
    assert f"error: {name}, row 2: column 'prompt' is NoneType, not text" in text, text


def test_a_missing_column_and_bad_chat_messages(tmp_path: Path) -> None:
    write_parquet(tmp_path / "q.parquet", [{"question": "1+1="}])
    with pytest.raises(FlowError) as info:
        compile_in(tmp_path, 'parquet("q.parquet")')
    assert "error: q.parquet, row 1: no column 'prompt'" in info.value.render()
    write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1+1="}, {"prompt": [{"role": "user"}]}])
    with pytest.raises(DataError) as err:
        read_data("jsonl", tmp_path / "m.jsonl")
    assert 'row 2: the chat prompt message 1 has no string "content"' in err.value.diagnostics[0].message
