"""Reward scoring on the controller (flowrl.runtime): a reward declaration becomes a `Scorer` that scores rollouts.

- No block keys (the default): the reward function is called inline, sample by sample; for a fast pure
  function that is the cheapest (measured in bench/rewards.py).
- `workers = N`: N worker processes, started with the run and kept warm, score samples in parallel; each
  sample has a wall-clock limit (`timeout`; a `timeout` without `workers` means one worker: a call on the
  controller cannot be stopped). A sample that times out or kills its worker (a crash, a signal) fails the
  step with an error naming the reward, the sample, its prompt and what happened. A worker that was killed or
  died is replaced; the run goes on.
- `http("url")`: batches of samples are POSTed to a scoring service (`flowrl.rewards.http.HttpReward`).
- `on_error = "zero"` holds for each of them: a sample whose reward raised, returned a non-number, timed out or
  crashed scores 0 and is counted (`reward/NAME/errors`, `reward/NAME/timeouts`) instead of failing the step.
- A reward that says why (`flowrl.rewards.graded.Graded`: a float with `notes`) has its notes summed over the
  step's samples as `reward/NAME/KEY` (`code_tests`: `reward/NAME/failed/no_plain_form`, ...), inline or from
  workers alike.
- `sandbox = "strict"` (for `code_tests`): the run refuses to start where strict isolation is not available
  (`flowrl.rewards.sandbox`), with an error at the reward's line saying what is missing.

Before the first step every Python reward's signature is checked against `fn(prompt, response, **row) -> float`
(batched: `fn(prompts, responses, **columns) -> list[float]`); a mismatch is an error at the reward's line.

`submit(batch)` returns at once with a `Pending` whose `result()` waits: the fused generation stage submits
each chunk of finished samples as it arrives, so scoring runs beside the rest of generation.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.errors import Diagnostic, Loc, RewardError
from flowrl.ir.graph import RewardDecl
from flowrl.registry import RewardFn, extra_columns, resolve_reward
from flowrl.rewards.graded import notes_of
from flowrl.rewards.signature import expected_signature, signature_problem
from flowrl.rewards.worker import serve
from flowrl.runtime.batch import Batch
from flowrl.runtime.functions import score_rollout


@dataclass
class Counts:
    """Failures a scorer absorbed with `on_error = "zero"` (reported per step)."""

    errors: int = 0
    timeouts: int = 0
    notes: dict[str, int] = field(default_factory=dict)  # summed from the values' notes (Graded)


@dataclass
class Pending:
    """Scores on their way: one future per sample (or per batch), assembled by `result()`."""

    batch: Batch
    parts: list[Future[list[float]]] = field(default_factory=list)

    def result(self) -> Batch:
        values = [v for f in self.parts for v in f.result()]
        return self.batch.derive("scores", scores=torch.tensor(values, dtype=torch.float32))


class Scorer:
    """The base of every scorer: `submit` chunks, `take_counts` each step, `close` at the end of the run."""

    def __init__(self, name: str, on_error: str = "fail"):
        self.name, self.on_error = name, on_error
        self.counts = Counts()
        self.lock = threading.Lock()

    @property
    def overlaps(self) -> bool:
        """Whether scoring runs beside the caller (worth streaming chunks to)."""
        return False

    def submit(self, batch: Batch) -> Pending:
        raise NotImplementedError

    def score(self, batch: Batch) -> Batch:
        return self.submit(batch).result()

    def take_counts(self, notes_only: bool = False) -> dict[str, float]:
        with self.lock:
            counts, self.counts = self.counts, Counts()
        notes = {f"reward/{self.name}/{k}": float(v) for k, v in sorted(counts.notes.items())}
        if notes_only:
            return notes
        return {f"reward/{self.name}/errors": float(counts.errors),
                f"reward/{self.name}/timeouts": float(counts.timeouts), **notes}

    def note(self, value: Any) -> None:
        """Add the notes a value carries to this step's counts."""
        found = notes_of(value)
        if found:
            with self.lock:
                for k, v in found.items():
                    self.counts.notes[k] = self.counts.notes.get(k, 0) + v

    def close(self) -> None:
        pass


def _done(values: list[float]) -> Future[list[float]]:
    fut: Future[list[float]] = Future()
    fut.set_result(values)
    return fut


class InlineScorer(Scorer):
    """The reward function called on the controller, sample by sample, when the batch is submitted."""

    def __init__(self, name: str, fn: RewardFn, on_error: str = "fail"):
        super().__init__(name, on_error)
        self.fn = fn

    def submit(self, batch: Batch) -> Pending:
        if self.on_error != "zero":
            scores = score_rollout(self.name, self.fn, batch, seen=self.note)["scores"]
            return Pending(batch, [_done([float(v) for v in scores.tolist()])])
        prompts, responses = list(batch.meta["prompt"]), list(batch.meta["response"])
        rows = [dict(r) for r in batch.meta.get("row", [{}] * batch.size)]
        values = self._batched(prompts, responses, rows) if self.fn.batched else \
            [self._one(p, r, row) for p, r, row in zip(prompts, responses, rows, strict=True)]
        return Pending(batch, [_done(values)])

    def _one(self, prompt: str, response: str, row: dict[str, Any]) -> float:
        try:
            value = self.fn.fn(prompt, response, **extra_columns(self.fn.fn, row))
            self.note(value)
            return self._finite(value)
        except Exception:  # on_error = "zero": this sample scores 0, counted
            with self.lock:
                self.counts.errors += 1
            return 0.0

    def _batched(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> list[float]:
        columns = {k: [r.get(k) for r in rows] for k in sorted({k for r in rows for k in r if k != "prompt"})}
        try:
            values = list(self.fn.fn(prompts, responses, **columns))
            if len(values) != len(prompts):
                raise ValueError(f"{len(values)} values for {len(prompts)} samples")
        except Exception:
            with self.lock:
                self.counts.errors += len(prompts)
            return [0.0] * len(prompts)
        out = []
        for v in values:
            self.note(v)
            try:
                out.append(self._finite(v))
            except (TypeError, ValueError):
                with self.lock:
                    self.counts.errors += 1
                out.append(0.0)
        return out

    @staticmethod
    def _finite(value: Any) -> float:
        out = float(value)
        if not math.isfinite(out):
            raise ValueError(f"returned {out}")
        return out


# ---- worker processes ------------------------------------------------------------------------------------


class _Worker:
    """One reward process. `ready()` waits (once) until it has loaded the reward: a sample's time limit starts
    when the sample is sent to a ready worker, so start-up never counts as a timeout."""

    def __init__(self, ctx: Any, name: str, target: str, imports: Sequence[str], folder: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, target, list(imports), folder), daemon=True)
        self.proc.start()
        child.close()
        self.loaded = False

    def ready(self) -> None:
        if self.loaded:
            return
        try:
            kind, what = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            kind, what = "error", _death(self.proc.exitcode)
        if kind != "ready":
            raise RewardError(Diagnostic(f"reward '{self.name}': a worker {what}"))
        self.loaded = True

    def stop(self, kill: bool = False) -> None:
        if kill and self.proc.is_alive():
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"worker died: signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"worker died: signal {-code}"
    return f"worker died: exit code {code}"


class PoolScorer(Scorer):
    """`workers` processes scoring one sample at a time each, with a per-sample wall-clock limit."""

    def __init__(self, name: str, target: str, *, workers: int, timeout: float = 0.0, on_error: str = "fail",
                 imports: Sequence[str] = (), folder: str = "."):
        super().__init__(name, on_error)
        self.target, self.timeout = target, timeout
        self.spawn: Callable[[], _Worker] = lambda: _Worker(mp.get_context("spawn"), name, target, imports, folder)
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.all: list[_Worker] = []
        for _ in range(workers):  # started now, warm by the first step
            w = self.spawn()
            self.all.append(w)
            self.idle.put(w)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"flowrl-reward-{name}")

    @property
    def overlaps(self) -> bool:
        return True

    def submit(self, batch: Batch) -> Pending:
        prompts, responses = batch.meta["prompt"], batch.meta["response"]
        rows = batch.meta.get("row", [{}] * batch.size)
        sample = batch["sample"].tolist() if "sample" in batch.tensors else list(range(batch.size))
        parts = [self.pool.submit(self._one, int(i), p, r, dict(row))
                 for i, p, r, row in zip(sample, prompts, responses, rows, strict=True)]
        return Pending(batch, parts)

    def _one(self, index: int, prompt: str, response: str, row: Mapping[str, Any]) -> list[float]:
        worker = self.idle.get()
        problem, timed_out, value = None, False, None
        try:
            worker.ready()
        except RewardError:
            self.idle.put(self._replace(worker))  # the next sample tries a fresh one; this step fails
            raise
        try:
            worker.conn.send((prompt, response, row))
            if worker.conn.poll(self.timeout if self.timeout > 0 else None):
                kind, value = worker.conn.recv()
                if kind == "error":
                    problem = str(value)
            else:
                problem, timed_out = f"timed out after {self.timeout:g} s", True
        except (EOFError, OSError):  # the process died under the sample
            worker.proc.join(timeout=5)
            problem = _death(worker.proc.exitcode)
        if problem is not None and (timed_out or not worker.proc.is_alive() or "worker died" in problem):
            worker = self._replace(worker)
        self.idle.put(worker)
        if problem is None:
            return [self._check(index, prompt, response, value)]
        return [self._failed(index, prompt, response, problem, timed_out)]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop(kill=True)
        fresh = self.spawn()
        with self.lock:
            self.all = [fresh if w is worker else w for w in self.all]
        return fresh

    def _check(self, index: int, prompt: str, response: str, value: Any) -> float:
        self.note(value)
        try:
            out = float(value)
        except (TypeError, ValueError):
            return self._failed(index, prompt, response, f"returned {value!r}, not a number", False)
        if not math.isfinite(out):
            return self._failed(index, prompt, response, f"returned {out}", False)
        return out

    def _failed(self, index: int, prompt: str, response: str, problem: str, timed_out: bool) -> float:
        if self.on_error != "zero":
            raise sample_error(self.name, index, prompt, response, problem)
        with self.lock:
            if timed_out:
                self.counts.timeouts += 1
            else:
                self.counts.errors += 1
        return 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for w in self.all:
            w.stop()
        self.all = []


def sample_error(name: str, index: int, prompt: str, response: str, problem: str) -> RewardError:
    return RewardError(Diagnostic(f"reward '{name}' {problem} on sample {index}",
                                  hint=f"prompt={prompt!r} response={response!r}"))


# ---- a scoring service over HTTP ---------------------------------------------------------------------------


class HttpScorer(Scorer):
    """Batches POSTed to `url` from a thread, so a chunk's request runs beside generation."""

    def __init__(self, name: str, url: str, options: Mapping[str, Any]):
        from flowrl.rewards.http import HttpReward

        super().__init__(name, str(options.get("on_error", "fail")))
        self.client = HttpReward(url, batch=int(options.get("batch", 32)), timeout=float(options.get("timeout", 10.0)),
                                 retries=int(options.get("retries", 2)),
                                 concurrency=int(options.get("concurrency", 4)))
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(options.get("concurrency", 4))),
                                       thread_name_prefix=f"flowrl-reward-{name}")

    @property
    def overlaps(self) -> bool:
        return True

    def submit(self, batch: Batch) -> Pending:
        return Pending(batch, [self.pool.submit(self._call, batch)])

    def _call(self, batch: Batch) -> list[float]:
        prompts, responses = list(batch.meta["prompt"]), list(batch.meta["response"])
        rows = [dict(r) for r in batch.meta.get("row", [{}] * batch.size)]
        try:
            return [float(v) for v in self.client(prompts, responses, rows)]
        except Exception as e:
            if self.on_error != "zero":
                raise RewardError(Diagnostic(f"reward '{self.name}' failed: {e}",
                                             hint=f"first sample: prompt={prompts[0]!r} response={responses[0]!r}")
                                  ) from None
            with self.lock:
                self.counts.errors += batch.size
            return [0.0] * batch.size

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


def make_scorer(decl: RewardDecl, *, imports: Sequence[str] = (), folder: str | None = None) -> Scorer:
    """The scorer a reward declaration asks for (see the module docstring)."""
    options: dict[str, Any] = dict(decl.options)
    if decl.kind == "http":
        return HttpScorer(decl.name, decl.target, options)
    fn = resolve_reward(decl.target)
    problem = signature_problem(fn)
    if problem is not None:
        raise RewardError(_at(decl, f"reward '{decl.name}': {problem}", hint=expected_signature(fn.batched)))
    from flowrl.rewards import code_tests, sandbox

    if options.get("sandbox") == "strict" or fn.fn is code_tests:  # said now, before the first step
        found = sandbox.isolation()
        if not found.strict and options.get("sandbox") == "strict":
            raise RewardError(_at(decl, f"reward '{decl.name}' asks for `sandbox = \"strict\"`, which this machine "
                                        "cannot give", hint=found.describe()))
        sandbox.warn_once()
    timeout = float(options.get("timeout", 0.0) or 0.0)
    workers = int(options.get("workers", 0) or 0) or (1 if timeout > 0 else 0)
    on_error = str(options.get("on_error", "fail"))
    if workers <= 0:
        return InlineScorer(decl.name, fn, on_error)
    return PoolScorer(decl.name, decl.target, workers=workers, timeout=timeout, on_error=on_error, imports=imports,
                      folder=folder or os.path.dirname(os.path.abspath(decl.loc.path)))


def _at(decl: RewardDecl, message: str, hint: str) -> Diagnostic:
    """A diagnostic at the reward's line, with the line itself when the file is readable."""
    line = None
    try:
        with open(decl.loc.path, encoding="utf-8") as f:
            line = f.read().splitlines()[decl.loc.line - 1]
    except (OSError, IndexError, ValueError):
        pass
    loc = Loc(decl.loc.path, decl.loc.line, decl.loc.col, decl.loc.end_col)
    return Diagnostic(message, loc, hint=hint, source_line=line)
