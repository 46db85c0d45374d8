"""flowrl.envs.pool: environments in warm worker processes (and in threads, `workers = 0`), with real children:
sticky instances, answers out of order, async environments, timeouts, crashes, hostile return values, close."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest

from flowrl.envs import EnvError, EnvLoadError, EnvPool, EnvSpec, Outcome
from flowrl.envs.host import OBSERVATION_CHARS, Answer, read_answer

HERE = str(Path(__file__).resolve().parent)
SLOW = 30.0  # a timeout no well-behaved call here comes near, however loaded the machine


def spec(target: str, name: str = "e", timeout: float = SLOW, **keys: Any) -> EnvSpec:
    return EnvSpec(name, f"sample_envs.{target}", timeout=timeout, folder=HERE, **keys)


def until(condition: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait for an event the pool makes happen (a worker replaced), never for a fixed time."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def result(future: Future[Outcome]) -> Outcome:
    return future.result(timeout=60)


@pytest.fixture(scope="module")
def hostile() -> Iterator[EnvPool]:
    pool = EnvPool(spec("Hostile", workers=1))
    pool.start()
    yield pool
    pool.close()


def test_instances_are_sticky_and_keep_their_state() -> None:
    pool = EnvPool(spec("Counter", workers=2, options={"limit": 3}))
    try:
        first = result(pool.reset("a", {"name": "x"}))
        assert (first.observation, first.reward, first.done, first.error) == ("start x", 0.0, False, None)
        for key in "bcd":
            assert result(pool.reset(key, {})).error is None
        seen: dict[str, set[str]] = {}
        for turn in (1, 2, 3):
            for key in "abcd":
                out = result(pool.step(key, "go"))
                n, pid = out.observation.split()
                assert (n, out.reward, out.done) == (f"n={turn}", float(turn), turn == 3)
                seen.setdefault(key, set()).add(pid)
        assert all(len(pids) == 1 for pids in seen.values())  # each instance stayed in one worker
        assert len({p for pids in seen.values() for p in pids}) == 2  # least loaded: two trajectories each
        assert sorted(f"pid={p}" for p in pool.pids()) == sorted({p for pids in seen.values() for p in pids})
        for key in "abcd":  # the next training step: new trajectories, the same warm workers
            pool.release(key)
            result(pool.reset(key, {}))
        assert {result(pool.step(key, "go")).observation.split()[1] for key in "abcd"} == \
            {f"pid={p}" for p in pool.pids()} == {p for pids in seen.values() for p in pids}
    finally:
        pool.close()


def test_answers_come_back_out_of_order(tmp_path: Path) -> None:
    """A call that cannot finish yet does not hold the others of its worker; each future gets its own answer."""
    pool = EnvPool(spec("Gate", workers=1))
    try:
        for key in ("slow", "fast"):
            result(pool.reset(key, {"gate": str(tmp_path / "open")}))
        slow = pool.step("slow", "wait")
        assert result(pool.step("fast", "go")).observation == "quick"
        assert not slow.done()
        (tmp_path / "open").touch()
        assert result(slow).observation == "opened"
    finally:
        pool.close()


def test_calls_on_one_instance_run_in_turn(tmp_path: Path) -> None:
    """A step sent while the instance's earlier step still runs (as after a timeout) waits for it."""
    pool = EnvPool(spec("Gate", workers=1))
    try:
        for key in ("k", "other"):
            result(pool.reset(key, {"gate": str(tmp_path / "open")}))
        first = pool.step("k", "wait")
        second = pool.step("k", "go")
        assert result(pool.step("other", "go")).observation == "quick"  # sent after both, answered first
        assert not first.done() and not second.done()
        (tmp_path / "open").touch()
        assert (result(first).observation, result(second).observation) == ("opened", "quick")
    finally:
        pool.close()


def test_random_latencies_each_answer_its_own_call() -> None:
    pool = EnvPool(spec("Sleepy", workers=2))
    rng = random.Random(0)
    try:
        for key in range(12):
            result(pool.reset(key, {}))
        actions = {key: f"{rng.lognormvariate(-4, 1):.4f}" for key in range(12)}
        futures = {key: pool.step(key, a) for key, a in actions.items()}
        wait(list(futures.values()), timeout=60)
        assert {k: f.result().observation for k, f in futures.items()} == actions
        assert all(f.result().seconds >= float(actions[k]) for k, f in futures.items())  # measured in the child
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [1, 0])
def test_async_environments_share_their_loop(tmp_path: Path, workers: int) -> None:
    pool = EnvPool(spec("AsyncGate", workers=workers))
    try:
        for key in ("slow", "fast"):
            assert result(pool.reset(key, {"gate": str(tmp_path / "open")})).error is None
        slow = pool.step("slow", "wait")
        assert result(pool.step("fast", "go")).observation == "quick"
        assert not slow.done()
        (tmp_path / "open").touch()
        assert result(slow).observation == "opened"
        out = result(pool.reset("x", {"gate": ""}))
        assert (out.observation, out.error) == ("", None)
    finally:
        pool.close()


def test_a_hanging_call_times_out_then_its_worker_is_replaced() -> None:
    pool = EnvPool(spec("Hostile", workers=1, timeout=2.0))  # far above a quick call's time on a loaded machine
    try:
        for key in ("hangs", "neighbour"):
            result(pool.reset(key, {}))
        (old,) = pool.pids()
        out = result(pool.step("hangs", "hang"))
        assert out == Outcome("timeout after 2 s", 0.0, False, "timeout after 2 s", True, 2.0)  # on_error observe
        until(lambda: pool.replaced == 1, "the stuck worker to be replaced")
        until(lambda: gone(old), "the stuck worker to be reaped")
        lost = result(pool.step("neighbour", "x"))
        assert lost.done and lost.error is not None
        assert lost.error.startswith("the environment worker had a call running past 2 × timeout (4 s) and was killed")
        result(pool.reset("fresh", {}))
        assert result(pool.step("fresh", "x")).observation == f"pid={pool.pids()[0]}"
        assert pool.failed is None
    finally:
        pool.close()


def test_a_crash_ends_the_trajectories_of_its_worker_and_the_others_go_on() -> None:
    pool = EnvPool(spec("Hostile", workers=2))
    try:
        for key in "abcd":  # a and c in one worker, b and d in the other
            result(pool.reset(key, {}))
        pids = {key: result(pool.step(key, "x")).observation for key in "abcd"}
        assert pids["a"] == pids["c"] != pids["b"] == pids["d"]
        crashed = result(pool.step("a", "exit"))
        assert crashed == Outcome("", 0.0, True, "the environment worker exited with code 3: this trajectory's "
                                                 "instance is gone")
        assert result(pool.step("c", "x")) == crashed  # its neighbour's instance went with it
        assert result(pool.step("b", "x")).observation == pids["b"]  # the other worker goes on
        until(lambda: pool.replaced == 1 and len(set(pool.pids())) == 2, "a worker in the dead one's place")
        result(pool.reset("a", {}))  # a new trajectory under the same key
        assert result(pool.step("a", "x")).observation not in (pids["a"], "")
    finally:
        pool.close()


def test_a_worker_killed_from_outside_mid_call(tmp_path: Path) -> None:
    """The OOM killer's way: SIGKILL while a call runs (a call that cannot finish until the gate opens)."""
    with EnvPool(spec("Gate", workers=1)) as pool:
        result(pool.reset("k", {"gate": str(tmp_path / "never")}))
        pending = pool.step("k", "wait")
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        assert result(pending) == Outcome("", 0.0, True, "the environment worker died of signal 9 (SIGKILL): "
                                                         "this trajectory's instance is gone")
        until(lambda: pool.replaced == 1, "a worker in the killed one's place")
        result(pool.reset("k", {"gate": str(tmp_path / "never")}))
        assert result(pool.step("k", "go")).observation == "quick"


def test_a_worker_that_answers_garbage_is_replaced() -> None:
    pool = EnvPool(spec("Hostile", workers=1))
    try:
        result(pool.reset("k", {}))
        (old,) = pool.pids()
        out = result(pool.step("k", "forge"))
        assert (out.done, out.error) == (True, "the environment worker answered something that is not an answer: "
                                               "this trajectory's instance is gone")
        until(lambda: gone(old), "the worker to be reaped")
        result(pool.reset("k", {}))
        assert result(pool.step("k", "x")).observation == f"pid={pool.pids()[0]}" != f"pid={old}"
    finally:
        pool.close()


@pytest.mark.parametrize(("action", "observation", "reward", "error"), [
    ("nan", "", 0.0, "step's reward is nan, not a finite number"),
    ("inf", "", 0.0, "step's reward is inf, not a finite number"),
    ("shape", "", 0.0, "step returned ('only two', 1.0), not (observation: str, reward: float, done: bool)"),
    ("bool-reward", "", 0.0, "step's reward is a bool, not a float: True"),
    ("int-done", "", 0.0, "step's done is a int, not a bool: 1"),
    ("raise", "", 0.0, "raised ValueError: bad action"),
    ("exit-call", "", 0.0, "raised SystemExit: 2"),
    ("fake", "real", 0.5, None),  # a str and a float subclass whose overrides lie: converted by exact type
    ("print", "printed", 0.0, None),  # stdout is not the protocol: prints (even an answer's JSON) change nothing
    ("surrogate", "a?b", 0.0, None),  # what UTF-8 cannot write (a rollout goes to files) becomes "?"
])
def test_hostile_return_values(hostile: EnvPool, action: str, observation: str, reward: float,
                               error: str | None) -> None:
    result(hostile.reset(action, {}))
    out = result(hostile.step(action, action))
    expected = observation if error is None else error  # on_error = "observe": the error is the observation
    assert (out.observation, out.reward, out.done, out.error) == (expected, reward, False, error)
    assert type(out.observation) is str and type(out.reward) is float
    result(hostile.reset(action, {}))  # the worker still answers
    assert result(hostile.step(action, "x")).observation.startswith("pid=")


def test_huge_observations_are_cut_and_counted(hostile: EnvPool) -> None:
    before = hostile.truncated
    result(hostile.reset("huge", {}))
    out = result(hostile.step("huge", "huge"))
    assert (out.observation, out.error) == ("x" * OBSERVATION_CHARS, None)
    assert hostile.truncated == before + 1


def test_workers_import_no_torch(hostile: EnvPool) -> None:
    result(hostile.reset("modules", {}))
    assert result(hostile.step("modules", "modules")).observation == ""


def test_ctrl_c_is_left_to_the_parent(hostile: EnvPool) -> None:
    result(hostile.reset("sigint", {}))
    (pid,) = hostile.pids()
    os.kill(pid, signal.SIGINT)
    assert result(hostile.step("sigint", "x")).observation == f"pid={pid}"
    assert hostile.pids() == [pid] and hostile.replaced == 0


@pytest.mark.parametrize("on_error", ["end", "raise"])
def test_on_error_end_and_raise(on_error: str) -> None:
    pool = EnvPool(spec("Hostile", name="game", workers=0, on_error=on_error))
    try:
        result(pool.reset(("p", 1), {}))
        out = result(pool.step(("p", 1), "raise"))
        assert out == Outcome("", 0.0, True, "raised ValueError: bad action", seconds=out.seconds)
        if on_error == "end":
            assert pool.failed is None
            pool.check()
            return
        with pytest.raises(EnvError) as caught:
            pool.check()
        assert str(caught.value) == (
            "error: env 'game' step of trajectory ('p', 1): raised ValueError: bad action\n"
            "hint: on_error = \"observe\" shows the policy the error, \"end\" ends the trajectory; the run goes on")
    finally:
        pool.close()


def test_a_failed_reset_ends_its_trajectory() -> None:
    pool = EnvPool(spec("BadReset", workers=0))
    try:
        out = result(pool.reset("k", {}))
        assert (out.observation, out.done, out.error) == ("raised RuntimeError: no such level", True,
                                                          "raised RuntimeError: no such level")
    finally:
        pool.close()


def test_threads_time_out_too_and_start_no_process() -> None:
    pool = EnvPool(spec("Hostile", workers=0, timeout=1.0, on_error="end"))
    try:
        result(pool.reset("k", {}))
        assert result(pool.step("k", "hang")) == Outcome("", 0.0, True, "timeout after 1 s", True, 1.0)
        assert pool.pids() == []
    finally:
        pool.close()
    pool = EnvPool(spec("Hostile", workers=0))
    try:
        result(pool.reset("j", {}))
        assert result(pool.step("j", "x")).observation == f"pid={os.getpid()}"
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [1, 0])
def test_a_class_that_cannot_load(workers: int) -> None:
    pool = EnvPool(spec("Nope", name="calc", workers=workers))
    try:
        with pytest.raises(EnvLoadError) as caught:
            pool.start()
        assert caught.value.problem == "env 'calc' could not start: module 'sample_envs' has no class 'Nope'"
        assert result(pool.reset("k", {})) == Outcome("", 0.0, True, caught.value.problem)
        assert isinstance(pool.failed, EnvError)
    finally:
        pool.close()


def test_release_and_step_before_reset() -> None:
    with EnvPool(spec("Counter", workers=1)) as pool:
        with pytest.raises(KeyError, match="step before reset"):
            pool.step("k", "x")
        result(pool.reset("k", {}))
        assert pool.load == [1]
        pool.release("k")
        assert pool.load == [0]
        with pytest.raises(KeyError):
            pool.step("k", "x")
        (pid,) = pool.pids()
    assert gone(pid) and pool.closed  # the with block closed it


def test_close_leaves_no_process_and_resolves_what_is_pending() -> None:
    pool = EnvPool(spec("Hostile", workers=2))
    pool.start()
    pids = pool.pids()
    result(pool.reset("k", {}))
    hanging = pool.step("k", "hang")
    pool.close()
    assert all(gone(pid) for pid in pids)
    assert result(hanging) == Outcome("", 0.0, True, "the environment pool was closed")
    assert result(pool.reset("k", {})).error == "the environment pool is closed"


@pytest.mark.parametrize("data", [
    b'{"ready": true}', b"[1, 2]", b'[0, "obs", NaN, false, null, 0.0, false]',
    b'[0, "obs", 1.0, 1, null, 0.0, false]', b'[true, "obs", 1.0, false, null, 0.0, false]',
    b'[0, ["obs"], 1.0, false, null, 0.0, false]', b'[0, "obs", 1.0, false, 3, 0.0, false]', b"not json",
])
def test_what_a_worker_sends_is_checked_before_it_is_believed(data: bytes) -> None:
    with pytest.raises(ValueError):
        read_answer(data)
    assert read_answer(b'[7, "obs", 1, true, null, 0.5, false]') == (7, Answer("obs", 1.0, True, None, 0.5, False))


def test_numpy_rewards_and_dones_are_taken() -> None:
    with EnvPool(spec("Hostile", workers=0)) as pool:
        result(pool.reset("k", {}))
        out = result(pool.step("k", "numpy"))
        assert (out.observation, out.reward, out.done, out.error) == ("obs", 0.25, True, None)
        assert type(out.reward) is float and type(out.done) is bool
