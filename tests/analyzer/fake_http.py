"""A stand-in HTTP server for Prometheus failures: slow, erroring, garbage answers."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietServer(ThreadingHTTPServer):
    """Leaves out the traceback of a client that hung up before the answer (the slow cases)."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass


class FakeServer:
    """An HTTP server on a free port whose answers `behave(handler, num_calls)` writes."""

    def __init__(self, behave) -> None:
        self.calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.calls += 1
                behave(self, outer.calls)

            def log_message(self, *_) -> None:
                pass

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def reply(handler, status: int, body: bytes, content_type: str = "application/json") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
