"""A loopback TCP proxy in front of the test Hub that counts file transfers and injects faults.

``FaultProxy(upstream_port).start()`` listens on 127.0.0.1; point ``HF_ENDPOINT`` at
``proxy.endpoint``. It forwards bytes both ways unchanged (huggingface_hub talks real HTTP to the
real server behind it). Each request goes upstream on a connection of its own
(``Connection: close``) and its response is read whole before it is passed on, so the proxy knows
when a file transfer (``GET .../resolve/...``) completed, counts those per path, and can break
them on purpose:

* ``mode = "pass"``: forward everything;
* ``"stall"``: accept connections and read requests but never answer (a hung mirror);
* ``"stall_file"``: answer API calls, but stop sending a file body halfway and keep the
  connection open (a stall mid-file);
* ``"cut_file"``: send half of a file body, then close the connection (a server dying mid-file).

Stopped by :meth:`stop` (closes the listening socket and every connection it opened).
"""

from __future__ import annotations

import collections
import socket
import threading
import time


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.spare = 0  # file transfers let through untouched before a *_file fault starts
        self.completed: collections.Counter[str] = collections.Counter()  # path -> finished file transfers
        self.started: collections.Counter[str] = collections.Counter()  # path -> file GETs begun
        self._lock = threading.Lock()
        self._faulted: set[str] = set()
        self._sockets: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._running = False

    def start(self) -> "FaultProxy":
        self._listener.listen(256)
        self._running = True
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stop(self) -> None:
        self._running = False
        for sock in [self._listener, *self._sockets]:
            try:
                sock.close()
            except OSError:
                pass

    def reset_counts(self) -> None:
        with self._lock:
            self.completed.clear()
            self.started.clear()
            self._faulted.clear()
        self.spare = 0

    def duplicates(self) -> int:
        """File transfers completed more than once (per path) since the last reset."""
        with self._lock:
            return sum(n - 1 for n in self.completed.values() if n > 1)

    # -- plumbing ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while self._running:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        """One client connection: each request goes upstream on its own connection, read whole."""
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:  # GET/HEAD carry no body
                    data = client.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                if self.mode == "stall":
                    while self._running and self.mode == "stall":
                        time.sleep(0.05)
                    return
                method, path = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
                is_file = method == "GET" and "/resolve/" in path
                lines = [l for l in head.split(b"\r\n") if not l.lower().startswith(b"connection:")]
                request = b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n"
                if is_file:
                    with self._lock:
                        self.started[path] += 1
                response = _exchange(self.upstream_port, request)
                with self._lock:
                    spared = is_file and sum(self.completed.values()) < self.spare
                if is_file and self.mode in ("stall_file", "cut_file") and not spared:
                    with self._lock:
                        first = path not in self._faulted
                        self._faulted.add(path)
                    header_end = response.find(b"\r\n\r\n") + 4
                    body = len(response) - header_end
                    client.sendall(response[: header_end + (body // 2 if first else 0)])
                    while self.mode == "stall_file" and self._running:
                        time.sleep(0.05)
                    return  # cut: the connection closes mid-body
                client.sendall(response)
                if is_file:
                    with self._lock:
                        self.completed[path] += 1
        except OSError:
            pass
        finally:
            _close(client)


def _exchange(port: int, request: bytes) -> bytes:
    """Send one request upstream (``Connection: close``) and read the whole response."""
    upstream = socket.create_connection(("127.0.0.1", port))
    try:
        upstream.sendall(request)
        chunks = []
        while True:
            data = upstream.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)
    finally:
        _close(upstream)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
