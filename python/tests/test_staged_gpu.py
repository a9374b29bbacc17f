"""CUDA torch tensors on the staged HBM path, on a real GPU.

Skipped (visibly) without torch.cuda. Runs under pytest, or without it
(`python3 test_staged_gpu.py`: the GPU machine's python3 may lack pytest;
scripts/gpu/pass9.sh runs it so from a prebuilt wheel).
"""

import os
import sys
import tempfile

import torch

import kvtier

try:
    import pytest
except ImportError:  # the GPU machine's bare python3
    pytest = None

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny-llama", "config.json")
LAYERS, BS, HEADS, DIM = 2, 16, 2, 64


class Skip(Exception):
    pass


def need_gpu():
    if not torch.cuda.is_available():
        msg = "no CUDA device (torch.cuda.is_available() is False): the staged HBM path's GPU tests need one"
        if pytest is not None:
            pytest.skip(msg)
        raise Skip(msg)


def open_tier(d, tensors, layout):
    return (
        kvtier.TierBuilder()
        .directory(os.path.join(str(d), "pool"))
        .capacity("64m")
        .model(TINY, block_size=BS)
        .engine("uring")
        .staging(layer_buffers=2, load_blocks=8, store_blocks=8)
        .kv_memory(tensors, layout=layout)
        .build()
    )


def layer_of(t, layout, blocks, layer):
    idx = torch.tensor(blocks, device=t[0].device)
    if layout == "per_layer":
        return t[layer][:, idx]
    return t[layer][idx]


def round_trip(d, layout, stream_wait):
    blocks = 16
    shape = (2, blocks, BS, HEADS, DIM) if layout == "per_layer" else (blocks, 2, BS, HEADS, DIM)
    t = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    torch.cuda.synchronize()
    tier = open_tier(d, t, layout)
    assert tier.staged and tier.memory_device == "cuda:0", tier
    src, dst = [0, 1, 2, 3], [15, 9, 8, 4]
    want = [layer_of(t, layout, src, l).clone() for l in range(LAYERS)]
    keys = [bytes([layout == "per_layer", i]) * 16 for i in range(4)]
    assert tier.wait(tier.submit_store(keys, src)).ok
    for x in t:
        x.zero_()
    torch.cuda.synchronize()
    assert tier.lookup_and_pin(keys) == 4
    job = tier.submit_load(keys, dst)
    got = []
    s = torch.cuda.current_stream()
    for layer in range(LAYERS):
        # The stream waits on the GPU for the layer's copy (False: the
        # layer is in memory already, so small a load may be done first).
        if not (stream_wait and tier.stream_wait_layer(job, layer, s.cuda_stream)):
            tier.wait_layer(job, layer)
        # Queued after the wait: reads the layer only once it is in HBM.
        got.append(layer_of(t, layout, dst, layer).clone())
    r = tier.wait(job)
    assert r.ok, r
    tier.unpin(keys)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(got[layer], want[layer]), f"layer {layer} differs ({layout})"
    tier.close()


def test_gpu_round_trip_host_waits(tmp_path):
    need_gpu()
    round_trip(tmp_path / "a", "per_layer", stream_wait=False)
    round_trip(tmp_path / "b", "block_major", stream_wait=False)


def test_gpu_stream_waits_per_layer(tmp_path):
    need_gpu()
    round_trip(tmp_path / "a", "per_layer", stream_wait=True)
    round_trip(tmp_path / "b", "block_major", stream_wait=True)


def test_gpu_default_stream_waits_through_a_long_chunked_load(tmp_path):
    """torch's legacy default stream waits per layer while kvtier's copies
    of later chunks are still to be queued (8 layers x 16 chunks through 2
    staging buffers): the prefill shape that hung on an H200 when the wait
    was a stream memory wait queued ahead of the copies. Bytes compared;
    a hang fails the test (the process is ended) instead of blocking CI."""
    need_gpu()
    import faulthandler
    layers, blocks, heads, dim = 8, 256, 8, 128
    t = [torch.randn(2, blocks, BS, heads, dim, device="cuda").to(torch.bfloat16)
         for _ in range(layers)]
    torch.cuda.synchronize()
    tier = (kvtier.TierBuilder().directory(str(tmp_path / "pool")).capacity("1g")
            .geometry(layers=layers, kv_heads=heads, head_dim=dim, dtype="bfloat16",
                      block_size=BS, name="stream-wait-test")
            .engine("uring").staging(layer_buffers=2, load_blocks=16, store_blocks=16)
            .kv_memory(t, layout="per_layer").build())
    src = list(range(blocks // 2))
    dst = [blocks - 1 - i for i in range(blocks // 2)]
    want = [x[:, src].clone() for x in t]
    keys = [b"sw%06d" % i for i in range(len(src))]
    assert tier.wait(tier.submit_store(keys, src)).ok
    for x in t:
        x.zero_()
    torch.cuda.synchronize()
    faulthandler.dump_traceback_later(120, exit=True)  # a deadlock ends the run
    try:
        assert tier.lookup_and_pin(keys) == len(keys)
        job = tier.submit_load(keys, dst)
        s = torch.cuda.current_stream()
        got, queued = [], 0
        for layer in range(layers):
            if tier.stream_wait_layer(job, layer, s.cuda_stream):
                queued += 1
            else:
                tier.wait_layer(job, layer)
            got.append(t[layer][:, dst].clone())
        torch.cuda.synchronize()
        r = tier.wait(job)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert r.ok, r
    tier.unpin(keys)
    for layer in range(layers):
        assert torch.equal(got[layer], want[layer]), f"layer {layer} differs"
    print(f"{queued} of {layers} layers waited for on the GPU")
    tier.close()


def test_gpu_stream_wait_for_a_layer_not_loaded_is_refused(tmp_path):
    need_gpu()
    t = [torch.zeros(2, 4, BS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
         for _ in range(LAYERS)]
    tier = open_tier(tmp_path, t, "per_layer")
    assert tier.wait(tier.submit_store([1], [0])).ok
    assert tier.lookup_and_pin([1]) == 1
    job = tier.submit_load([1], [2], layers=range(1, 2))
    # A stream waiting for a layer the load does not have would never run:
    # refused, whether or not the load has finished meanwhile.
    try:
        tier.stream_wait_layer(job, 0, torch.cuda.current_stream().cuda_stream)
        raise AssertionError("a stream wait for a layer the load lacks was queued")
    except kvtier.UsageError as e:
        assert "not a load of layer 0" in str(e), e
    tier.wait(job)
    tier.unpin([1])
    # The CPU's copies never touch device memory.
    try:
        tier.read_block(0)
        raise AssertionError("read_block on CUDA memory was not refused")
    except kvtier.UsageError as e:
        assert "cuda:0" in str(e)
    tier.close()


def test_gpu_double_refuses_cuda_tensors(tmp_path):
    need_gpu()
    t = [torch.zeros(2, 4, BS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
         for _ in range(LAYERS)]
    b = (kvtier.TierBuilder().directory(str(tmp_path)).capacity("16m").model(TINY, block_size=BS)
         .engine("uring").test_only_staged_host_double().kv_memory(t))
    try:
        b.build()
        raise AssertionError("the host double took CUDA tensors")
    except kvtier.UsageError as e:
        assert "CPU tensors posing" in str(e)


if __name__ == "__main__":
    import pathlib

    pytest = None  # run as a script: skips are this runner's, not pytest's

    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_gpu")]
    failed = 0
    for name, f in tests:
        with tempfile.TemporaryDirectory() as d:
            try:
                f(pathlib.Path(d))
                print(f"PASS {name}")
            except Skip as e:
                print(f"SKIP {name}: {e}")
            except Exception as e:  # report every test, then fail the run
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed or skipped, {failed} failed")
    sys.exit(1 if failed else 0)
