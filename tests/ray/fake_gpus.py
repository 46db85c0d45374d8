"""Run as a script (tests/ray/test_serverless_devices.py): a Ray instance of its own that declares GPUs this
machine does not have, the node seeing GPUs 5 and 7 (CUDA_VISIBLE_DEVICES); serverless instances started there
the way a pool starts them (devices_for the cluster's resources, then instance.prewarm) all alive at once, each
building its (no) models on the device it chose, then serving a call; first with a whole GPU each, then with
`gpu_fraction = 0.5` (two on each GPU); last, an instance of a pool that asks for a device slot (the node declares
two beside its GPUs), device "auto": it must refuse to run on the CPU beside GPUs it was not given. Prints one JSON
line: each phase's task options and instances' stats, and the slot instance's error."""

from __future__ import annotations

import json
import logging
import os

os.environ["CUDA_VISIBLE_DEVICES"] = "5,7"  # the node's GPUs, as Ray and the instances' processes see them
os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402

from flowrl.backends.serverless.devices import Devices, devices_for  # noqa: E402
from flowrl.backends.serverless.instance import Build, remote_mailbox, remote_prewarm, remote_serve  # noqa: E402


def start(fraction: float | None, instances: int) -> dict[str, object]:
    """`instances` pre-warmed instances of a pool asking for `fraction` of a GPU, all alive at once -> their
    task options and stats."""
    devices = devices_for(ray.cluster_resources(), fraction)
    mailbox = remote_mailbox.remote()
    build = Build((), (), 0, "auto")  # no models: the device is chosen and the worker built on it, no CUDA
    boxes = [f"run/pool/{fraction}/{i}" for i in range(instances)]
    refs = [remote_prewarm.options(**devices.options(), num_returns=4).remote(("run", "pool"), build, {}, mailbox,
                                                                               box) for box in boxes]
    for box in boxes:  # every instance holds its GPU (share) at once: Ray gave each its own
        ray.get(mailbox.ready.remote(box), timeout=300)
    for box in boxes:
        mailbox.put.remote(box, [ray.put(({}, "state_dict", (), {}, 0, None))])
    return {"options": devices.options(), "stats": ray.get([r[1] for r in refs], timeout=300)}


def on_a_slot() -> str:
    """A device-slot instance (device "auto") on this node with GPUs -> the error it ends with ("" if none)."""
    ref = remote_serve.options(**Devices(0.0).options(), num_returns=4).remote(
        ("run", "slot"), Build((), (), 0, "auto"), {}, "state_dict", (), {}, 0)
    try:
        ray.get(ref[1], timeout=300)
    except ray.exceptions.RayTaskError as e:
        return str(e.cause)
    return ""


def main() -> None:
    ray.init(num_cpus=4, num_gpus=2, resources={"device_slot": 2}, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    try:
        print(json.dumps({"whole": start(None, 2), "half": start(0.5, 4), "slot": on_a_slot()}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
