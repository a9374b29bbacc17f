"""The scheduler's lookups: from a worker's pool, or from the node's service.

``ServiceLookups``: over ``kvtier serve`` the scheduler asks the service
itself, on a lookup-only connection of its own (no memory shared, no client
slot taken); its pins are that connection's, dropped by the service if the
scheduler's process dies. The rest of this module is the pool-of-its-own
case:

The worker owns the pool (its flock, its KV memory); the scheduler, in another
process, asks it how many of a prefix's keys the pool holds, and pins what it
will load. Protocol, scheduler -> worker: op (1 byte: L lookup, P pin, U
unpin), key count (u32 LE), keys (32 bytes each); reply: a u32 count.

The server is one thread running one event loop (selectors), whatever the
peers do: a bounded number of connections (the longest idle one is dropped
for a new one when full), requests read only as their bytes arrive and
bounded in size, and nothing a peer sends can stop the accept loop. The
client has connect and reply timeouts: a worker that does not answer is a
miss to the scheduler, never a hang of vLLM's scheduling loop.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any

from . import ClosedError, KvtierError, TierBuilder

KEY_BYTES = 32
LOOKUP, PIN, UNPIN = b"L", b"P", b"U"
_HEADER = struct.Struct("<cI")
# The most keys one request may name: 65536 blocks is a 1M-token prefix at
# 16-token blocks, far past any context; a frame is then at most 2 MiB.
MAX_KEYS_PER_REQUEST = 1 << 16
# Connections served at once: the scheduler needs one per rank; the rest is
# slack for restarts. Past it the longest idle connection is dropped.
MAX_CONNECTIONS = 32
# A connection that sends nothing for this long is dropped (a half-open or
# stuck peer); the scheduler's client reconnects on its next call.
IDLE_TIMEOUT_S = 60.0
# How long the scheduler waits for a connection and for a reply.
CLIENT_TIMEOUT_S = 2.0


def socket_name(pool_dir: str) -> bytes:
    """An abstract-namespace socket per pool directory: nothing to clean up
    after a crash, and two engines on one pool collide here as on the flock."""
    digest = hashlib.sha256(os.path.realpath(pool_dir).encode()).hexdigest()[:24]
    return b"\0kvtier-vllm-" + digest.encode()


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", creds)[1]


class _Conn:
    __slots__ = ("sock", "buf", "last")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.last = time.monotonic()


class LookupServer:
    """Serves the scheduler's lookups from the worker's own handle."""

    def __init__(self, name: bytes, tier: Any, logger: Any = None) -> None:
        self._tier = tier
        self._log = logger
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(name)
        except OSError as e:
            self._sock.close()
            raise KvtierError(
                f"kvtier: another process already serves this pool's lookups ({e}); "
                "one engine per pool directory: give each its own pool_dir"
            ) from e
        self._sock.listen(64)
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self.dropped_peers = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-lookup", daemon=True)
        self._thread.start()

    # -- the loop ------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            try:
                events = self._sel.select(timeout=1.0)
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            for key, _ in events:
                if key.data == "wake":
                    return
                try:
                    if key.data is None:
                        self._accept()
                    else:
                        self._readable(key.data)
                except Exception as e:  # never let one peer end the loop
                    if self._log is not None:
                        self._log.warning("kvtier lookup service: %s", e)
                    if isinstance(key.data, _Conn):
                        self._drop(key.data)
            self._reap_idle()

    def _accept(self) -> None:
        for _ in range(64):  # a burst of connections: take what is waiting
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the loop goes on
                if self._log is not None:
                    self._log.warning("kvtier lookup service: accept failed: %s", e)
                return
            # An abstract socket has no file permissions: any process in the
            # network namespace can connect. Only processes of this user (the
            # engine's scheduler) may pin, unpin or probe the pool.
            if _peer_uid(conn) != os.geteuid():
                conn.close()
                self.dropped_peers += 1
                continue
            if len(self._conns) >= MAX_CONNECTIONS:
                self._drop(min(self._conns.values(), key=lambda c: c.last))
            conn.setblocking(False)
            c = _Conn(conn)
            self._conns[conn.fileno()] = c
            self._sel.register(conn, selectors.EVENT_READ, c)

    def _readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(c)
            return
        if not data:
            self._drop(c)
            return
        c.buf += data
        c.last = time.monotonic()
        while len(c.buf) >= _HEADER.size:
            op, n = _HEADER.unpack_from(c.buf)
            if op not in (LOOKUP, PIN, UNPIN) or n > MAX_KEYS_PER_REQUEST:
                self._drop(c)  # not our protocol: drop the peer, never wait on it
                return
            size = _HEADER.size + n * KEY_BYTES
            if len(c.buf) < size:
                return
            raw = bytes(c.buf[_HEADER.size:size])
            del c.buf[:size]
            keys = [raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
            try:
                if op == LOOKUP:
                    r = self._tier.lookup(keys)
                elif op == PIN:
                    r = self._tier.lookup_and_pin(keys)
                else:
                    self._tier.unpin(keys)
                    r = 0
            except KvtierError:
                r = 0  # a closed or failing pool holds nothing usable
            try:
                # Replies are 4 bytes to a peer that waits for them; a peer
                # that stops reading is dropped, not waited for.
                c.sock.settimeout(CLIENT_TIMEOUT_S)
                c.sock.sendall(struct.pack("<I", r))
                c.sock.setblocking(False)
            except OSError:
                self._drop(c)
                return

    def _reap_idle(self) -> None:
        now = time.monotonic()
        for c in [c for c in self._conns.values() if now - c.last > IDLE_TIMEOUT_S]:
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock.fileno(), None) is None:
            return
        self.dropped_peers += 1
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for c in list(self._conns.values()):
            self._drop(c)
        self._sel.close()
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("kvtier lookup peer closed the connection")
        buf += chunk
    return bytes(buf)


class LookupClient:
    """The scheduler's view of one rank's pool. Every failure (no worker, a
    worker that does not answer in time) is a count of 0: a miss."""

    def __init__(self, name: bytes, timeout: float = CLIENT_TIMEOUT_S) -> None:
        self._name = name
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.timeouts = 0

    def call(self, op: bytes, keys: list[bytes]) -> int:
        if len(keys) > MAX_KEYS_PER_REQUEST:
            keys = keys[:MAX_KEYS_PER_REQUEST]  # a longer prefix: its head
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(self._timeout)
                        try:
                            s.connect(self._name)
                        except OSError:
                            s.close()
                            raise
                        self._sock = s
                    self._sock.sendall(_HEADER.pack(op, len(keys)) + b"".join(keys))
                    return struct.unpack("<I", _recv_exact(self._sock, 4))[0]
                except OSError as e:
                    if self._sock is not None:
                        self._sock.close()
                    self._sock = None
                    if isinstance(e, TimeoutError):
                        self.timeouts += 1
                        return 0  # a worker too busy to answer: a miss, now
                    if attempt:
                        # No worker serving the pool (not started, or gone):
                        # nothing can be loaded from it.
                        return 0
        return 0


class ServiceLookups:
    """The scheduler's view of the node's kvtier service: one lookup-only
    connection. Every failure is a count of 0 (a miss), never an exception
    into vLLM's scheduling loop; a lost connection (the service restarted)
    is reopened at most once per ``RETRY_S``."""

    RETRY_S = 1.0

    def __init__(self, path: str, logger: Any = None) -> None:
        self._path = path
        self._log = logger
        self._h: Any = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._next_check = 0.0
        self._open()

    def _open(self) -> None:
        try:
            self._h = TierBuilder().service(self._path, lookup_only=True).build()
        except KvtierError as e:
            self._h = None
            self._next_try = time.monotonic() + self.RETRY_S
            if self._log is not None:
                self._log.warning("kvtier: the scheduler cannot reach the kvtier service at %s "
                                  "(every lookup is a miss until it can): %s", self._path, e)

    def _gone(self) -> bool:
        """Whether the connection is gone (a lookup answers 0 either way);
        asked at most once per RETRY_S."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.RETRY_S
        try:
            self._h.usage()
        except ClosedError:
            return True
        except KvtierError:
            return False
        return False

    def call(self, op: bytes, keys: list[bytes]) -> int:
        with self._lock:
            if self._h is None:
                if time.monotonic() < self._next_try:
                    return 0
                self._open()
                if self._h is None:
                    return 0
            try:
                if op == LOOKUP:
                    n = self._h.lookup(keys)
                elif op == PIN:
                    n = self._h.lookup_and_pin(keys)
                else:
                    self._h.unpin(keys)
                    return 0
            except KvtierError:
                n = 0
            if n == 0 and keys and self._gone():
                # Its pins went with it (the service drops a connection's
                # pins): nothing to hand over. The next call reconnects.
                self._close_handle()
                self._next_try = 0.0
            return n

    def _close_handle(self) -> None:
        h, self._h = self._h, None
        if h is not None:
            try:
                h.close()
            except KvtierError:
                pass

    def close(self) -> None:
        with self._lock:
            self._close_handle()
