"""flowrl.runtime.transport: model state through the object store as numpy arrays, back as tensors."""

from __future__ import annotations

import pickle

import torch

from flowrl.runtime.transport import Array, pack, unpack


def test_a_nested_state_comes_back_equal_in_every_dtype_and_owning_its_memory() -> None:
    state = {"module": {"w": torch.randn(3, 4), "b16": torch.randn(5).to(torch.bfloat16),
                        "half": torch.randn(2).half(), "step": torch.tensor(7.0), "ids": torch.arange(4)},
             "optim": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
             "none": None}
    packed = pickle.loads(pickle.dumps(pack(state)))  # as it travels
    assert isinstance(packed["module"]["b16"], Array) and packed["optim"]["param_groups"][0]["lr"] == 1e-3
    back = unpack(packed)
    for key, value in state["module"].items():
        assert back["module"][key].dtype == value.dtype and torch.equal(back["module"][key], value), key
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], torch.zeros(3)) and back["none"] is None
    back["optim"]["state"][0]["exp_avg"].add_(1.0)  # writable: not a view of the (read-only) store
    assert torch.equal(unpack(state)["module"]["w"], state["module"]["w"])  # plain tensors pass through
