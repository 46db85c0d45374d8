"""Batch: splitting, selecting, concatenating and deriving keep samples aligned."""

from __future__ import annotations

import pytest
import torch

from flowrl.runtime.batch import Batch


def make(n: int = 5, width: int = 3) -> Batch:
    return Batch(n, {"response_mask": torch.ones(n, width), "group_id": torch.arange(n) // 2,
                     "x": torch.arange(n).float()}, {"prompt": [f"p{i}" for i in range(n)]}, primary="x")


def test_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="has 2 rows"):
        Batch(3, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="has 1 entries"):
        Batch(3, {}, {"m": [1]})


def test_split_and_concat_round_trip() -> None:
    b = make(7)
    parts = b.split(3)
    assert [p.size for p in parts] == [2, 3, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back.meta["prompt"] == b.meta["prompt"]
    assert [p.size for p in b.chunks(3)] == [3, 3, 1]
    assert b.chunks(0) == [b]


def test_concat_pads_to_widest() -> None:
    a = Batch(1, {"prompt_ids": torch.tensor([[5, 6]]), "response_ids": torch.tensor([[1]])})
    b = Batch(1, {"prompt_ids": torch.tensor([[7]]), "response_ids": torch.tensor([[2, 3]])})
    c = Batch.concat([a, b])
    assert c["prompt_ids"].tolist() == [[5, 6], [0, 7]]  # prompts stay left-padded
    assert c["response_ids"].tolist() == [[1, 0], [2, 3]]  # responses right-padded


def test_select_and_derive() -> None:
    b = make(4)
    s = b.select([3, 1])
    assert s["x"].tolist() == [3.0, 1.0] and s.meta["prompt"] == ["p3", "p1"]
    d = b.derive("scores", scores=torch.ones(4))
    assert set(d.tensors) == {"response_mask", "group_id", "scores"}
    assert d.value() is d["scores"] and d.value("group_id") is d["group_id"]


def test_merge_checks_sizes() -> None:
    with pytest.raises(ValueError, match="cannot merge"):
        make(3).merge(make(4))
    m = make(3).merge(Batch(3, {"y": torch.zeros(3)}), rename={"y": "z"})
    assert "z" in m.tensors
