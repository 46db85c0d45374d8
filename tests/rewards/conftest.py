"""A real scoring service on 127.0.0.1 for the HTTP reward tests: stdlib ThreadingHTTPServer on a free port,
whose behaviour each test picks (normal, blocked until released, 500 once, garbage, ...)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Service:
    """What the server does with each POST: `answer(request body) -> (status, body bytes)`."""

    answer: Callable[[dict[str, Any]], tuple[int, bytes]]
    url: str = ""
    requests: int = 0
    release: threading.Event = field(default_factory=threading.Event)  # unblocks a handler that waits on it


def score_lengths(body: dict[str, Any]) -> tuple[int, bytes]:
    return 200, json.dumps({"scores": [float(len(r)) for r in body["responses"]]}).encode()


@pytest.fixture
def service() -> Iterator[Callable[[Callable[[dict[str, Any]], tuple[int, bytes]]], Service]]:
    servers: list[tuple[ThreadingHTTPServer, Service]] = []

    def start(answer: Callable[[dict[str, Any]], tuple[int, bytes]]) -> Service:
        svc = Service(answer)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                svc.requests += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, out = svc.answer(body)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                except OSError:  # the client gave up (a timeout test): nothing to answer
                    pass

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        svc.url = f"http://127.0.0.1:{server.server_address[1]}/score"
        servers.append((server, svc))
        return svc

    yield start
    for server, svc in servers:
        svc.release.set()
        server.shutdown()
        server.server_close()
