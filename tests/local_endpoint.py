"""A real HTTP server on 127.0.0.1 for the notify tests: it keeps the JSON bodies POSTed to it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Endpoint:
    """A local HTTP server that keeps the JSON bodies POSTed to it; `status` answers each,
    `delay` seconds later."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.arrived: list[float] = []  # time.time() of each request
        self.finished = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                endpoint.arrived.append(time.time())
                endpoint.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                time.sleep(delay)
                self.send_response(status)
                self.end_headers()
                endpoint.finished += 1

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
