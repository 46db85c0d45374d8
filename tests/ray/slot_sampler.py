"""A second driver on a Ray cluster that counts device slots in use from outside a run (tests/ray): it joins the
cluster at ADDRESS, samples `ray.available_resources()` every ~10 ms and integrates the busy `device_slot`s
(the cluster's total minus what is available) over time, until its standard input closes; then it writes
{"busy_slot_s", "uncertain_slot_s", "samples", "most_busy", "total"} to OUT as JSON. `uncertain_slot_s` bounds the
sampling's own error: a change of the busy count falls somewhere between two samples, so each interval over which
it changed may be off by the change times half the interval plus half a call's length. On a busy machine the
samples come further apart than 10 ms, and the bound grows with them.

    python tests/ray/slot_sampler.py ADDRESS OUT READY [RESOURCE]

READY is created after the first sample, so a test starts its run only once the sampler is counting. RESOURCE
(default `device_slot`) counts another resource instead: `CPU` for the Ray backend, whose placement groups' bundles
ask for one CPU a rank on a cluster without GPUs. cluster_head.sampled_run starts it around a run.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

import ray

SLOT = "device_slot"
PERIOD_S = 0.01


def main(address: str, out: Path, ready: Path, slot: str = SLOT) -> None:
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    total = float(ray.cluster_resources().get(slot, 0.0))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

    def sample() -> tuple[float, float, float]:
        """-> (busy slots, the time they were read at: the call's middle, half the call's length)."""
        before = time.monotonic()
        busy = total - float(ray.available_resources().get(slot, 0.0))
        after = time.monotonic()
        return busy, (before + after) / 2, (after - before) / 2

    integral, uncertain, samples, most = 0.0, 0.0, 0, 0.0
    last_busy, last_t, last_h = sample()
    ready.touch()
    while not stop.wait(PERIOD_S):
        busy, t, h = sample()
        integral += (t - last_t) * (last_busy + busy) / 2  # trapezoids between samples
        # a change between two samples happened within [last_t - last_h, t + h]; the trapezoid puts it at the
        # interval's middle: at most half the interval plus the wider half-call away
        uncertain += abs(busy - last_busy) * ((t - last_t) / 2 + max(h, last_h))
        last_busy, last_t, last_h = busy, t, h
        samples += 1
        most = max(most, busy)
    out.write_text(json.dumps({"busy_slot_s": integral, "uncertain_slot_s": uncertain, "samples": samples,
                               "most_busy": most, "total": total}))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])
