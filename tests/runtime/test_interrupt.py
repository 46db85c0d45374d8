"""Ctrl-C is remembered: a KeyboardInterrupt swallowed on the way (as a Ray call racing a rank that the same
Ctrl-C killed can swallow it) still ends the run at the next `check` (flowrl/runtime/interrupt.py)."""

from __future__ import annotations

import os
import signal

import pytest

from flowrl.runtime import interrupt


def test_a_swallowed_ctrl_c_is_raised_again_at_the_next_check() -> None:
    before = signal.getsignal(signal.SIGINT)
    try:
        interrupt.install()
        interrupt.check()  # nothing asked yet
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass  # swallowed, as a library might
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        interrupt.install()  # a new run forgets the last one's Ctrl-C
        interrupt.check()
    finally:
        signal.signal(signal.SIGINT, before)
