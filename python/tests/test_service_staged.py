"""GPU KV memory through `kvtier serve`, on the CPU.

`TierBuilder().service(PATH).model(...).kv_memory([cuda tensors])` serves a
process's own GPU KV memory through the service on the staged path: the
memory the service shares is the staging, the service reads and verifies
each layer into it, and this process copies it into its tensors (stores:
gathers with checksums into it). Without a GPU these tests run the same path
through its TEST DOUBLE, `test_only_staged_host_double()`: CPU tensors pose
as the GPU's KV memory and the CPU does the staging kernels' copies. The
service is the `kvtier` binary (conftest's kvtier_service fixture).
"""

import pytest
import torch

import kvtier
from test_staged import LAYERS, BS, block_layer, builder, cache


def client(sock, model, tensors, layout, double=True, **staging):
    b = kvtier.TierBuilder().service(sock).model(model, block_size=BS)
    if double:
        b = b.test_only_staged_host_double()
    if staging:
        b = b.staging(**staging)
    return b.kv_memory(tensors if layout != "cross_layer" else tensors[0], layout=layout).build()


@pytest.mark.parametrize("layout", ["per_layer", "block_major", "cross_layer"])
def test_double_through_the_service_gives_the_bytes_in_process_gives(
        kvtier_service, tmp_path, tiny_model, layout):
    sock, _ = kvtier_service(clients=3, client_blocks=32)
    blocks = 12
    ta, tb = cache(layout, blocks), cache(layout, blocks)
    # A layer buffer of 3 blocks and a store area of 4: the 8-block jobs go
    # in chunks through the shared staging.
    staging = dict(layer_buffers=2, load_blocks=3, store_blocks=4, store_chunk_blocks=2)
    a = client(sock, tiny_model, ta, layout, **staging)
    b = client(sock, tiny_model, tb, layout, **staging)
    assert a.staged and a.service == str(sock) and a.memory_blocks == blocks
    assert a.memory_device == "cpu"
    with pytest.raises(kvtier.UsageError, match="layer_region"):
        a.layer_region(0)
    src = list(range(8))
    keys = [bytes([9, i]) * 16 for i in range(8)]
    want = {(s, l): block_layer(ta, layout, s, l).clone() for s in src for l in range(LAYERS)}
    r = a.wait(a.submit_store(keys, src))
    assert r.ok and r.outcomes == ["done"] * 8
    # The second client (its own "GPU" memory) loads what the first stored.
    dst = [11, 10, 9, 8, 7, 6, 5, 4]
    assert b.lookup_and_pin(keys) == 8
    job = b.submit_load(keys, dst)
    for layer in range(LAYERS):
        # With the double there is no GPU event: the host waits.
        assert b.stream_wait_layer(job, layer, 0) is False
        b.wait_layer(job, layer)
        for s, d in zip(src, dst):
            assert torch.equal(block_layer(tb, layout, d, layer), want[(s, layer)]), (s, layer)
    r = b.wait(job)
    assert r.ok and r.kind == "load"
    b.unpin(keys)
    ev = [e for e in b.drain_completions() if e.job == job]
    assert [e.layer for e in ev if e.kind == "layer"] == list(range(LAYERS))
    assert ev[-1].kind == "finished" and ev[-1].ok
    a.close()
    b.close()

    # The same store and load in-process on the staged double: equal bytes.
    tc = cache(layout, blocks)
    for x, y in zip(tc, ta):
        x.copy_(y)
    own = builder(tmp_path, tiny_model).kv_memory(tc if layout != "cross_layer" else tc[0],
                                                  layout=layout).build()
    assert own.wait(own.submit_store(keys, src)).ok
    assert own.lookup_and_pin(keys) == 8
    assert own.wait(own.submit_load(keys, dst)).ok
    own.unpin(keys)
    for d in dst:
        for layer in range(LAYERS):
            assert torch.equal(block_layer(tc, layout, d, layer), block_layer(tb, layout, d, layer))
    own.close()


def test_misuse_through_the_service_names_the_fix(kvtier_service, tiny_model):
    sock, _ = kvtier_service(clients=2, client_blocks=16)
    t = cache("per_layer", 4)
    # CPU tensors without the double: host memory through a service is the
    # memory the service shares.
    with pytest.raises(kvtier.UsageError, match="CUDA tensors"):
        client(sock, tiny_model, t, "per_layer", double=False)
    # The staging must fit the blocks the service shares.
    with pytest.raises(kvtier.KvtierError, match="takes 20 blocks of the 16"):
        client(sock, tiny_model, t, "per_layer", layer_buffers=4, load_blocks=4, store_blocks=4)
    # No model: the tensors' geometry is unknown.
    with pytest.raises(kvtier.UsageError, match="give the model"):
        kvtier.TierBuilder().service(sock).test_only_staged_host_double().kv_memory(t).build()
    # Calls that set up a pool of this process's own are still refused.
    with pytest.raises(kvtier.UsageError, match="capacity"):
        (kvtier.TierBuilder().service(sock).model(tiny_model, block_size=BS).capacity("16m")
         .test_only_staged_host_double().kv_memory(t).build())
