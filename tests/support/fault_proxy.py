"""A fault-injecting HTTP proxy on loopback, in front of fake-gcs-server (issue 48): GCS answers
429 and 503, stalls and drops connections, fake-gcs-server never does.

    with FaultProxy(upstream="http://127.0.0.1:4443", seed=0) as proxy:
        proxy.set(http_429=0.1, http_503=0.1, slow=0.05, drop=0.05)   # rates per request
        ... point STORAGE_EMULATOR_HOST (FakeGCS.env) at proxy.url ...
        proxy.pause()   # every request waits, unanswered, until resume()

Each request draws one fault (or none) from a seeded generator: a 429 or 503 with a JSON error
body, a response delayed by `slow_s`, or a connection closed without an answer. A request
that gets no fault is forwarded whole (method, path, headers, body) and its answer returned
whole, so the client sees what the server said. `counts` says what was injected.
"""

from __future__ import annotations

import http.client
import http.server
import json
import random
import socket
import threading
import time
import urllib.parse
from collections import Counter

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0, slow_s: float = 2.0):
        u = urllib.parse.urlparse(upstream)
        self.host, self.port_up = u.hostname, u.port
        self.rng = random.Random(seed)
        self.rates = {"http_429": 0.0, "http_503": 0.0, "slow": 0.0, "drop": 0.0}
        self.slow_s = slow_s
        self.counts: Counter = Counter()
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.only: set[str] | None = None  # methods faults apply to (None: all)
        self._server = None

    # ------------------------------------------------------------------------------ control
    def set(self, methods=None, **rates) -> None:
        """Fault rates per request (http_429, http_503, slow, drop), the rest kept."""
        unknown = set(rates) - set(self.rates)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(self.rates)}")
        with self.lock:
            self.rates.update(rates)
            self.only = set(methods) if methods else None

    def clear(self) -> None:
        self.set(**dict.fromkeys(self.rates, 0.0))

    def pause(self) -> None:
        """Every request from now on waits, unanswered, until resume()."""
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def _draw(self, method: str) -> str | None:
        with self.lock:
            if self.only is not None and method not in self.only:
                return None
            x, acc = self.rng.random(), 0.0
            for name, rate in self.rates.items():
                acc += rate
                if x < acc:
                    self.counts[name] += 1
                    return name
            self.counts["forwarded"] += 1
            return None

    # ----------------------------------------------------------------------------- serving
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self):
                body = self._body()
                proxy.running.wait()
                fault = proxy._draw(self.command)
                if fault == "drop":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if fault in ("http_429", "http_503"):
                    code = int(fault[-3:])
                    msg = json.dumps({"error": {"code": code, "message": f"injected {code}"}})
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg.encode())
                    return
                if fault == "slow":
                    time.sleep(proxy.slow_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                headers["Host"] = f"{proxy.host}:{proxy.port_up}"
                conn = http.client.HTTPConnection(proxy.host, proxy.port_up, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                # links the server writes with its own address (a resumable upload's Location,
                # selfLink / mediaLink) point back at the proxy, so every later call passes it too
                up, me = f"127.0.0.1:{proxy.port_up}", proxy.url.removeprefix("http://")
                data = data.replace(up.encode(), me.encode())
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v.replace(up, me))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _safe(self):
                try:
                    self._handle()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: fine
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _safe  # noqa: N815

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that reset: quiet
                import sys

                if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.resume()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
