"""Ctrl-C, remembered (the runtime's side of `flowrl run`'s interruption).

Ctrl-C reaches the whole foreground process group: the driver and, on a local Ray instance, its actors. An
actor killed by it can surface in the driver as a lost rank at the very moment the driver's own
KeyboardInterrupt is raised inside a Ray call, and the rank was then rebuilt and the run went on. The CLI's
handler (`install`) remembers the request; whatever would bring a rank back or start a step asks `check` first.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_ASKED = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _ASKED.set()
    raise KeyboardInterrupt


def install() -> None:
    """Remember Ctrl-C from now on (the main thread only: Python runs signal handlers there)."""
    _ASKED.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C was pressed, even where its first KeyboardInterrupt was swallowed."""
    if _ASKED.is_set():
        raise KeyboardInterrupt
