"""The Ray instance and the resources of each worker group (ray backend).

`Session` starts a local Ray instance (token auth off, no dashboard, logs under the run directory) or joins a
cluster (`--address`), and reuses one that this process already started (tests run one for the whole session).
`group_specs` sizes each worker group from the graph: `replicas` ranks, each one placement-group bundle of
`gpus` GPUs; where there are no GPUs (or `device = "cpu"`), each GPU becomes a CPU, scaled down to fractions
when the flow asks for more than the cluster has, so every flow runs on a laptop.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from flowrl.backends.ray.group import GroupSpec
from flowrl.errors import Diagnostic, FlowError
from flowrl.ir.graph import Graph

log = logging.getLogger("flowrl.ray")
# How often this driver reports its tasks' state changes to the GCS (Ray's default: every second): the serverless
# cost report reads each step's instance tasks from them (backends/serverless/held.py) as the step ends.
TASK_EVENTS_INTERVAL_MS = "20"
# How long `ray.init` waits for a new local instance's GCS to say its port (Ray's default: 30 s). On a busy machine
# the GCS has taken longer, and the run then failed before it began; read by ray.init, a user's setting wins.
GCS_START_WAIT_S = "120"


class Session:
    """This process's connection to Ray; `close` undoes only what `open` did."""

    def __init__(self, address: str | None = None, log_dir: str | Path | None = None, num_cpus: int | None = None,
                 resources: dict[str, float] | None = None):
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.log_dir = Path(log_dir) if log_dir else None
        self.num_cpus = num_cpus
        self.resources = resources  # custom resources of a local instance started here (the serverless slots)
        self.owned = False  # did we start (or connect) Ray, so that we shut it down?
        self._temp: Path | None = None
        self._handler: logging.Handler | None = None

    def open(self) -> None:
        if ray.is_initialized():
            return
        options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING, "namespace": "flowrl"}
        if self.log_dir is not None:
            # The driver's own Ray messages go to a file; worker output stays in Ray's log files (log_to_driver off).
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._handler = logging.FileHandler(self.log_dir / "driver.log")
            ray_logger = logging.getLogger("ray")
            ray_logger.addHandler(self._handler)
            ray_logger.propagate = False
            options["configure_logging"] = False
        self.owned = True
        os.environ.setdefault("RAY_task_events_report_interval_ms", TASK_EVENTS_INTERVAL_MS)  # read by ray.init
        try:
            if self.address:
                self._join(options)
            else:
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local instance needs no token
                os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_START_WAIT_S)
                # Ray's unix sockets live under its temp dir, whose path must stay short, so the session's logs
                # are linked into the run directory while Ray runs and copied there when it stops.
                self._temp = Path(tempfile.mkdtemp(prefix="flowrl-ray-"))
                ray.init(num_cpus=self.num_cpus, resources=self.resources, include_dashboard=False,
                         _temp_dir=str(self._temp), **options)
                if self.log_dir is not None:
                    _replace(*_session_logs(self.log_dir, self._temp), link=True)
        except BaseException:
            self.close()
            raise

    def _join(self, options: dict[str, Any]) -> None:
        address = str(self.address)
        problem = _unreachable(address)  # Ray itself retries a wrong address for minutes
        if problem is None:
            try:
                ray.init(address=address, **options)
            except (ConnectionError, TimeoutError, ValueError) as e:
                problem = str(e)
        if problem is not None:
            raise FlowError(Diagnostic(f"cannot join the Ray cluster at {address}: {problem}",
                                       hint="pass the address `ray start --head` printed (host:port), or leave "
                                            "out --address to start a local Ray instance"))
        if self.log_dir is not None:  # a cluster keeps its logs on its nodes: say where
            (self.log_dir / "cluster.txt").write_text(
                f"address: {self.address}\nlogs: {_cluster_logs()} (on the head node)\n", encoding="utf-8")

    def close(self) -> None:
        if not self.owned:
            return
        self.owned = False
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if self._temp is not None:
                if self.log_dir is not None:
                    _replace(*_session_logs(self.log_dir, self._temp), link=False)
                shutil.rmtree(self._temp, ignore_errors=True)
                self._temp = None
            if self._handler is not None:
                ray_logger = logging.getLogger("ray")
                ray_logger.removeHandler(self._handler)
                ray_logger.propagate = True
                self._handler.close()
                self._handler = None


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why a `host:port` address cannot be reached, or None (other forms, such as `auto`, are left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return f"nothing answers there ({e.strerror or e})"


def _cluster_logs() -> str:
    try:  # not a public API: a best effort for the note in the run directory
        node: Any = ray._private.worker.global_worker.node
        return str(node.get_logs_dir_path())
    except Exception:
        return "the Ray session's logs folder"


def _session_logs(log_dir: Path, temp: Path) -> tuple[Path, Path]:
    """(`<log_dir>/<Ray session name>`, Ray's logs folder): one folder per Ray session, so that a resumed run
    keeps the logs of the earlier ones."""
    session = (temp / "session_latest").resolve()
    return log_dir / session.name, session / "logs"


def _replace(dest: Path, source: Path, *, link: bool) -> None:
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.is_dir():
        shutil.rmtree(dest, ignore_errors=True)
    try:
        if link:
            dest.symlink_to(source.resolve(), target_is_directory=True)
        elif source.exists():
            shutil.copytree(source, dest, symlinks=True, ignore_dangling_symlinks=True)
    except OSError as e:  # logs are a convenience: never fail a run over them
        log.warning("could not %s Ray logs to %s: %s", "link" if link else "copy", dest, e)


def group_specs(graph: Graph, *, seed: int, device: str, resources: Mapping[str, float],
                crash_on_call: Mapping[str, Mapping[int, int | tuple[str, int]]] | None = None,
                snapshot_every: int = 10) -> list[GroupSpec]:
    """One spec per worker group; `resources` is what the cluster has free (`ray.available_resources()`)."""
    gpus_free = float(resources.get("GPU", 0.0))
    cpus_free = float(resources.get("CPU", 0.0))
    use_gpu = device != "cpu" and gpus_free > 0
    if device.startswith("cuda") and not use_gpu:
        raise FlowError(Diagnostic("device is cuda but the Ray cluster has no free GPU",
                                   hint='set `run { device = "cpu" }` or join a cluster with GPUs (--address)'))
    rank_device = device if use_gpu and device != "auto" else ("cuda" if use_gpu else "cpu")
    sized = []
    for wg in graph.worker_groups:
        decls = tuple(graph.model(m) for m in wg.models)
        units = max([float(d.gpus) for d in decls] + [0.0]) or 1.0  # GPUs (or CPUs standing in for them) per rank
        sized.append((wg.name, decls, wg.ranks, units))
    demand = sum(world * units for _, _, world, units in sized)
    specs = []
    for name, decls, world, units in sized:
        if use_gpu:
            bundle = {"GPU": units, "CPU": _floor(min(1.0, cpus_free / max(1, sum(w for _, _, w, _ in sized))))}
        else:
            scale = min(1.0, cpus_free / demand) if demand else 1.0
            bundle = {"CPU": _floor(units * scale)}
        if not any(bundle.values()):
            raise FlowError(Diagnostic(f"worker group `{name}`: the Ray cluster has no free CPU for its ranks",
                                       hint="free some resources or join a bigger cluster (--address)"))
        specs.append(GroupSpec(name, decls, graph.models, world, {k: v for k, v in bundle.items() if v > 0},
                               seed, rank_device, dict((crash_on_call or {}).get(name, {})), max(1, snapshot_every)))
    return specs


def _floor(x: float) -> float:
    """Ray accounts resources in units of 1e-4; rounding down keeps the bundles within what is free."""
    return int(x * 10_000) / 10_000
