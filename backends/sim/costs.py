"""The simulator's cost model (flowrl.backends.sim): seconds per operation from shapes, a cluster and factors.

- prefill: compute-bound, 2·params FLOPs a token (plus attention over the context) at `prefill_mfu` of peak;
- a decode iteration: the larger of reading the weights and the batch's KV cache (memory-bound, at `decode_mbu` of
  the bandwidth) and the batch's FLOPs (at `decode_mfu`), plus a fixed `decode_iter_s` (scheduling, sampling,
  launches) and a tensor-parallel all-reduce latency per layer;
- a forward over tokens: FLOPs at `forward_mfu` over the devices; training: 3× the forward's FLOPs at `train_mfu`,
  the pipeline bubble (pp − 1)/micro-batches, and per optimizer step the gradient all-reduce over the link;
- weight sync and KV migration: bytes over the link between the pools;
- each call a fixed cost (`*_call_s`), each optimizer step `optim_step_s`; an instance's cold start `cold_start_s` plus its weights over `host_bw`.

Every factor has a default fit for large-GPU work (vLLM, FSDP/Megatron-class kernels); `flowrl calibrate` fits
them on flowrl's own measured runs and stores them with their error (see `calibrate.py`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from flowrl.backends.sim.hardware import Cluster
from flowrl.backends.sim.shapes import BYTES, ModelShape
from flowrl.errors import Diagnostic, FlowError

Row = tuple[int, int, int]  # (prompt id, prompt length, response length) of one sample


@dataclass(frozen=True)
class Factors:
    prefill_mfu: float = 0.5
    decode_mfu: float = 0.5
    decode_mbu: float = 0.7
    decode_iter_s: float = 0.003
    forward_mfu: float = 0.45
    train_mfu: float = 0.35
    gen_call_s: float = 0.05
    fwd_call_s: float = 0.02
    train_call_s: float = 0.05  # per model an update call trains
    optim_step_s: float = 0.0  # per optimizer step (epochs x mini-batches): clipping, Adam, zeroing
    row_s: float = 0.0  # per sample a call handles (bookkeeping that neither FLOPs nor bytes count)
    act_bytes: float = 40.0  # bytes of elementwise traffic (norms, activations, residuals) per hidden unit, layer, token
    tp_latency_s: float = 1e-5  # one all-reduce's latency
    cold_start_s: float = 20.0  # an instance process and engine starting, before its weights arrive
    host_bw: float = 25e9  # bytes/s from host memory or local disk into a device
    pad_to_longest: bool = False  # forwards and training compute padded rows (flowrl's torch engine) or not

    @classmethod
    def load(cls, path: str | Path) -> Factors:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            known = {f.name for f in fields(cls)}
            return replace(cls(), **{k: v for k, v in data["factors"].items() if k in known})
        except OSError as e:
            raise FlowError(Diagnostic(f"--calibration {path}: cannot read it ({e.strerror})",
                                       hint="write one with `flowrl calibrate RUN_DIR -o FILE`")) from None
        except (ValueError, KeyError, TypeError) as e:
            raise FlowError(f"{path}: not a calibration file ({type(e).__name__}: {e})") from None

    def to_json(self) -> dict[str, float | bool]:
        return asdict(self)


class CostModel:
    def __init__(self, cluster: Cluster, factors: Factors | None = None):
        self.cluster, self.f = cluster, factors or Factors()
        self.dev = cluster.device

    def _tp_comm(self, shape: ModelShape, tp: int) -> float:
        return 0.0 if tp <= 1 else 2 * shape.layers * self.f.tp_latency_s

    def prefill_s(self, shape: ModelShape, tokens: float, tp: int = 1, context: float = 0.0) -> float:
        if tokens <= 0:
            return 0.0
        return tokens * shape.flops_per_token(context) / (tp * self.dev.flops * self.f.prefill_mfu) \
            + self._tp_comm(shape, tp)

    def decode_iter(self, shape: ModelShape, batch: int, context: float, tp: int = 1) -> float:
        """One decode iteration of `batch` sequences holding `context` tokens of KV cache in all."""
        if batch <= 0:
            return 0.0
        memory = (shape.weight_bytes + context * shape.kv_bytes_per_token) / (tp * self.dev.mem_bw * self.f.decode_mbu)
        compute = batch * shape.flops_per_token(context / batch) / (tp * self.dev.flops * self.f.decode_mfu) \
            + self.act_s(shape, batch) / tp
        return self.f.decode_iter_s + max(memory, compute) + self._tp_comm(shape, tp)

    def tokens(self, rows: Sequence[Row], share_prefix: bool = False, hidden: int = 0) -> float:
        """Tokens a forward or training pass computes over rows of (prompt id, prompt length, response length).

        Unpadded (`pad_to_longest` off, as verl's remove-padding kernels): every token once, each prompt once
        when `share_prefix`. Padded (flowrl's torch engine): rows padded to the longest; with `share_prefix`
        each prompt runs once (padded to the longest prompt) and its samples either run packed into one row per
        prompt (padded to the longest such row) or each on a copy of the prompt's cache (padded to the longest
        response, the copy costing 1/16 of a token a prompt token), whichever the engine's rule
        (flowrl.engines.packing_cost.packing_pays) finds cheaper for a model of width `hidden`."""
        if not rows:
            return 0.0
        if not share_prefix:
            lens = [p + r for _, p, r in rows]
            return float(len(lens) * max(lens)) if self.f.pad_to_longest else float(sum(lens))
        prompts = {pid: p for pid, p, _ in rows}
        if not self.f.pad_to_longest:
            return float(sum(prompts.values()) + sum(r for _, _, r in rows))
        width_p, width_r = max(prompts.values()), max(r for _, _, r in rows)
        per: dict[int, int] = {}
        for pid, _, r in rows:
            per[pid] = per.get(pid, 0) + max(0, r - 1)
        q = max(per.values())
        per_place = 1.0 / (6 * max(1, hidden or 768))
        packed = len(per) * q * (1 + (width_p + q) * per_place)
        copies = len(rows) * (width_r - 1) * (1 + (width_p + width_r - 1) * per_place) + len(rows) * width_p / 16
        body = len(per) * q if packed <= copies else len(rows) * (width_r - 1) + len(rows) * width_p / 16
        return float(len(prompts) * width_p + body)

    def flops(self, shape: ModelShape, rows: Sequence[Row], share_prefix: bool, parts: int = 1) -> float:
        """FLOPs of one pass over `rows`, in `parts` mini-batches (see `mini_batches`)."""
        tok = self.batch_tokens(rows, share_prefix, shape.hidden, parts)
        mean_ctx = sum(p + r for _, p, r in rows) / max(1, len(rows)) / 2
        return tok * shape.flops_per_token(mean_ctx)

    def batch_tokens(self, rows: Sequence[Row], share_prefix: bool, hidden: int, parts: int = 1) -> float:
        """`tokens` summed over the `parts` mini-batches an update splits the rows into: the rows shuffled (a
        fixed permutation stands in for the update's seeded one) and cut into near-equal parts, each laid out
        on its own. A prompt's samples then land in several mini-batches, so shared prefixes and packed rows
        save less than over the whole batch."""
        if parts <= 1:
            return self.tokens(rows, share_prefix, hidden)
        order = list(rows)
        random.Random(0).shuffle(order)
        size = -(-len(order) // parts)
        return sum(self.tokens(order[i:i + size], share_prefix, hidden) for i in range(0, len(order), size))

    def act_s(self, shape: ModelShape, tokens: float) -> float:
        """Elementwise, memory-bound work over `tokens` tokens on one device (what FLOPs do not count; it
        dominates small hidden sizes)."""
        return tokens * shape.layers * shape.hidden * self.f.act_bytes / self.dev.mem_bw

    def forward_s(self, shape: ModelShape, rows: Sequence[Row], devices: int, pp: int = 1, micro: int = 1,
                  share_prefix: bool = False) -> float:
        bubble = (pp - 1) / max(1, micro)
        work = self.flops(shape, rows, share_prefix) / (self.dev.flops * self.f.forward_mfu) + \
            self.act_s(shape, self.tokens(rows, share_prefix, shape.hidden))
        return self.f.fwd_call_s + (work + self.f.row_s * len(rows)) / devices * (1 + bubble)

    def train_s(self, shape: ModelShape, rows: Sequence[Row], devices: int, epochs: int = 1, mini_batches: int = 1,
                tp: int = 1, pp: int = 1, micro: int = 1, share_prefix: bool = False) -> float:
        parts = mini_batches if mini_batches > 1 or epochs > 1 else 1  # the update shuffles only then
        tok = self.batch_tokens(rows, share_prefix, shape.hidden, parts)
        flops = 3 * self.flops(shape, rows, share_prefix, parts) * epochs
        bubble = (pp - 1) / max(1, micro)
        compute = (flops / (self.dev.flops * self.f.train_mfu) + 3 * epochs * self.act_s(shape, tok)) / devices \
            * (1 + bubble)
        dp = max(1, devices // (tp * pp))
        # tensor parallel: 4 all-reduces of the activations per layer (2 forward, 2 backward) on each device
        tp_comm = 0.0 if tp == 1 else 4 * epochs * (shape.layers / pp) * (tok / dp) * shape.hidden * BYTES * 2 \
            * (tp - 1) / tp / self.cluster.intra_bw
        compute += tp_comm + self.f.row_s * len(rows) * epochs / devices
        grad_bytes = shape.weight_bytes / (tp * pp)
        sync = 0.0 if dp == 1 else 2 * grad_bytes * (dp - 1) / dp / self.cluster.link_bw(devices)
        return self.f.train_call_s + compute + epochs * mini_batches * (sync + self.f.optim_step_s)

    def transfer_s(self, nbytes: float, devices: int, across_nodes: bool = True) -> float:
        """`nbytes` spread over `devices` senders over the inter-node (or intra-node) link."""
        bw = self.cluster.inter_bw if across_nodes else self.cluster.intra_bw
        return nbytes / (max(1, devices) * bw)

    def weight_sync_s(self, shape: ModelShape, devices: int, colocated: bool) -> float:
        """New weights from the training devices to generation instances (resharding when colocated)."""
        return self.transfer_s(shape.weight_bytes, devices, across_nodes=not colocated and
                               self.cluster.nodes > 1)

    def kv_bytes(self, shape: ModelShape, tokens: float) -> float:
        return tokens * shape.kv_bytes_per_token

    def start_s(self, shape: ModelShape, tp: int = 1) -> float:
        return self.f.cold_start_s + shape.weight_bytes / tp / self.f.host_bw

    def slots(self, shape: ModelShape, tp: int, context: int, share: float = 0.9) -> int:
        """Sequences of `context` tokens an instance of `tp` devices holds at once: KV cache in what the weights
        leave of the `share` of memory the engine may take (vLLM's gpu_memory_utilization); 0 when the weights
        alone do not fit."""
        free = share * tp * self.dev.memory - shape.weight_bytes
        per_seq = max(1.0, context * shape.kv_bytes_per_token)
        return max(0, int(free // per_seq))

    def train_memory(self, shape: ModelShape, devices: int, tp: int = 0, pp: int = 1,
                     micro_tokens: float = 0.0) -> float:
        """Bytes per device to train. With `tp` = 0 (FSDP/ZeRO-3): bf16 weights and grads and fp32 Adam and
        master copy all sharded over `devices`. Otherwise Megatron-style: weights and grads split over tp x pp,
        the optimizer states also over data parallel (ZeRO-1), plus a micro-batch's activations (selective
        recomputation, ~16 bytes a hidden unit a layer a token)."""
        if tp == 0:
            return shape.params * (2 * BYTES + 12) / max(1, devices)
        dp = max(1, devices // (tp * pp))
        acts = 16 * shape.hidden * (shape.layers / pp) * micro_tokens / tp
        return shape.params * (2 * BYTES / (tp * pp) + 12 / (tp * pp * dp)) + acts
