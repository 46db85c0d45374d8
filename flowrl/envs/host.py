"""Where environment calls run (flowrl.envs): one pool worker's instances and the calls on them (`Runner`), in a
child process (`main`; `Worker` is the pool's handle on it, started by `flowrl.envs.pool.EnvPool`) or in threads
of the caller (`workers = 0`).

Each call runs in a thread of its own, so one slow environment does not hold the others; an `async def` method's
coroutine runs on the worker's one event loop (an `async def` that blocks that loop holds the worker's other
async calls until it returns, or until the pool kills the worker). What comes back is an `Answer` of plain
builtins, converted here by exact type: an observation that is a `str` subclass becomes a plain `str`, a reward
goes through `float` (a `bool`, NaN or inf is an error), `done` must be a bool, anything else is an error
naming what came back. So the pool never runs, nor unpickles, an object of the environment's making: the child
answers in JSON on a socket of its own (stdout is sent to stderr, a print cannot corrupt the protocol).

Observations longer than `OBSERVATION_CHARS` characters are cut there (`Answer.truncated` is set, the pool
counts them); error texts are cut at `ERROR_CHARS`. The child ignores SIGINT (Ctrl-C is the parent's to handle)
and imports neither torch nor the runtime: it is ready in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.envs.protocol import EnvSpec

OBSERVATION_CHARS = 4096
ERROR_CHARS = 1000
SHAPE = "(observation: str, reward: float, done: bool)"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where `flowrl` is found
_CHILD = "import sys; from flowrl.envs.host import main; main(int(sys.argv[1]))"


@dataclass(frozen=True)
class Answer:
    """What one reset or step produced, builtins only. `error` is set when the call raised or returned
    something unusable; `seconds` is the call's own time, measured where it ran."""

    observation: str
    reward: float = 0.0
    done: bool = False
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False

    def wire(self, call: int) -> bytes:
        return json.dumps([call, self.observation, self.reward, self.done, self.error, self.seconds,
                           self.truncated]).encode()


def read_answer(data: bytes) -> tuple[int, Answer]:
    """A child's answer from its JSON; ValueError when it is not one (the child is then not to be trusted)."""
    value = json.loads(data)
    if not (isinstance(value, list) and len(value) == 7):
        raise ValueError("not an answer")
    call, obs, reward, done, error, seconds, truncated = value
    kinds = ((call, int), (obs, str), (reward, (int, float)), (done, bool), (seconds, (int, float)),
             (truncated, bool))
    if any(type(v) is bool and t is not bool or not isinstance(v, t) for v, t in kinds) or \
            not (error is None or isinstance(error, str)):
        raise ValueError("an answer of the wrong types")
    if not math.isfinite(reward):  # JSON's NaN and Infinity parse; a reward never is one
        raise ValueError("an answer with a reward that is not finite")
    return call, Answer(obs, float(reward), done, error, float(seconds), truncated)


class ReturnError(Exception):
    """A reset's or step's return value refused here; the message says what came back."""


def _utf8(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate) as "?": a rollout's text is written to files."""
    return text.encode("utf-8", "replace").decode("utf-8")


def cut(text: str, limit: int) -> tuple[str, bool]:
    return (text[:limit], True) if len(text) > limit else (text, False)


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__} whose repr raised>"
    return cut(text, 200)[0]


def _raised(e: BaseException) -> str:
    try:
        what = str(e)
    except Exception:
        what = "<its message raised>"
    return _utf8(cut(f"raised {type(e).__name__}: {what}" if what else f"raised {type(e).__name__}",
                     ERROR_CHARS)[0])


def _observation(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _utf8(str.__str__(value))  # a subclass's own methods never leave this process
    raise ReturnError(f"{where} is a {type(value).__name__}, not a str: {_show(value)}")


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ReturnError(f"step's reward is a {type(value).__name__}, not a float: {_show(value)}")
    out = float.__float__(value) if isinstance(value, float) else float(value)
    out = float.__float__(out)  # exact float even if __float__ gave a subclass
    if not math.isfinite(out):
        raise ReturnError(f"step's reward is {out}, not a finite number")
    return out


def _done(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):  # numpy 1 and 2
        return bool(value)
    raise ReturnError(f"step's done is a {type(value).__name__}, not a bool: {_show(value)}")


def step_answer(value: Any) -> Answer:
    """A step's return value checked and converted (see the module docstring)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ReturnError(f"step returned {_show(value)}, not {SHAPE}")
    obs, reward, done = value
    text, truncated = cut(_observation(obs, "step's observation"), OBSERVATION_CHARS)
    return Answer(text, _reward(reward), _done(done), truncated=truncated)


def reset_answer(value: Any) -> Answer:
    """A reset's return value: the text after the prompt (None is "")."""
    text, truncated = cut("" if value is None else _observation(value, "reset's return value"), OBSERVATION_CHARS)
    return Answer(text, truncated=truncated)


class Runner:
    """One worker's instances (`key` -> instance of `cls`) and their calls, each in a thread of its own;
    `reply(call, answer)` is called from that thread when the call ends. Calls on one instance run one at a time
    (a step sent after an earlier one timed out waits for it): an environment is written for one caller."""

    def __init__(self, cls: type, options: Mapping[str, Any], reply: Callable[[int, Answer], None]):
        self.cls, self.options, self.reply = cls, dict(options), reply
        self.instances: dict[Hashable, Any] = {}
        self.gates: dict[Hashable, threading.Lock] = {}  # one per instance: its calls in turn
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    def submit(self, call: int, op: str, key: Hashable, payload: Any) -> None:
        # daemon threads: a call that never returns is abandoned (in a child, the pool kills the process)
        threading.Thread(target=self._run, args=(call, op, key, payload), daemon=True,
                         name=f"flowrl-env-{call}").start()

    def release(self, key: Hashable) -> None:
        with self.lock:
            self.instances.pop(key, None)
            self.gates.pop(key, None)

    def _run(self, call: int, op: str, key: Hashable, payload: Any) -> None:
        with self.lock:
            if op == "reset":
                self.instances.pop(key, None)
                self.gates[key] = threading.Lock()
            gate = self.gates.get(key) or threading.Lock()
        with gate:
            start = time.perf_counter()  # the call's own time: not its wait for an earlier call
            answer = self._answer(op, key, payload)
            self.reply(call, replace(answer, seconds=time.perf_counter() - start))

    def _answer(self, op: str, key: Hashable, payload: Any) -> Answer:
        try:
            if op == "reset":
                instance = self.cls(**self.options)
                with self.lock:
                    self.instances[key] = instance
                return reset_answer(self._call(instance.reset, payload))
            with self.lock:
                instance = self.instances.get(key)
            if instance is None:
                raise LookupError("no environment instance for this trajectory (its reset failed)")
            return step_answer(self._call(instance.step, payload))
        except ReturnError as e:
            return Answer("", error=_utf8(cut(str(e), ERROR_CHARS)[0]))
        except BaseException as e:  # SystemExit and the like from the environment are its errors too
            return Answer("", error=_raised(e))

    def _call(self, method: Callable[[Any], Any], arg: Any) -> Any:
        value = method(arg)
        if inspect.isawaitable(value):
            value = asyncio.run_coroutine_threadsafe(_awaited(value), self._loop()).result()
        return value

    def _loop(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True, name="flowrl-env-loop").start()
            return self.loop


class Worker:
    """One worker process, from the pool's side: its connection, a reader thread, and the messages held until
    it is ready."""

    def __init__(self, index: int, spec: EnvSpec, on_ready: Callable[[Worker, str | None], None],
                 on_answer: Callable[[Worker, bytes], None], on_exit: Callable[[Worker], None]):
        self.index = index
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _ROOT) if p))
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.lock = threading.Lock()
        self.ready = False
        self.held: list[Any] = []  # messages sent before it was ready
        self.started = threading.Event()  # ready, or failed to start
        self.conn.send(replace(spec, options=dict(spec.options)))
        self.on_ready, self.on_answer, self.on_exit = on_ready, on_answer, on_exit
        self.reader = threading.Thread(target=self._read, daemon=True, name=f"flowrl-env-reader-{index}")
        self.reader.start()

    def send(self, message: Any) -> bool:
        """Send now if ready (True), else hold it for when it is (False)."""
        with self.lock:
            if not self.ready:
                self.held.append(message)
                return False
            self._send(message)
            return True

    def _send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # it died: the reader sees it and the pool replaces it
            pass

    def _read(self) -> None:
        try:
            hello = json.loads(self.conn.recv_bytes())
            if hello != {"ready": True}:
                self.on_ready(self, str(hello.get("error") if isinstance(hello, dict) else hello))
                return
            self.on_ready(self, None)
            while True:
                self.on_answer(self, self.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            if not self.started.is_set():
                self.on_ready(self, f"it {self.death(wait=5.0)} while starting")
            else:
                self.on_exit(self)

    def flush(self) -> list[Any]:
        """Mark it ready and send what was held; returns the held messages."""
        with self.lock:
            self.ready = True
            held, self.held = self.held, []
            for message in held:
                self._send(message)
        return held

    def death(self, wait: float = 0.0) -> str:
        try:
            code = self.proc.wait(timeout=wait) if wait > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"died of signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                return f"died of signal {-code}"
        return f"exited with code {code}"

    def stop(self, kill: bool) -> None:
        if not kill:
            self._send(None)
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


async def _awaited(value: Any) -> Any:
    return await value


def main(fd: int) -> None:
    """A pool worker process: read the spec, load the class, say ready, then run calls until told to stop (None)
    or the parent goes away. Messages in: ("reset", call, key, row), ("step", call, key, action),
    ("release", key); out: {"ready": true} or {"error": text}, then one `Answer.wire` per call."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.dup2(2, 1)  # an environment's prints go to stderr, never into a pipe someone reads
    conn = Connection(fd)
    send = threading.Lock()
    try:
        from flowrl.envs.load import load_env_class

        spec = conn.recv()
        cls = load_env_class(spec)
    except Exception as e:  # the parent says which environment could not start
        problem = getattr(e, "problem", None) or f"{type(e).__name__}: {e}"
        conn.send_bytes(json.dumps({"error": str(problem)}).encode())
        os._exit(0)

    def reply(call: int, answer: Answer) -> None:
        with send:
            try:
                conn.send_bytes(answer.wire(call))
            except OSError:  # the parent is gone; the read below ends the process
                pass

    runner = Runner(cls, spec.options, reply)
    conn.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        if message[0] == "release":
            runner.release(message[1])
        else:
            runner.submit(message[1], message[0], message[2], message[3])
    sys.stderr.flush()
    os._exit(0)  # calls still running (a hung environment) end with the process
