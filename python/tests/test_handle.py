"""The kvtier module against a real pool on files (io_uring engine)."""

import os
import select
import threading

import pytest

import kvtier

LAYERS = 2
OBJ = 16 * 2 * 64 * 2  # block_size x kv_heads x head_dim x bf16
BLOCK = 2 * LAYERS * OBJ


def open_tier(tmp_path, model, blocks=8, **kw):
    b = (
        kvtier.TierBuilder()
        .directory(tmp_path / "pool")
        .capacity("16m")
        .model(model, block_size=16)
        .engine("auto")
    )
    for k, v in kw.items():
        getattr(b, k)(v)
    return b.host_cache(blocks).build()


def test_round_trip_layer_by_layer(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    assert tier.engine == "uring"
    assert tier.block_bytes == BLOCK
    data = [os.urandom(BLOCK) for _ in range(4)]
    keys = [bytes([i]) * 32 for i in range(4)]
    for b, d in enumerate(data):
        tier.write_block(b, d)
    assert tier.lookup(keys) == 0
    r = tier.wait(tier.submit_store(keys, [0, 1, 2, 3]))
    assert r.ok and r.kind == "store" and r.outcomes == ["done"] * 4
    assert r.keys == keys
    # Stored again: no I/O, reported as such.
    assert tier.wait(tier.submit_store(keys[:1], [0])).outcomes == ["already_stored"]

    assert tier.lookup(keys + [b"\xff" * 32]) == 4
    n = tier.lookup_and_pin(keys)
    assert n == 4 and tier.usage()["tier"]["pinned_blocks"] == 4
    job = tier.submit_load(keys, [7, 6, 5, 4])
    for layer in range(LAYERS):
        tier.wait_layer(job, layer)
    r = tier.wait(job)
    assert r.ok and r.kind == "load"
    tier.unpin(keys)
    assert tier.usage()["tier"]["pinned_blocks"] == 0
    for b, d in zip([7, 6, 5, 4], data):
        assert tier.read_block(b) == d
    tier.close()


def test_restart_keeps_every_stored_prefix(tmp_path, tiny_model):
    keys = [i * 7919 for i in range(1, 7)]
    with open_tier(tmp_path, tiny_model) as tier:
        for b in range(6):
            tier.write_block(b, bytes([b + 1]) * BLOCK)
        assert tier.wait(tier.submit_store(keys, range(6))).ok
    # A fresh handle on the same files (the pool is opened, not formatted).
    tier = open_tier(tmp_path, tiny_model, create="never")
    assert tier.lookup(keys) == 6
    r = tier.wait(tier.submit_load(keys[2:4], [0, 1]))
    assert r.ok
    assert tier.read_block(0) == bytes([3]) * BLOCK
    assert tier.read_block(1) == bytes([4]) * BLOCK
    tier.close()


def test_one_layer_range_and_eventfd(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    tier.write_block(0, b"\x5a" * BLOCK)
    tier.wait(tier.submit_store([b"k"], [0]))
    tier.drain_completions()
    fd = tier.event_fd()
    assert select.select([fd], [], [], 0)[0] == []
    job = tier.submit_load([b"k"], [3], layers=range(1, 2))
    assert select.select([fd], [], [], 10)[0] == [fd]
    events = []
    while not any(e.kind == "finished" and e.job == job for e in events):
        select.select([fd], [], [], 10)
        events += tier.drain_completions()
    layers = [e.layer for e in events if e.kind == "layer" and e.job == job]
    assert layers == [1]
    assert all(e.ok for e in events)
    assert tier.try_result(job).ok
    got = tier.read_block(3)
    # Only layer 1's K and V came back; layer 0 of block 3 is still zero.
    assert got[: 2 * OBJ] == bytes(2 * OBJ)
    assert got[2 * OBJ :] == b"\x5a" * (2 * OBJ)
    tier.close()


def test_wait_releases_the_gil(tmp_path, tiny_model):
    # Under the sync policy a store waits for flush_stores: a thread blocked
    # in wait() must let this thread run to call it.
    tier = open_tier(tmp_path, tiny_model, policy="sync")
    tier.write_block(0, b"\x01" * BLOCK)
    job = tier.submit_store([b"g"], [0])
    out = []
    t = threading.Thread(target=lambda: out.append(tier.wait(job)))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the store finished before flush_stores"
    tier.flush_stores()
    t.join(10)
    assert not t.is_alive() and out[0].ok
    tier.close()


def aligned_layers(torch, blocks, dtype):
    """Per-layer (2, blocks, 16, 2, 64) tensors at 4096-byte-aligned addresses."""
    n = 2 * blocks * OBJ
    out, keep = [], []
    for _ in range(LAYERS):
        raw = torch.zeros(n + 4096, dtype=torch.uint8)
        off = (-raw.data_ptr()) % 4096
        t = raw[off : off + n].view(dtype).view(2, blocks, 16, 2, 64)
        out.append(t)
        keep.append(raw)
    return out


def test_torch_tensors_registered_in_place(tmp_path, tiny_model):
    torch = pytest.importorskip("torch")
    layers = aligned_layers(torch, 4, torch.bfloat16)
    for t in layers:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    want = [t.clone() for t in layers]
    tier = (
        kvtier.TierBuilder()
        .directory(tmp_path / "pool")
        .capacity("16m")
        .model(tiny_model)
        .kv_memory(layers)
        .build()
    )
    assert tier.memory_blocks == 4
    assert tier.wait(tier.submit_store([1, 2], [0, 1])).ok
    for t in layers:
        t.zero_()
    job = tier.submit_load([1, 2], [2, 3])
    tier.wait_layer(job, 0)
    tier.wait_layer(job, 1)
    assert tier.wait(job).ok
    for t, w in zip(layers, want):
        assert torch.equal(t[:, 2:4], w[:, 0:2])
        assert not t[:, 0:2].any()
    tier.close()


def test_bad_input_raises_clear_errors(tmp_path, tiny_model):
    with pytest.raises(kvtier.UsageError, match="no model"):
        kvtier.TierBuilder().directory(tmp_path).host_cache(1).build()
    with pytest.raises(kvtier.UsageError, match="capacity"):
        kvtier.TierBuilder().directory(tmp_path / "p").model(tiny_model).host_cache(1).build()
    with pytest.raises(kvtier.UsageError, match="engine"):
        kvtier.TierBuilder().engine("warp")
    with pytest.raises(kvtier.UsageError, match="model config"):
        kvtier.TierBuilder().directory(tmp_path / "p").capacity("1g").model("no-such-model").host_cache(1).build()
    torch = pytest.importorskip("torch")
    layers = aligned_layers(torch, 4, torch.bfloat16)
    with pytest.raises(kvtier.UsageError, match="2 layers"):
        kvtier.TierBuilder().directory(tmp_path / "p").capacity("16m").model(tiny_model).kv_memory(layers[:1]).build()
    raw = torch.zeros(2 * 4 * OBJ + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096 + 64
    bad = [raw[off : off + 2 * 4 * OBJ - 4096], layers[1]]
    with pytest.raises(kvtier.UsageError, match="same size|aligned"):
        kvtier.TierBuilder().directory(tmp_path / "p").capacity("16m").model(tiny_model).kv_memory(bad).build()
    # Two separate layers, each 64 bytes past a 4096 boundary whatever address the allocator gave.
    n = 2 * 4 * OBJ
    far = torch.zeros(2 * n + 3 * 4096, dtype=torch.uint8)
    start = (-far.data_ptr()) % 4096 + 64
    second = start + n + 4096
    mis = [far[start : start + n], far[second : second + n]]
    assert all(t.data_ptr() % 4096 == 64 for t in mis)
    with pytest.raises(kvtier.UsageError, match="not aligned to 4096"):
        kvtier.TierBuilder().directory(tmp_path / "p2").capacity("16m").model(tiny_model).kv_memory(mis).build()

    tier = open_tier(tmp_path, tiny_model, blocks=2)
    with pytest.raises(TypeError, match="key 1"):
        tier.lookup([b"a", 1.5])
    with pytest.raises(TypeError, match="list of keys"):
        tier.lookup(b"abc")
    with pytest.raises(kvtier.UsageError, match="1 to 32 bytes"):
        tier.lookup([b"x" * 33])
    with pytest.raises(kvtier.UsageError, match="out of range"):
        tier.submit_store([b"a"], [2])
    with pytest.raises(kvtier.UsageError, match="one memory block per key"):
        tier.submit_store([b"a", b"b"], [0])
    with pytest.raises(kvtier.UsageError) as e:
        tier.submit_load([b"never stored"], [0])
    assert e.value.kind == "usage"
    with pytest.raises(kvtier.UsageError, match="range"):
        tier.submit_load([b"a"], [0], layers=range(0, 5))
    with pytest.raises(kvtier.UsageError, match="do not fit"):
        tier.write_block(0, bytes(BLOCK + 1))
    tier.close()
    with pytest.raises(kvtier.ClosedError):
        tier.submit_store([b"a"], [0])
    assert tier.lookup([b"a"]) == 0


def test_a_first_build_killed_before_its_superblock_builds_again(tmp_path, tiny_model):
    """create("auto") over the files a SIGKILLed first build left: allocated,
    all zero, no superblock yet. The next start must create the pool there,
    not refuse the files as "not a kvtier pool" forever."""
    d = tmp_path / "pool"
    d.mkdir()
    with open(d / "kvtier-0.pool", "wb") as f:
        f.truncate(16 << 20)
    tier = open_tier(tmp_path, tiny_model)
    data = os.urandom(BLOCK)
    tier.write_block(0, data)
    key = b"\x07" * 32
    assert tier.wait(tier.submit_store([key], [0])).ok
    tier.close()
    # Files that hold data but no pool are still refused: nothing is lost.
    with open(d / "kvtier-0.pool", "r+b") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(kvtier.KvtierError, match="kvtier-0.pool"):
        open_tier(tmp_path, tiny_model)


def test_sigkill_during_a_first_build_never_blocks_the_next(tmp_path, tiny_model):
    """SIGKILL a process in its first build (create("auto") with prewrite, so
    the files exist for a while before their superblock): a new build on the
    same directory always works, and finds an empty pool."""
    import subprocess
    import sys
    import time

    script = f"""
import kvtier, sys
t = (kvtier.TierBuilder().directory({str(tmp_path / "pool")!r}).capacity("256m")
     .model({tiny_model!r}, block_size=16).engine("auto").prewrite(True)
     .host_cache(4).build())
print("BUILT", flush=True)
t.close()
"""
    for delay in (0.05, 0.2, 0.4, 0.8):
        for f in (tmp_path / "pool").glob("*"):
            f.unlink()
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        time.sleep(delay)
        p.kill()
        p.wait()
        tier = (
            kvtier.TierBuilder()
            .directory(tmp_path / "pool")
            .capacity("256m")
            .model(tiny_model, block_size=16)
            .engine("auto")
            .host_cache(4)
            .build()
        )
        assert tier.lookup([b"\x01" * 32]) == 0
        tier.close()


def test_a_pool_whose_files_disagree_says_how_to_recover(tmp_path, tiny_model):
    """Two pool files, one with its superblock and one without (a create
    killed between its superblock writes): "auto" neither formats over the
    one that holds a pool nor calls the other "not a kvtier pool"; the error
    names the file and create("always")."""
    b = lambda: (  # noqa: E731
        kvtier.TierBuilder()
        .directory(tmp_path / "pool", devices=2)
        .capacity("16m")
        .model(tiny_model, block_size=16)
        .engine("auto")
        .host_cache(4)
    )
    b().build().close()
    with open(tmp_path / "pool" / "kvtier-1.pool", "r+b") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(kvtier.KvtierError, match=r"kvtier-1.pool.*create\(\"always\"\)"):
        b().build()
    t = b().create("always").build()
    t.close()
    b().build().close()
    # The mark that create leaves until its superblock lands, with the id of
    # the pool file 0 holds: killed between the two. "auto" creates anew.
    with open(tmp_path / "pool" / "kvtier-0.pool", "rb") as f:
        uuid = f.read(32)[16:32]
    with open(tmp_path / "pool" / "kvtier-1.pool", "r+b") as f:
        f.write(b"KVTIERFM" + uuid + b"\0" * (4096 - 24))
    b().build().close()
    # A mark of some other create beside a finished pool is no licence.
    with open(tmp_path / "pool" / "kvtier-1.pool", "r+b") as f:
        f.write(b"KVTIERFM" + b"\x5a" * 16 + b"\0" * (4096 - 24))
    with pytest.raises(kvtier.KvtierError, match=r"kvtier-0.pool"):
        b().build()


def test_a_pool_directory_of_several_files_reopens_without_naming_them(tmp_path, tiny_model):
    """directory(path) without devices= opens the pool there with as many
    files as it was made with (before, it always meant one file and
    refused a pool made over two: "2 device(s) but 1 were named")."""
    d = tmp_path / "pool"

    def builder(**kw):
        return (kvtier.TierBuilder().directory(d, **kw).capacity("16m")
                .model(tiny_model, block_size=16))

    keys = [bytes([i]) * 32 for i in range(4)]
    data = [os.urandom(BLOCK) for _ in range(4)]
    with builder(devices=2).host_cache(4).build() as t:
        for b, x in enumerate(data):
            t.write_block(b, x)
        assert t.wait(t.submit_store(keys, [0, 1, 2, 3])).ok
    assert sorted(p.name for p in d.iterdir()) == ["kvtier-0.pool", "kvtier-1.pool"]
    with builder().host_cache(4).build() as t:
        assert t.lookup(keys) == 4
        assert t.wait(t.submit_load(keys, [3, 2, 1, 0])).ok
        assert [t.read_block(b) for b in (3, 2, 1, 0)] == data
    with pytest.raises(kvtier.UsageError, match="devices"):
        kvtier.TierBuilder().directory(d, devices=0)
