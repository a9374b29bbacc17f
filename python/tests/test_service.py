"""kvtier.connect: two Python processes on one `kvtier serve` service.

The service is the `kvtier` binary (conftest's kvtier_service fixture)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kvtier


@pytest.fixture
def service(kvtier_service):
    return kvtier_service(clients=4, client_blocks=32)


def expected(key: int, layer: int, shape) -> torch.Tensor:
    """A block's bytes follow from its key and layer."""
    g = torch.Generator().manual_seed(key * 1000 + layer)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


STORER = r"""
import sys, torch, kvtier
sys.path.insert(0, sys.argv[2])
from test_service import expected
h = kvtier.connect(sys.argv[1])
kv = kvtier.service_tensors(h)
keys = list(range(100, 140))
for start in range(0, len(keys), h.memory_blocks):
    part = keys[start:start + h.memory_blocks]
    for b, k in enumerate(part):
        for layer, t in enumerate(kv):
            t[b].copy_(expected(k, layer, t[b].shape))
    r = h.wait(h.submit_store(part, list(range(len(part)))))
    assert r.ok, r
print("STORED", flush=True)
sys.stdin.readline()
h.close()
"""


def test_two_processes_share_stored_blocks_layer_by_layer(service):
    sock, _ = service
    storer = subprocess.Popen(
        [sys.executable, "-c", STORER, str(sock), str(pathlib.Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert storer.stdout.readline().strip() == "STORED"
        # The storer is still connected while this process loads its blocks.
        with kvtier.connect(sock) as h:
            kv = kvtier.service_tensors(h)
            assert kv[0].shape == (32, 2, 16, 2, 64) and kv[0].dtype == torch.bfloat16
            assert kv[0].data_ptr() % 4096 == 0
            keys = list(range(100, 140))
            assert h.lookup(keys) == 40
            part = keys[:32]
            assert h.lookup_and_pin(part) == 32
            blocks = list(reversed(range(32)))
            job = h.submit_load(part, blocks)
            for layer, t in enumerate(kv):
                h.wait_layer(job, layer)
                for k, b in zip(part, blocks):
                    assert torch.equal(t[b], expected(k, layer, t[b].shape)), (k, layer)
            assert h.wait(job).ok
            h.unpin(part)
            assert h.lookup(list(range(1000, 1004))) == 0
        storer.stdin.write("\n")
        storer.stdin.flush()
        assert storer.wait(timeout=30) == 0
    finally:
        storer.kill()


def test_misuse_is_refused_clearly(service):
    sock, _ = service
    with pytest.raises(kvtier.UnsupportedError, match="kv_memory"):
        kvtier.connect(sock, memory="cuda")
    with pytest.raises(kvtier.UsageError, match="client_blocks"):
        kvtier.connect(sock, blocks=33)
    with kvtier.connect(sock, blocks=8) as h:
        assert h.memory_blocks == 8
        with pytest.raises(kvtier.UsageError, match="out of range"):
            h.submit_store([1], [8])
    with pytest.raises(kvtier.IoError, match="connecting to the kvtier service"):
        kvtier.connect(sock.parent / "nobody.sock")


def _same_script(h, blocks: int) -> list[bytes]:
    """One script of handle calls, the same on any TierHandle: store 8 keys
    from blocks 0..8, look up, pin, load them back into the other blocks
    layer by layer, watch the event stream, remove one. Returns the loaded
    blocks' bytes."""
    import select

    n = h.block_bytes
    keys = list(range(500, 508))
    data = [bytes([k % 251, 7]) * (n // 2) for k in keys]
    for b, d in enumerate(data):
        h.write_block(b, d)
    h.drain_completions()
    assert h.lookup(keys) == 0
    store = h.submit_store(keys, list(range(8)))
    h.flush_stores()
    r = h.wait(store)
    assert r.ok and r.kind == "store", r
    with pytest.raises(kvtier.UsageError, match="already taken"):
        h.try_result(store)
    assert h.lookup(keys) == 8 and h.contains(503) and not h.contains(9999)
    assert h.lookup_and_pin(keys + [9998]) == 8
    dst = list(range(blocks - 1, blocks - 9, -1))
    job = h.submit_load(keys, dst)
    layers = h.geometry["layers"]
    for layer in range(layers):
        h.wait_layer(job, layer)
    assert h.wait(job).ok
    h.unpin(keys)
    # The event stream: every layer, then the load; the fd polls readable.
    select.select([h.event_fd()], [], [], 5)
    events = h.drain_completions()
    assert [e.layer for e in events if e.kind == "layer" and e.job == job] == list(range(layers))
    assert any(e.kind == "finished" and e.job == job and e.ok for e in events)
    assert any(e.kind == "finished" and e.job == store and e.ok for e in events)
    loaded = [h.read_block(b) for b in dst]
    assert h.remove(keys[7:]) == 1 and h.lookup(keys) == 7
    assert "tier" in h.usage()
    assert h.get_finished() == []
    assert loaded == data
    return loaded


def test_builder_service_gives_the_handle_api_of_an_own_pool(service, tmp_path, tiny_model):
    sock, _ = service
    remote = kvtier.TierBuilder().service(sock, blocks=16).model(tiny_model).build()
    own = (kvtier.TierBuilder().directory(tmp_path / "own").capacity("64m").model(tiny_model)
           .host_cache(16).build())
    assert type(remote) is type(own) is kvtier.TierHandle
    assert kvtier.ServiceHandle is kvtier.TierHandle
    assert remote.service == str(sock) and own.service is None
    assert remote.memory_blocks == 16 and remote.geometry == own.geometry
    assert "kvtier service" in remote.engine_reason
    with own, remote:
        assert _same_script(own, 16) == _same_script(remote, 16)
        # Through a service the memory is the shared slice, as tensors too.
        kv = kvtier.service_tensors(remote)
        assert kv[0].shape[0] == 16
        with pytest.raises(kvtier.UsageError, match="shares"):
            own.layer_region(0)
    with pytest.raises(kvtier.ClosedError):
        remote.submit_store([1], [0])


def test_builder_service_refuses_what_the_service_decides(service, tmp_path, tiny_model):
    sock, _ = service
    with pytest.raises(kvtier.UsageError,
                       match=r"directory\(\), capacity\(\), create\(\) set up a pool"):
        (kvtier.TierBuilder().directory(tmp_path / "p").capacity("64m").create("never")
         .service(sock).build())
    with pytest.raises(kvtier.UsageError, match=r"namespace\(\), host_cache\(\).*service\("):
        kvtier.TierBuilder().namespace("x").host_cache(4).service(sock).build()
    # What this process expects is checked against what the service serves.
    with pytest.raises(kvtier.UsageError, match="serves"):
        kvtier.TierBuilder().service(sock).model(tiny_model, block_size=32).build()
    with pytest.raises(kvtier.UsageError, match="client_blocks"):
        kvtier.TierBuilder().service(sock, blocks=33).build()
    # kvtier.connect is the short form of the same thing.
    with kvtier.connect(sock, blocks=4) as h:
        assert type(h) is kvtier.TierHandle and h.memory_blocks == 4


def test_service_handles_name_the_pools_namespace_and_model(kvtier_service, tmp_path,
                                                            tiny_model):
    """The service's welcome names its pool's namespace and model: a client
    sees what an in-process handle on a pool of that model sees."""
    sock, _ = kvtier_service(clients=1, client_blocks=8)
    own = (kvtier.TierBuilder().directory(tmp_path / "own").capacity("64m").model(tiny_model)
           .host_cache(4).build())
    with own, kvtier.connect(sock) as remote, kvtier.connect(sock, lookup_only=True) as lo:
        assert own.namespace and own.model_name
        for h in (remote, lo):
            assert (h.namespace, h.model_name) == (own.namespace, own.model_name)
            assert own.namespace in repr(h)


def test_lookup_only_handle_shares_no_memory(kvtier_service):
    """An engine's scheduler: lookups and pins, no memory, no client slot
    (the one slot here is taken); loads, stores and memory are refused."""
    sock, _ = kvtier_service(clients=1, client_blocks=8)
    with kvtier.connect(sock) as h, \
            kvtier.TierBuilder().service(sock, lookup_only=True).build() as lo:
        n = h.block_bytes
        for b in range(4):
            h.write_block(b, bytes([b + 1]) * n)
        assert h.wait(h.submit_store([1, 2, 3, 4], [0, 1, 2, 3])).ok
        assert lo.memory_blocks == 0
        assert lo.lookup([1, 2, 3, 4, 5]) == 4
        assert lo.lookup_and_pin([1, 2]) == 2
        lo.unpin([1, 2])
        for call in (lambda: lo.submit_load([1], [0]), lambda: lo.submit_store([9], [0]),
                     lambda: lo.host_memory(), lambda: kvtier.service_tensors(lo)):
            with pytest.raises(kvtier.UsageError, match="lookup-only|shares"):
                call()
        with pytest.raises(kvtier.UsageError, match="lookup_only"):
            kvtier.TierBuilder().service(sock, blocks=4, lookup_only=True).build()
