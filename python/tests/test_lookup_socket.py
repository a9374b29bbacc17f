"""The connector's lookup socket (worker -> scheduler) against hostile peers:
an abstract Unix socket has no file permissions, so the server itself must
refuse other users and oversized requests, and keep serving its scheduler."""

import os
import socket
import struct

import pytest

pytest.importorskip("vllm")

import kvtier  # noqa: E402
import kvtier.vllm as kv  # noqa: E402


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
    name = kv._socket_name(str(tmp_path / "pool"))
    server = kv._LookupServer(name, tier)
    try:
        # One key past the bound is refused at once, not awaited (a server
        # that read on would wait for 32 MiB that never come: a timeout here).
        s = connect(name)
        s.sendall(struct.pack("<cI", b"L", kv._MAX_KEYS_PER_REQUEST + 1))
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
        client = kv._LookupClient(name)
        assert client.call(kv._LOOKUP, [b"\1" * 32]) == 0
    finally:
        server.close()
        tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_peer_of_another_user_is_refused(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    name = kv._socket_name(str(tmp_path / "pool"))
    server = kv._LookupServer(name, tier)
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
