"""A reward worker process's loop (flowrl.rewards): what `flowrl.runtime.scoring.PoolScorer` spawns.

Kept apart from the runtime so that a worker imports only the registry and the reward's own module (no torch):
it is ready in a fraction of a second, and its time limit counts the reward's time alone.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection

from flowrl.registry import extra_columns, import_module, resolve_reward


def serve(conn: Connection, target: str, imports: Sequence[str], folder: str) -> None:
    """Resolve the reward, say ("ready", None), then score (prompt, response, row) tasks until told to stop
    (None). Each answer is ("ok", value) or ("error", what the function raised)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    sys.path.insert(0, folder)
    try:
        for module in imports:
            import_module(module)
        found = resolve_reward(target)
        fn = found.fn
    except Exception as e:  # the parent says which reward could not start
        conn.send(("error", f"could not load: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while (task := conn.recv()) is not None:
        prompt, response, row = task
        try:
            if found.batched:  # one sample as a batch of one
                columns = {k: [v] for k, v in row.items() if k != "prompt"}
                conn.send(("ok", list(fn([prompt], [response], **columns))[0]))
            else:
                conn.send(("ok", fn(prompt, response, **extra_columns(fn, row))))
        except Exception as e:
            conn.send(("error", f"raised {type(e).__name__}: {e}"))
