"""A TCP proxy for partition tests: a node's Redis URLs point at it, and the test cuts the node
off. ``blackhole()``: every connection stays open but its bytes go nowhere, both ways, and new
connections are accepted and then ignored (as a network that drops packets: the node's calls
block, nothing fails fast). ``refuse()``: every connection ends with a TCP reset, and so does
each new one at once (calls fail fast). ``reset()``: the open connections end with a reset.
``heal()``: reset what the blackhole left (its bytes are lost; a blocked call must not hang for
ever) and forward again. One thread accepts, two pump each connection."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._forward = True
        self._refusing = False
        self._closed = False
        self.accepted = 0
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def blackhole(self) -> None:
        self._forward = False

    def refuse(self) -> None:
        self._forward, self._refusing = False, True
        self.reset()

    def reset(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            _reset(s)

    def heal(self) -> None:
        self.reset()  # first: a connection from the blackhole never forwards again
        self._forward, self._refusing = True, False

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.reset()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            self.accepted += 1
            if self._refusing:
                _reset(client)
                continue
            upstream: socket.socket | None = None
            if self._forward:
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                    upstream.settimeout(None)
                except OSError:
                    _reset(client)
                    continue
            pair = [client] if upstream is None else [client, upstream]
            with self._lock:
                self._socks.update(pair)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket | None) -> None:
        """Copy ``src`` to ``dst`` while forwarding; drop what arrives while blackholed (and
        everything of a connection accepted then: it has no upstream)."""
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            if dst is None or not self._forward:
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            if s is not None:
                with self._lock:
                    self._socks.discard(s)
                _reset(s)


def _reset(s: socket.socket) -> None:
    """End ``s`` with a TCP reset (SO_LINGER 0), waking a thread blocked reading it."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@contextlib.contextmanager
def proxy_to(host: str, port: int) -> Iterator[TcpProxy]:
    p = TcpProxy((host, port))
    try:
        yield p
    finally:
        p.close()
