"""Tests for flowrl.engines.deepspeed_engine: DeepSpeed ZeRO steps equal TrainEngine's, checkpoints round-trip.

DeepSpeed runs on the CPU here (gloo, one process). Its process group lives as long as the pytest process.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import deepspeed  # noqa: E402,F401  (the deepspeed extra is part of the test set-up: missing fails, not skips)
import pytest
import torch
from torch import Tensor, nn

from flowrl.engines.deepspeed_engine import DeepSpeedTrainEngine  # noqa: E402
from flowrl.engines.forward import forward_logprobs  # noqa: E402
from flowrl.engines.select import forward_module  # noqa: E402
from flowrl.engines.training import TrainEngine  # noqa: E402
from flowrl.models.build import ModelSpec, build_model  # noqa: E402

# dim 160: the MLP weights (160 x 640 = 102,400 values) exceed ZeRO-3's persistence threshold (1e5), so stage 3
# really partitions them (smaller tensors stay whole on every rank).
TINY = {"layers": 1, "dim": 160, "heads": 2}
# The clip is active (grad norms are ~1.5). eps 1e-6, not 1e-8: Adam's first step is g / (|g| + eps), so with
# eps 1e-8 coordinates whose gradient is itself ~1e-8 turn float rounding differences between the two engines'
# norm computations into 2e-5 weight differences. Both engines get the same eps; the comparison stays exact.
HPARAMS: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 0.5, "eps": 1e-6}
Batch = tuple[Tensor, Tensor, Tensor, Tensor]

# DeepSpeed calls torch APIs torch has deprecated (ZeRO-3's collectives, its jit ops); those are DeepSpeed's to fix.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def _policy(seed: int = 0) -> Any:
    return build_model(ModelSpec("tiny:gpt2", TINY), seed=seed).module


def _batch(rows: int = 8, seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses, as the generation engine lays them out."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, 256, (rows, 6), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[::2, :2] = 0  # ragged prompts
    response_ids = torch.randint(0, 256, (rows, 5), generator=gen)
    response_mask = torch.ones_like(response_ids)
    response_mask[1::3, 3:] = 0  # ragged responses
    return prompt_ids, prompt_mask, response_ids, response_mask


def _micro(batch: Batch, size: int = 3) -> list[Batch]:
    rows = batch[0].shape[0]
    return [(batch[0][i : i + size], batch[1][i : i + size], batch[2][i : i + size], batch[3][i : i + size])
            for i in range(0, rows, size)]  # fmt: skip


def _nll_loss(module: nn.Module, total_tokens: int, *, nan: bool = False) -> Any:
    """Token-mean NLL of the mini-batch, scaled per micro-batch so the micro losses sum to it."""

    def loss_fn(mb: Batch) -> tuple[Tensor, dict[str, float]]:
        logprobs = forward_logprobs(module, *mb, with_grad=True)  # (b, T)
        loss = -(logprobs * mb[3]).sum() / total_tokens
        return loss * float("nan") if nan else loss, {"tokens": float(mb[3].sum())}

    return loss_fn


def _train(engine: Any, batches: list[Batch]) -> list[dict[str, float]]:
    """One optimizer step per mini-batch, each split into ragged micro-batches (3, 3, 2 rows)."""
    fwd = forward_module(engine)
    return [engine.step(_micro(b), _nll_loss(fwd, int(b[3].sum()))) for b in batches]


def _weights(engine: Any) -> dict[str, Tensor]:
    return engine.state_dict()["module"]


@pytest.mark.parametrize(("stage", "offload"), [(0, False), (1, False), (2, False), (2, True), (3, False)])
def test_matches_torch_engine_after_two_steps(stage: int, offload: bool) -> None:
    batches = [_batch(seed=0), _batch(seed=1)]
    torch_engine = TrainEngine(_policy(), **HPARAMS)
    ds_engine = DeepSpeedTrainEngine(_policy(), zero_stage=stage, offload=offload, **HPARAMS)
    expected, got = _train(torch_engine, batches), _train(ds_engine, batches)

    for want, have in zip(expected, got, strict=True):
        assert set(have) == set(want)  # loss, grad_norm, lr, skipped + the loss function's metrics
        assert have["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert have["tokens"] == pytest.approx(want["tokens"])  # averaged over micro-batches
        assert have["lr"] == want["lr"] and have["skipped"] == 0.0
    assert want["grad_norm"] > HPARAMS["max_grad_norm"]  # so clipping changed the update
    assert ds_engine.steps == torch_engine.steps == 2
    if stage == 3:  # partitioned: the raw module holds placeholders, state_dict() gathers the full weights
        assert any(v.numel() == 0 for v in ds_engine.module.state_dict().values())
    reference = torch_engine.module.state_dict()
    for name, value in _weights(ds_engine).items():
        assert value.shape == reference[name].shape, name  # ZeRO-3: gathered, not partitioned
        assert (value - reference[name]).abs().max() <= 1e-5, name  # measured: <= 3e-7


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_state_dict_round_trip_resumes_identically(stage: int) -> None:
    batch = _batch(seed=2)
    src = DeepSpeedTrainEngine(_policy(seed=1), zero_stage=stage, **HPARAMS)
    _train(src, [batch, batch])
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)  # what the runner's checkpoint does
    buf.seek(0)

    dst = DeepSpeedTrainEngine(_policy(seed=2), zero_stage=stage, **HPARAMS)  # everything must come from the file
    dst.load_state_dict(torch.load(buf, weights_only=False))
    assert dst.steps == 2
    m_src, m_dst = _train(src, [batch])[0], _train(dst, [batch])[0]
    assert m_src["loss"] == pytest.approx(m_dst["loss"], rel=1e-6)
    dst_weights = _weights(dst)
    for name, value in _weights(src).items():
        assert torch.allclose(value, dst_weights[name], atol=1e-7), name


def test_load_rejects_a_checkpoint_from_another_zero_stage() -> None:
    state = DeepSpeedTrainEngine(_policy(), zero_stage=0, **HPARAMS).state_dict()
    engine = DeepSpeedTrainEngine(_policy(), zero_stage=2, **HPARAMS)
    with pytest.raises(ValueError, match="written at ZeRO stage 0; this engine runs stage 2"):
        engine.load_state_dict(state)


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_gradients_skip_the_update(stage: int) -> None:
    engine = DeepSpeedTrainEngine(_policy(), zero_stage=stage, **HPARAMS)
    batch = _batch()
    _train(engine, [batch])  # AdamW moments exist, so a skipped step must also leave them alone
    before = _weights(engine)
    fwd = forward_module(engine)
    metrics = engine.step(_micro(batch), _nll_loss(fwd, int(batch[3].sum()), nan=True))
    assert metrics["skipped"] == 1.0 and engine.steps == 1
    assert not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    after = _weights(engine)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    # The engine is still usable: the next finite step updates again.
    assert _train(engine, [batch])[0]["skipped"] == 0.0 and engine.steps == 2


def test_set_lr_reaches_the_zero_optimizer() -> None:
    engine = DeepSpeedTrainEngine(_policy(), zero_stage=2, **HPARAMS)
    engine.set_lr(0.0)
    before = _weights(engine)
    metrics = _train(engine, [_batch()])[0]
    assert metrics["lr"] == 0.0 and engine.lr == 0.0
    after = _weights(engine)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match=r"zero_stage must be one of \(0, 1, 2, 3\), got 4"):
        DeepSpeedTrainEngine(_policy(), lr=1e-3, zero_stage=4)
    with pytest.raises(ValueError, match="offload needs ZeRO stage 1, 2 or 3"):
        DeepSpeedTrainEngine(_policy(), lr=1e-3, offload=True)
    frozen = build_model(ModelSpec("tiny:gpt2", TINY, role="reference"), seed=0).module
    with pytest.raises(ValueError, match="no trainable parameters"):
        DeepSpeedTrainEngine(frozen, lr=1e-3)
    engine = DeepSpeedTrainEngine(_policy(), lr=1e-3)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        engine.step([], _nll_loss(engine.module, 1))


# One rank of a two-process data-parallel run, as the ray backend's ranks run it: the process group exists before
# the engine (tcp init, like backends/ray/actor.py) and the engine joins it. Each rank trains on its half of every
# mini-batch with losses scaled by the whole mini-batch's token count, so the summed gradient is the full one.
_RANK_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    import test_deepspeed as t
    from flowrl.engines.deepspeed_engine import DeepSpeedTrainEngine
    from flowrl.engines.select import forward_module
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for stage in (0, 2, 3):
        engine = DeepSpeedTrainEngine(t._policy(), zero_stage=stage, **t.HPARAMS)
        fwd = forward_module(engine)
        for seed in (0, 1):
            batch = t._batch(seed=seed)
            shard = tuple(x[rank::2] for x in batch)
            results[stage] = engine.step(t._micro(shard, 2), t._nll_loss(fwd, int(batch[3].sum())))
        results[stage] = (results[stage], engine.module_state_dict())
    torch.save(results, out)
""")


def test_two_data_parallel_ranks_sum_gradients_like_one(tmp_path: Path) -> None:
    torch_engine = TrainEngine(_policy(), **HPARAMS)
    expected = _train(torch_engine, [_batch(seed=0), _batch(seed=1)])[-1]
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    here = str(Path(__file__).parent)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path / f"{r}.pt"), here], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]  # fmt: skip
    for proc in ranks:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-3000:]
    reference = torch_engine.module.state_dict()
    for r in (0, 1):
        results = torch.load(tmp_path / f"{r}.pt", weights_only=False)
        for stage, (metrics, weights) in results.items():
            assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (r, stage)
            for name, value in weights.items():
                assert (value - reference[name]).abs().max() <= 1e-5, (r, stage, name)
