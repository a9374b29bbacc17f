"""The connector's lookup socket (worker -> scheduler) against hostile and
heavy peers: an abstract Unix socket has no file permissions, so the server
itself must refuse other users and oversized requests, stay one thread with
bounded memory whatever connects, survive failed accepts, and keep serving
its scheduler; the scheduler's client never hangs on a silent worker."""

import os
import resource
import socket
import struct
import threading
import time

import pytest

pytest.importorskip("vllm")

import kvtier  # noqa: E402
import kvtier._vllm_lookup as kv  # noqa: E402


def open_tier(tmp_path, model):
    return (
        kvtier.TierBuilder()
        .directory(tmp_path / "pool")
        .capacity("16m")
        .model(model, block_size=16)
        .engine("auto")
        .host_cache(4)
        .build()
    )


def connect(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(name)
    return s


def dropped(s):
    """The server closed on us: EOF, or a reset when our bytes went unread."""
    try:
        return s.recv(4) == b""
    except ConnectionResetError:
        return True


def test_oversized_and_unknown_requests_drop_the_peer_not_the_server(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    name = kv.socket_name(str(tmp_path / "pool"))
    server = kv.LookupServer(name, tier)
    try:
        # One key past the bound is refused at once, not awaited (a server
        # that read on would wait for 32 MiB that never come: a timeout here).
        s = connect(name)
        s.sendall(struct.pack("<cI", b"L", kv.MAX_KEYS_PER_REQUEST + 1))
        assert dropped(s)
        s.close()
        # A count a u32 allows (128 GiB of keys) is refused before any read.
        s = connect(name)
        s.sendall(struct.pack("<cI", b"L", 0xFFFFFFFF))
        assert dropped(s)  # no reply
        s.close()
        # An unknown operation likewise.
        s = connect(name)
        s.sendall(struct.pack("<cI", b"X", 1) + b"\0" * 32)
        assert dropped(s)
        s.close()
        # The scheduler's own client still gets answers.
        client = kv.LookupClient(name)
        assert client.call(kv.LOOKUP, [b"\1" * 32]) == 0
    finally:
        server.close()
        tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_peer_of_another_user_is_refused(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    name = kv.socket_name(str(tmp_path / "pool"))
    server = kv.LookupServer(name, tier)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become nobody, then ask for a pin
            os.close(r)
            got = b"?"
            try:
                os.setuid(65534)
                s = connect(name)
                s.sendall(struct.pack("<cI", b"P", 1) + b"\1" * 32)
                got = s.recv(4)
            except OSError:  # refused, or reset with our request unread
                got = b""
            os.write(w, b"refused" if got == b"" else b"answered")
            os._exit(0)
        os.close(w)
        verdict = os.read(r, 16)
        os.waitpid(pid, 0)
        assert verdict == b"refused"
    finally:
        server.close()
        tier.close()


def test_thousands_of_half_open_connections_cost_no_threads_and_bounded_memory(
        tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    name = kv.socket_name(str(tmp_path / "pool"))
    server = kv.LookupServer(name, tier)
    threads = threading.active_count()
    socks = []
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        n = min(3000, soft - len(os.listdir("/proc/self/fd")) - 64)
        assert n > 500, "the open-file limit leaves too little room for this test"
        # Half-open peers: connect, send a frame header promising the most
        # keys, then some of them, and never finish.
        part = struct.pack("<cI", b"L", kv.MAX_KEYS_PER_REQUEST) + b"\0" * (256 << 10)
        for i in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(name)
            except BlockingIOError:
                pass
            if i % 10 == 0:
                try:
                    s.send(part)
                except OSError:
                    pass
            socks.append(s)
        time.sleep(0.5)
        assert threading.active_count() == threads, "the server made a thread per peer"
        assert server.connections <= kv.MAX_CONNECTIONS
        buffered = sum(len(c.buf) for c in list(server._conns.values()))
        assert buffered <= kv.MAX_CONNECTIONS * (kv.MAX_KEYS_PER_REQUEST * kv.KEY_BYTES + 5)
        # The scheduler still gets its answer at once.
        client = kv.LookupClient(name)
        t0 = time.monotonic()
        assert client.call(kv.LOOKUP, [b"\1" * 32]) == 0
        assert time.monotonic() - t0 < kv.CLIENT_TIMEOUT_S and client.timeouts == 0
    finally:
        for s in socks:
            s.close()
        server.close()
        tier.close()


def test_failed_accepts_do_not_end_the_service(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    name = kv.socket_name(str(tmp_path / "pool"))
    server = kv.LookupServer(name, tier)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    socks = []
    try:
        # Out of file descriptors: the server's accept() fails with EMFILE
        # while peers queue in the backlog.
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            for _ in range(64):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                socks.append(s)
                s.setblocking(False)
                try:
                    s.connect(name)
                except BlockingIOError:
                    pass
        except OSError:
            pass  # this process is out of descriptors too: enough peers queued
        time.sleep(0.3)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in socks:
            s.close()
    try:
        client = kv.LookupClient(name)
        assert client.call(kv.LOOKUP, [b"\1" * 32]) == 0 and client.timeouts == 0
        assert server._thread.is_alive()
    finally:
        server.close()
        tier.close()


def test_a_worker_that_does_not_answer_is_a_miss_not_a_hang(tmp_path):
    name = kv.socket_name(str(tmp_path / "silent"))
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(name)
    silent.listen(8)  # connects succeed; nothing ever answers
    try:
        client = kv.LookupClient(name, timeout=0.3)
        t0 = time.monotonic()
        assert client.call(kv.PIN, [b"\1" * 32]) == 0
        assert time.monotonic() - t0 < 3 and client.timeouts == 1
    finally:
        silent.close()
