"""A loopback TCP proxy in front of the test Hub that counts file transfers and injects faults.

``FaultProxy(upstream_port).start()`` listens on 127.0.0.1; point ``HF_ENDPOINT`` at
``proxy.endpoint``. It forwards bytes both ways unchanged (huggingface_hub talks real HTTP to the
real server behind it) and reads just enough of each exchange to know the request line and the
response's ``Content-Length``, so it can count *completed* file transfers (``GET .../resolve/...``)
per path and break them on purpose:

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
        if self.mode == "stall":
            try:
                while self._running and client.recv(65536):
                    pass
            except OSError:
                pass
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        self._sockets.append(upstream)
        current: list[tuple[str, str]] = []  # requests sent, oldest first (no pipelining: one at a time)
        threading.Thread(target=self._requests, args=(client, upstream, current), daemon=True).start()
        self._responses(upstream, client, current)

    def _requests(self, client: socket.socket, upstream: socket.socket, current: list) -> None:
        buf = b""
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                buf += data
                while b"\r\n\r\n" in buf:  # GET/HEAD carry no body
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    method, path = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
                    current.append((method, path))
                    if method == "GET" and "/resolve/" in path:
                        with self._lock:
                            self.started[path] += 1
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket, current: list) -> None:
        # Bytes are forwarded as they come; a copy is parsed only to see where each response and
        # body ends. body_left: bytes of the current body still to come; CHUNKED: until the
        # 0-size chunk; UNTIL_CLOSE: no length given (the server closes when done).
        buf, body_left, request, end = b"", None, ("?", "?"), b"\r\n0\r\n\r\n"
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                buf += data
                consumed_before = len(buf) - len(data)  # where this read starts in buf
                while buf:
                    if body_left is None:
                        if b"\r\n\r\n" not in buf:
                            break
                        head, rest = buf.split(b"\r\n\r\n", 1)
                        request = current.pop(0) if current else ("?", "?")
                        length, chunked = None, False
                        for line in head.split(b"\r\n")[1:]:
                            name, _, value = line.partition(b":")
                            name = name.strip().lower()
                            if name == b"content-length":
                                length = int(value.strip())
                            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                                chunked = True
                        status = head.split(b" ")[1] if b" " in head else b""
                        no_body = request[0] == "HEAD" or status in (b"204", b"304")
                        body_left = 0 if no_body else CHUNKED if chunked else length if length is not None else UNTIL_CLOSE
                        is_file = request[0] == "GET" and "/resolve/" in request[1] and status in (b"200", b"206")
                        if is_file and self.mode in ("stall_file", "cut_file") and body_left != 0:
                            # part of the body the first time; a resumed request gets none of it
                            with self._lock:
                                first = request[1] not in self._faulted
                                self._faulted.add(request[1])
                            header_end = len(buf) - len(rest) - consumed_before
                            send = max(header_end, 0) + (max(len(rest) // 2, 1) if first else 0)
                            client.sendall(data[:send])
                            if self.mode == "stall_file":
                                while self._running and self.mode == "stall_file":
                                    time.sleep(0.05)
                            return
                        buf = rest
                        if body_left == CHUNKED and buf.startswith(end[2:]):
                            buf = b"\r\n" + buf  # an empty chunked body
                    if body_left == UNTIL_CLOSE:
                        buf = b""
                        break
                    if body_left == CHUNKED:
                        stop = buf.find(end)
                        if stop < 0:
                            buf = buf[-(len(end) - 1):]  # the terminator may straddle two reads
                            break
                        buf, body_left = buf[stop + len(end):], 0
                    else:
                        take = min(len(buf), body_left)
                        buf, body_left = buf[take:], body_left - take
                    if body_left == 0:
                        if request[0] == "GET" and "/resolve/" in request[1]:
                            with self._lock:
                                self.completed[request[1]] += 1
                        body_left = None
                    else:
                        break
                client.sendall(data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)


CHUNKED, UNTIL_CLOSE = -1, -2


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
