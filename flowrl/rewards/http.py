"""A reward served over HTTP (flowrl.rewards): what `reward NAME = http("URL") { ... }` calls.

Wire format (one POST per batch of `batch` samples, `Content-Type: application/json`):

    request   {"prompts": [str, ...], "responses": [str, ...], "rows": [{data row columns}, ...]}
    response  {"scores": [float, ...]}   or a bare list [float, ...], one score per sample, in order

Batches go out `concurrency` at a time. A refused connection, a timeout or a 5xx answer is tried again
`retries` times with exponential back-off (`backoff`, 2x, 4x, ... seconds); a 4xx answer, or an answer that is
not JSON, has the wrong number of scores or a score that is not a finite number, fails at once. Every failure
is a `RewardHttpError` naming the URL and what happened. Standard library only (urllib).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

BODY_SHOWN = 200  # bytes of an error answer quoted in the message


class RewardHttpError(RuntimeError):
    """A scoring service that could not be reached, failed, or answered something that is not scores."""


class _Retry(Exception):
    """A failure worth another try (refused, timed out, 5xx)."""


class HttpReward:
    """`__call__(prompts, responses, rows) -> scores`, batch by batch, over HTTP (see the module docstring)."""

    def __init__(self, url: str, *, batch: int = 32, timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                 concurrency: int = 4):
        if batch < 1 or concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("batch and concurrency must be >= 1, retries >= 0, timeout > 0")
        self.url, self.batch, self.timeout, self.retries, self.backoff = url, batch, timeout, retries, backoff
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="flowrl-http-reward")
        self.lock = threading.Lock()
        self.requests = 0  # POSTs sent, retries included

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 rows: Sequence[Mapping[str, Any]] | None = None) -> list[float]:
        rows = list(rows) if rows is not None else [{} for _ in prompts]
        if not (len(prompts) == len(responses) == len(rows)):
            raise ValueError("prompts, responses and rows must have one entry per sample")
        starts = range(0, len(prompts), self.batch)
        futures = [self.pool.submit(self._batch, list(prompts[s:s + self.batch]), list(responses[s:s + self.batch]),
                                    [dict(r) for r in rows[s:s + self.batch]]) for s in starts]
        return [score for f in futures for score in f.result()]

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- one batch ------------------------------------------------------------------------------------------
    def _batch(self, prompts: list[str], responses: list[str], rows: list[dict[str, Any]]) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses, "rows": rows}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))  # back-off before another try, not a test's wait
            try:
                return self._scores(self._post(body), len(prompts))
            except _Retry as e:
                problem = str(e)
        tries = self.retries + 1
        raise RewardHttpError(f"{self.url}: {problem} ({tries} {'try' if tries == 1 else 'tries'})")

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with self.lock:
            self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return bytes(answer.read())
        except urllib.error.HTTPError as e:
            text = e.read()[:BODY_SHOWN].decode(errors="replace")
            problem = f"HTTP {e.code} {e.reason}: {text!r}"
            if e.code >= 500:
                raise _Retry(problem) from None
            raise RewardHttpError(f"{self.url}: {problem}") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, ConnectionRefusedError):
                raise _Retry("connection refused") from None
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _Retry(f"timed out after {self.timeout:g} s") from None
            raise _Retry(f"cannot connect: {reason}") from None
        except TimeoutError:
            raise _Retry(f"timed out after {self.timeout:g} s") from None
        except (ConnectionError, OSError) as e:  # reset mid-answer, ...
            raise _Retry(f"connection failed: {e}") from None

    def _scores(self, raw: bytes, expected: int) -> list[float]:
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RewardHttpError(f"{self.url}: the answer is not JSON: {raw[:BODY_SHOWN]!r}") from None
        scores = answer.get("scores") if isinstance(answer, dict) else answer
        if not isinstance(scores, list):
            raise RewardHttpError(f"{self.url}: the answer has no list of scores (expected {{\"scores\": [...]}} "
                                  f"or a list): {raw[:BODY_SHOWN]!r}")
        if len(scores) != expected:
            raise RewardHttpError(f"{self.url}: {len(scores)} scores for {expected} samples")
        out = []
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(float(s)):
                raise RewardHttpError(f"{self.url}: score {i} is {s!r}, not a finite number")
            out.append(float(s))
        return out
