"""kvtier as LMCache's L2 tier, built and driven by LMCache 0.5.6's own classes."""

import argparse
import json
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args  # noqa: E402
from lmcache.v1.distributed.internal_api import L1MemoryDesc  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.memory_management import (  # noqa: E402
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

CHUNK = 16
# tiny llama: 2 layers x K,V x 16 tokens x 128 (2 heads x 64) bf16
CHUNK_SHAPE = torch.Size([2, 2, CHUNK, 128])
CHUNK_BYTES = 2 * 2 * CHUNK * 128 * 2


def l2_json(tmp_path, tiny_model, **extra):
    return json.dumps(
        {
            "type": "native_plugin",
            "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2",
            "max_capacity_gb": 0.0625,
            "adapter_params": {
                "path": str(tmp_path / "pool"),
                "capacity": "32m",
                "model": tiny_model,
                "chunk_size": CHUNK,
                "staging_blocks": 8,
                **extra,
            },
        }
    )


def wait_fd(fd, timeout=20.0):
    import select

    assert select.select([fd], [], [], timeout)[0] == [fd], "no completion in time"
    try:
        import os

        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def memobj(t):
    t = t.view(-1)
    md = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=t.data_ptr(),
        phy_size=t.numel() * t.element_size(),
        fmt=MemoryFormat.KV_2LTD,
        ref_count=1,
    )
    return TensorMemoryObj(t, md, parent_allocator=None)


def test_adapter_from_l2_adapter_json_round_trip(tmp_path, tiny_model):
    cfg = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[l2_json(tmp_path, tiny_model)])
    )
    n = 6
    elems = CHUNK_BYTES // 2
    l1 = torch.zeros(2 * n * elems, dtype=torch.bfloat16)
    desc = L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel() * 2, align_bytes=2)
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=desc)
    try:
        assert type(adapter).__name__ == "NativeConnectorL2Adapter"
        keys = [
            ObjectKey(chunk_hash=bytes([i]) * 16, model_name="tiny", kv_rank=0)
            for i in range(n)
        ]
        # The last object is half a chunk (LMCache's unfull last chunk).
        src = [memobj(l1[i * elems : (i + 1) * elems]) for i in range(n - 1)]
        src.append(memobj(l1[(n - 1) * elems : (n - 1) * elems + elems // 2]))
        for o in src:
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))

        t = adapter.submit_lookup_and_lock_task(keys, {})
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        assert adapter.query_lookup_and_lock_result(t).popcount() == 0
        adapter.submit_unlock(keys)

        t = adapter.submit_store_task(keys, src)
        wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[t].is_successful()

        t = adapter.submit_lookup_and_lock_task(keys, {})
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        assert adapter.query_lookup_and_lock_result(t).popcount() == n

        base = n * elems
        dst = [memobj(l1[base + i * elems : base + (i + 1) * elems]) for i in range(n - 1)]
        dst.append(memobj(l1[base + (n - 1) * elems : base + (n - 1) * elems + elems // 2]))
        t = adapter.submit_load_task(keys, dst)
        wait_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(t).popcount() == n
        for s, d in zip(src, dst):
            assert torch.equal(s.tensor, d.tensor)
        adapter.submit_unlock(keys)
    finally:
        adapter.close()


def test_storage_manager_store_evict_prefetch(tmp_path, tiny_model):
    # LMCache's own multi-process storage manager, configured as
    # `lmcache server` is, with kvtier as its only L2.
    config = parse_args(
        [
            "--l1-size-gb",
            "0.0625",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--l2-adapter",
            l2_json(tmp_path, tiny_model),
        ]
    )
    sm = StorageManager(config)
    try:
        layout = MemoryLayoutDesc(shapes=[CHUNK_SHAPE], dtypes=[torch.bfloat16])
        keys = [
            ObjectKey(chunk_hash=bytes([7, i]) * 8, model_name="tiny", kv_rank=0)
            for i in range(4)
        ]
        objs = sm.reserve_write(keys, layout)
        assert set(objs) == set(keys)
        want = {}
        for k, o in objs.items():
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
            want[k] = o.tensor.clone()
        sm.finish_write(keys)

        # The store controller writes L1 objects to L2 in the background.
        deadline = time.monotonic() + 30
        adapter = sm.l2_adapters()[0][1]
        # Through LMCache's wrappers (serde, reconfiguration) to kvtier's client.
        while not hasattr(adapter, "_client"):
            adapter = getattr(adapter, "_adapter", None) or adapter._inner
        tier = adapter._client.tier
        while time.monotonic() < deadline:
            if tier.usage()["tier"]["live_blocks"] == len(keys):
                break
            time.sleep(0.05)
        else:
            pytest.fail("LMCache's store controller did not put every chunk into kvtier")

        sm.delete_l1_keys(keys)
        spec = PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]
        )
        h = sm.submit_prefetch_task(spec)
        assert sm.wait_prefetch_status(h, 30)
        r = sm.query_prefetch_status(h)
        assert r.l2_hit_cells[0].popcount() == len(keys), "prefetch did not come from L2"
        with sm.read_prefetched_results(keys) as got:
            assert got is not None
            for k, o in zip(keys, got):
                assert torch.equal(o.tensor.view(CHUNK_SHAPE), want[k])
        sm.finish_read_prefetched(keys)
    finally:
        sm.close()


def test_kvtier_l2_after_close_never_touches_its_old_event_fd(tmp_path, tiny_model):
    import os

    from kvtier.lmcache import KvtierL2

    l2 = KvtierL2(model=tiny_model, chunk_size=CHUNK, path=str(tmp_path / "p"),
                  capacity="16m", staging_blocks=4)
    fid = l2.submit_batch_exists(["k"])
    efd = l2.event_fd()
    l2.close()
    l2.close()  # twice is fine
    # The fd number is free again: a file that gets it must be left alone.
    victim = open(tmp_path / "victim", "w+b", buffering=0)
    try:
        for submit in (lambda: l2.submit_batch_exists(["k"]),
                       lambda: l2.submit_batch_set(["k"], [memoryview(bytearray(8))]),
                       lambda: l2.submit_batch_get(["k"], [memoryview(bytearray(8))])):
            with pytest.raises(RuntimeError, match="closed"):
                submit()
        # What completed before close is still handed over, once.
        assert [c[0] for c in l2.drain_completions()] == [fid]
        assert l2.drain_completions() == []
        if victim.fileno() == efd:
            assert os.pread(victim.fileno(), 64, 0) == b""
    finally:
        victim.close()


def test_kvtier_l2_closed_by_an_early_atexit_handler_finishes_and_keeps_its_stores(tmp_path, tiny_model):
    # An atexit handler registered before kvtier was imported runs after
    # kvtier's own hook: close() must neither hang on a worker kvtier parked
    # nor lose the store that worker submitted.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import atexit, threading
        holder = []
        atexit.register(lambda: (holder[0].close(), print("closed", flush=True)))
        from kvtier.lmcache import KvtierL2
        l2 = KvtierL2(model={tiny_model!r}, chunk_size={CHUNK}, path={str(tmp_path / 'p')!r},
                      capacity="16m", staging_blocks=4)
        holder.append(l2)
        l2.submit_batch_set(["k"], [memoryview(bytearray(b"\\x07" * {CHUNK_BYTES}))])
        print("main returns", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert "main returns" in r.stdout and "closed" in r.stdout, r.stdout
    from kvtier.lmcache import KvtierL2

    l2 = KvtierL2(model=tiny_model, chunk_size=CHUNK, path=str(tmp_path / "p"), staging_blocks=4)
    try:
        fid = l2.submit_batch_exists(["k"])
        (done,) = [c for c in l2.drain_completions() if c[0] == fid]
        assert done[3] == [True], done
    finally:
        l2.close()
