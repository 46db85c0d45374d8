"""The DeepSpeed training engine (flowrl.engines): ZeRO 0-3 behind the same interface as `TrainEngine`.

Chosen per model with `engine = "deepspeed"` (see flowrl.engines.select); `import deepspeed` happens only here,
lazily, with an error naming the extra to install.

The loss contract is TrainEngine's: `loss_fn` is called per micro-batch and scales its loss so the micro losses
SUM to the mini-batch loss. DeepSpeed's own accumulation would divide each loss by `gradient_accumulation_steps`,
so the engine runs in DeepSpeed's unmanaged mode (`managed_gradient_accumulation: false`): `backward` only
accumulates, every `engine.step()` is the boundary, and `backward(scale_wrt_gas=False)` adds no scaling. Across
data-parallel ranks the contract is TrainEngine's too: losses are scaled by the global mini-batch's denominators
and gradients are SUMMED (`gradient_allreduce_op: sum`; ZeRO-3 only averages, so there the loss is multiplied by
the world size). The engine joins a process group that already exists (the ray backend's ranks), else creates a
one-process group; the group lives as long as the process.

The optimizer is a client `torch.optim.AdamW`, so no FusedAdam/CPUAdam C++ op is JIT-compiled (also with
`offload`, where `zero_force_ds_cpu_optimizer` is switched off). Clipping and the skip of a non-finite update:
ZeRO 1-3 do both themselves (a non-finite norm counts as an overflow and the step is skipped, reported as
grad_norm inf); DeepSpeed's ZeRO-0 clips without reporting the norm and never skips, so at stage 0 its clipping is
off and an optimizer pre-step hook measures, clips and, on a non-finite norm, drops every gradient so AdamW leaves
all weights and moments untouched (grad_norm nan, as TrainEngine reports it).

Forward passes inside `loss_fn` must go through `forward_module` (the DeepSpeed engine, which registers the
backward prologue ZeRO needs), not the raw module: with the raw module ZeRO-3 trains silently wrong (measured on
the tiny GPT-2: a different grad norm, weights 0.04 off after two steps); `module` stays the plain `nn.Module`
for everything else (generation, log-probs without gradients).

Checkpoints (`state_dict`): ZeRO-0 saves the module and torch optimizer state dicts. ZeRO-1/2 save the module and
DeepSpeed's optimizer state, which holds the fp32 master partition and the AdamW moments of each rank: with several
data-parallel ranks every rank calls `state_dict` and rank 0 gathers the ranks' partitions into a list by rank
(restoring needs the same data-parallel size). ZeRO-3 partitions the weights themselves: `state_dict` gathers
them into full tensors (on every rank: memory of the whole model), and outside the engine `module.state_dict()`
returns empty placeholders for partitioned tensors, so weight sync must read `module_state_dict()` instead
(generation and no-grad forwards on the raw module still work: ZeRO-3's hooks gather the weights; they must run
under `flowrl.engines.forward.no_grad_mode`, which says why).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import math
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from flowrl.engines.training import MB, AdamWEngine, AdamWOptions, LossFn, data_parallel_world
from flowrl.errors import Diagnostic, FlowError

if TYPE_CHECKING:  # annotations only (typing.Unpack is 3.11+; typing_extensions comes with torch)
    from typing_extensions import Unpack

__all__ = ["INSTALL_HINT", "DeepSpeedTrainEngine", "import_deepspeed"]

INSTALL_HINT = "pip install 'flowrl[deepspeed]'"
ZERO_STAGES = (0, 1, 2, 3)


def import_deepspeed() -> Any:
    """`import deepspeed`, quietly: its import logs an accelerator warning to stdout, where our CLI writes."""
    try:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            import deepspeed
    except ImportError as exc:
        raise ImportError(f"engine \"deepspeed\" needs DeepSpeed, which is not installed: {INSTALL_HINT}") from exc
    from deepspeed.runtime import constants
    from deepspeed.utils import logger

    if not hasattr(constants, "MANAGED_GRADIENT_ACCUMULATION"):
        # Without unmanaged accumulation DeepSpeed would divide or reduce at the wrong step (see module docstring).
        raise ImportError(f"DeepSpeed {deepspeed.__version__} lacks unmanaged gradient accumulation, which flowrl "
                          f"needs: {INSTALL_HINT} (installs deepspeed>=0.19.8)")
    # DeepSpeed's log handler captured sys.stdout while it was redirected; send its later warnings to stderr.
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is buffer:
            handler.setStream(sys.stderr)
    return deepspeed


class DeepSpeedTrainEngine(AdamWEngine):
    """Owns the DeepSpeed engine (and optimizer) of one trainable module; same interface as TrainEngine."""

    def __init__(self, module: nn.Module, *, lr: float, zero_stage: int = 0, offload: bool = False,
                 **optimizer: Unpack[AdamWOptions]) -> None:
        if zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
        if offload and zero_stage == 0:
            raise ValueError("offload needs ZeRO stage 1, 2 or 3 (it moves the optimizer state ZeRO partitions)")
        deepspeed = import_deepspeed()
        # The client optimizer: its param_groups are the ones ZeRO steps, so lr lives there at every stage.
        super().__init__(module, lr=lr, **optimizer)
        self.zero_stage = zero_stage
        self._norm: float | None = None  # set by the stage-0 hook during engine.step()
        if zero_stage == 0:
            self.optimizer.register_step_pre_hook(self._clip_or_skip)
        world = _init_distributed(deepspeed)
        # flowrl's data-parallel contract (TrainEngine's): losses are scaled by the GLOBAL mini-batch's denominators
        # and gradients are SUMMED over ranks. DeepSpeed sums when asked, except at ZeRO-3, which only averages:
        # there the loss is multiplied by the world size so the average is the sum.
        self._loss_factor = float(world) if zero_stage == 3 else 1.0
        config = _config(zero_stage, offload, self.max_grad_norm, _dtype(module))
        self.forward_module, _, _, _ = deepspeed.initialize(model=module, optimizer=self.optimizer, config=config)

    def set_max_grad_norm(self, bound: float | None) -> None:
        """Clip the gradient norm to `bound` from the next step on (None or <= 0: measure it only). Stage 0 clips
        in its pre-step hook, which reads `max_grad_norm`; ZeRO 1-3 optimizers read their `clip_grad` at each
        step (DeepSpeed took the initial value from the config's `gradient_clipping`)."""
        super().set_max_grad_norm(bound)
        if self.zero_stage > 0:
            self.forward_module.optimizer.clip_grad = float(bound) if bound and bound > 0 else 0.0

    def step(self, micro_batches: Sequence[MB], loss_fn: LossFn[MB]) -> dict[str, float]:
        """Accumulate gradients over `micro_batches`, clip, update; returns `step_metrics`."""
        engine = self.forward_module

        def backward(loss: Tensor) -> None:
            # The caller already scaled the loss (micro losses sum to the mini-batch loss): no 1/gas here.
            engine.backward(loss * self._loss_factor if self._loss_factor != 1.0 else loss, scale_wrt_gas=False)

        total_loss, seen = self.accumulate_all(micro_batches, loss_fn, backward)
        skipped_before = int(engine.skipped_steps)
        self._norm = None
        engine.step()
        if self.zero_stage == 0:
            grad_norm = self._norm if self._norm is not None else math.nan
            skipped = not math.isfinite(grad_norm)
        else:
            norm = engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else math.nan
            skipped = int(engine.skipped_steps) > skipped_before
        if not skipped:
            self.steps += 1
        return self.step_metrics(seen, total_loss, grad_norm, skipped)

    def _clip_or_skip(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        """Stage 0: runs inside engine.step() after gradients are all-reduced, right before AdamW.step()."""
        # The optimizer's own params: the module's in fp32, DeepSpeed's fp32 master copies in bf16/fp16.
        params = [p for group in optimizer.param_groups for p in group["params"]]
        bound = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else math.inf
        self._norm = float(torch.nn.utils.clip_grad_norm_(params, bound))
        if not math.isfinite(self._norm):
            # AdamW skips parameters without a gradient: no moment update, no weight decay, no step count.
            for p in params:
                p.grad = None

    # ---- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Module weights (full tensors, also under ZeRO-3), optimizer state and the step count.

        With several data-parallel ranks every rank must call it: ZeRO-3 gathers the weights and ZeRO 1-3 gather
        every rank's optimizer partition onto rank 0 (collectives). At ZeRO 1-3 `optimizer` is the list of the
        ranks' partitions, by rank, on rank 0, and None on the other ranks: rank 0's state is the whole one.
        """
        # At ZeRO-0 in fp32 DeepSpeed steps our AdamW itself; otherwise its wrapper also holds fp32 master weights.
        # Copies, not views into live buffers: ZeRO's fp32 partitions are slices of flat groups it keeps updating.
        optimizer = _snapshot(self.forward_module.optimizer.state_dict())
        if self.zero_stage > 0:
            optimizer = _gather_to_rank0(optimizer)
        return {"module": self.module_state_dict(), "optimizer": optimizer, "steps": self.steps,
                "zero_stage": self.zero_stage}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` (rank 0's: the whole state). With several ranks every rank must call it, with
        the same state (ZeRO-3 scatters the weights); at ZeRO 1-3 each rank takes its own optimizer partition,
        so the checkpoint must come from as many ranks as this run has."""
        saved = int(state.get("zero_stage", 0))
        if saved != self.zero_stage:
            raise ValueError(f"checkpoint was written at ZeRO stage {saved}; this engine runs stage {self.zero_stage}"
                             " (the optimizer state layouts differ)")
        partitions: list[Any] = []
        if self.zero_stage > 0:
            saved_parts = state["optimizer"]
            # A one-rank checkpoint written before the partitions were stored as a list holds the partition itself.
            partitions = [saved_parts] if isinstance(saved_parts, Mapping) else list(saved_parts)
            world = data_parallel_world()
            if len(partitions) != world:
                ranks = f"{len(partitions)} data-parallel rank" + ("s" if len(partitions) > 1 else "")
                raise FlowError(Diagnostic(
                    f"the checkpoint holds the ZeRO-{self.zero_stage} optimizer state of {ranks}, this run has {world}",
                    hint="resume with the `replicas` it was written with: ZeRO partitions that state by rank"))
        self._load_module_state(state["module"])
        ds_optimizer = self.forward_module.optimizer
        if self.zero_stage == 0:
            # Our AdamW (fp32) or DeepSpeed's bf16/fp16 wrapper, which also copies its saved fp32 masters back.
            ds_optimizer.load_state_dict(state["optimizer"])
        else:
            # Indexed by data-parallel rank; DeepSpeed reads this rank's own entry. Masters come from the saved fp32
            # partitions, not from the (possibly bf16) module weights.
            ds_optimizer.load_state_dict(partitions, load_optimizer_states=True, load_from_fp32_weights=True)
        self.steps = int(state.get("steps", 0))

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """Full module weights (copies), also under ZeRO-3, where `module.state_dict()` holds empty placeholders.

        Under ZeRO-3 with several ranks this gathers (a collective): every rank must call it.
        """
        if self.zero_stage < 3:
            return _snapshot(self.module.state_dict())
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
            return _snapshot(self.module.state_dict())

    def _load_module_state(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.zero_stage < 3:
            self.module.load_state_dict(weights)
            return
        import deepspeed

        # modifier_rank=0: rank 0's loaded values are re-partitioned to every rank when the context exits.
        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            self.module.load_state_dict(weights)


def _snapshot(obj: Any) -> Any:
    """`obj` with every tensor replaced by a detached copy (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {key: _snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(value) for value in obj)
    return obj


def _gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, by rank, on rank 0 (None on the others); `[obj]` with one rank. A collective."""
    world = data_parallel_world()
    if world == 1:
        return [obj]
    rank = torch.distributed.get_rank()
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    torch.distributed.gather_object(obj, gathered, dst=0)
    return gathered


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _config(stage: int, offload: bool, max_grad_norm: float | None, dtype: torch.dtype) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    clip = float(max_grad_norm) if max_grad_norm and max_grad_norm > 0 else 0.0
    return {
        # Nominal sizes: DeepSpeed only counts samples with them; flowrl chooses micro-batches per step() call.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_allreduce_op": "mean" if stage == 3 else "sum",  # see _loss_factor
        # Stage 0 clips in our pre-step hook (DeepSpeed's stage-0 clip does not report the norm).
        "gradient_clipping": clip if stage > 0 else 0.0,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # keep the torch AdamW under offload: no CPUAdam build
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def _init_distributed(deepspeed: Any) -> int:
    """Join the process group (the ray backend's ranks create it) or create a one-process one; gloo on CPU.

    Returns the data-parallel world size.
    """
    if deepspeed.comm.is_initialized():
        return int(torch.distributed.get_world_size())
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    backend = "gloo" if on_cpu else accelerator.communication_backend_name()
    joined = torch.distributed.is_initialized()
    if joined:
        world = torch.distributed.get_world_size()
        backend = str(torch.distributed.get_backend())
        # DeepSpeed reads these even when joining; the group is the truth. LOCAL_RANK picks the CUDA device: a
        # Ray rank sees only its own GPU, so 0 unless a launcher said otherwise.
        os.environ.update(RANK=str(torch.distributed.get_rank()), WORLD_SIZE=str(world))
        os.environ.setdefault("LOCAL_RANK", "0")
    else:
        # Not launched by torchrun/deepspeed (which set these): a one-process group on this host.
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        world = int(os.environ["WORLD_SIZE"])
    if on_cpu:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (measured: 151 s on 2 cores, then
        # cached) when it creates its comm backend. flowrl's CPU runs are tests and laptops: gloo's all-reduce is
        # enough (one process has nothing to reduce at all), so the op is marked unavailable and never built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
    if not joined:  # the group is this process's own: torch's NCCL warns at exit about a group left up
        atexit.register(_destroy_group)
    return world


def _destroy_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
