"""Parquet files, `datasets` directories and chat-message prompts (flowrl.data.tables, flowrl.data.chat), on
files the tests make with pyarrow and the `datasets` package itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.data.chat import render_chat, render_plain
from flowrl.data.tables import ROW_KINDS, check_rows, read_disk_dataset, read_parquet, read_rows
from flowrl.errors import DataError

PAIRS = [  # an Arrow column has one type: a file's prompts are all text or all chat messages
    {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}], "chosen": "5",
     "rejected": "6"},
    {"prompt": [{"role": "user", "content": "1+1="}], "chosen": "2", "rejected": "3"},
]


def test_parquet_rows_load_with_chat_prompts(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist(PAIRS), path)
    rows = read_parquet(path)
    assert rows == PAIRS
    check_rows(rows, str(path), ROW_KINDS["pairs"])  # no error


def test_datasets_directory_loads_without_the_datasets_package_at_read_time(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}])
    ds.save_to_disk(str(tmp_path / "demos"))
    assert read_disk_dataset(tmp_path / "demos") == [{"prompt": "a", "response": "b"},
                                                      {"prompt": "c", "response": "d"}]
    assert read_rows("datasets", tmp_path / "demos")[1]["response"] == "d"


def test_a_dataset_dict_directory_says_to_name_a_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError) as e:
        read_disk_dataset(tmp_path / "dd")
    assert e.value.diagnostics[0].message == (
        f"not a datasets directory (no state.json): {tmp_path / 'dd'} (a DatasetDict: name a split, e.g. "
        f"{tmp_path / 'dd' / 'train'})")
    assert read_disk_dataset(tmp_path / "dd" / "train") == [{"prompt": "a"}]


def test_missing_files_and_columns_are_located(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data file not found"):
        read_parquet(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match="datasets directory not found"):
        read_disk_dataset(tmp_path / "nope")
    bad = [{"prompt": "x", "chosen": "y"}, {"prompt": 3, "chosen": "a", "rejected": "b"},
           {"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}]
    with pytest.raises(DataError) as e:
        check_rows(bad, "prefs.parquet", ROW_KINDS["pairs"])
    messages = [d.message for d in e.value.diagnostics]
    assert messages == [
        "prefs.parquet, row 1: no column 'rejected'",
        "prefs.parquet, row 2: column 'prompt' is int, not text",
        "prefs.parquet, row 3: the chat prompt message 1 has no string \"content\"",
    ]
    assert e.value.diagnostics[0].hint == "its columns: chosen, prompt; this use needs prompt, chosen, rejected"


def test_a_file_that_is_not_parquet_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "x.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match="cannot read parquet file"):
        read_parquet(path)


def test_tiny_models_render_messages_with_the_plain_template() -> None:
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+3="}]
    assert render_plain(messages) == "add\n2+3="
    assert render_chat(messages, None) == "add\n2+3="
    assert render_chat([{"role": "user", "content": "2+3="}]) == "2+3="


def test_hf_models_render_with_their_chat_template(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flowrl.models.tokenizer import HFTokenizer

    raw = RawTokenizer(models.WordLevel({"<eos>": 0, "<unk>": 1}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>",
                            chat_template=template).save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    assert render_chat([{"role": "user", "content": "hi"}], tok) == "<user>hi<assistant>"
