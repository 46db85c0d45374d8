"""An environment module that fails on import (tests/envs/test_load.py)."""

from __future__ import annotations

BROKEN = 1 // 0
