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


# -- issue 27: the README's server, deletes, what operators see, small chunks

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
SERVER_SCRIPT = REPO / "python" / "examples" / "lmcache-server.sh"


class _Lines(__import__("logging").Handler):
    """Collects kvtier.lmcache's log lines (LMCache's logger does not
    propagate, so pytest's caplog cannot see them)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def kvtier_log():
    import logging

    h = _Lines()
    lg = logging.getLogger("kvtier.lmcache")
    lg.addHandler(h)
    try:
        yield h.lines
    finally:
        lg.removeHandler(h)


def native_adapter(tmp_path, tiny_model, n_objs, **extra):
    """LMCache's own NativeConnectorL2Adapter over KvtierL2, from the JSON,
    and an L1 buffer of n_objs chunks for its objects."""
    cfg = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[l2_json(tmp_path, tiny_model, **extra)])
    )
    l1 = torch.zeros(n_objs * (CHUNK_BYTES // 2), dtype=torch.bfloat16)
    desc = L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel() * 2, align_bytes=2)
    return create_l2_adapter(cfg.adapters[0], l1_memory_desc=desc), l1


def chunk_objs(l1, n, first=0):
    e = CHUNK_BYTES // 2
    return [memobj(l1[(first + i) * e : (first + i + 1) * e]) for i in range(n)]


def tiny_keys(tag, n):
    return [ObjectKey(chunk_hash=bytes([tag, i]) * 8, model_name="tiny", kv_rank=0) for i in range(n)]


def store_through(adapter, keys, objs):
    t = adapter.submit_store_task(keys, objs)
    wait_fd(adapter.get_store_event_fd())
    assert adapter.pop_completed_store_tasks()[t].is_successful()


def load_through(adapter, keys, objs):
    t = adapter.submit_load_task(keys, objs)
    wait_fd(adapter.get_load_event_fd())
    bm = adapter.query_load_result(t)
    return [bm.test(i) for i in range(len(keys))]


def test_lmcache_delete_takes_chunks_out_of_kvtier_and_both_sides_agree(tmp_path, tiny_model):
    adapter, l1 = native_adapter(tmp_path, tiny_model, 8)
    try:
        client = adapter._client
        keys = tiny_keys(9, 4)
        objs = chunk_objs(l1, 4)
        for o in objs:
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
        store_through(adapter, keys, objs)
        assert adapter.get_usage().total_bytes_used == 4 * CHUNK_BYTES
        # LMCache's eviction path: NativeConnectorL2Adapter.delete calls
        # submit_batch_delete and waits for it.
        adapter.delete(keys[:3])
        assert adapter.get_usage().total_bytes_used == CHUNK_BYTES, "LMCache's accounting"
        assert client.tier.usage()["tier"]["live_blocks"] == 1, "kvtier's pool"
        assert client.stats()["deleted"] == 3
        # Deleted chunks are misses; the kept one still loads byte-equal.
        dst = chunk_objs(l1, 4, first=4)
        assert load_through(adapter, keys, dst) == [False, False, False, True]
        assert torch.equal(dst[3].tensor, objs[3].tensor)
        assert client.stats()["missed"] == 3
        # Deleting what is not held is answered, not an error.
        adapter.delete(keys[:1])
        assert client.stats()["deleted"] == 3
    finally:
        adapter.close()


def test_lmcache_l2_eviction_deletes_from_kvtier_so_the_pool_holds_what_lmcache_counts(
    tmp_path, tiny_model
):
    # LMCache's StorageManager with max_capacity_gb of 4 chunks: its L2
    # eviction controller deletes the oldest chunks; kvtier must let go of
    # exactly those, so its pool holds what LMCache's accounting says.
    cap_gb = 4 * CHUNK_BYTES / 2**30
    config = parse_args(
        [
            "--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU",
            "--l2-adapter",
            json.dumps(
                {
                    **json.loads(l2_json(tmp_path, tiny_model)),
                    "max_capacity_gb": cap_gb,
                    "eviction": {"eviction_policy": "LRU"},  # as the README's command
                }
            ),
        ]
    )
    sm = StorageManager(config)
    try:
        layout = MemoryLayoutDesc(shapes=[CHUNK_SHAPE], dtypes=[torch.bfloat16])
        adapter = sm.l2_adapters()[0][1]
        while not hasattr(adapter, "_client"):
            adapter = getattr(adapter, "_adapter", None) or adapter._inner
        client = adapter._client
        keys = tiny_keys(11, 10)
        for k in keys:
            objs = sm.reserve_write([k], layout)
            objs[k].tensor.copy_(torch.randn(objs[k].tensor.shape).to(torch.bfloat16))
            sm.finish_write([k])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = client.tier.usage()["tier"]["live_blocks"]
            counted = adapter.get_usage().total_bytes_used // CHUNK_BYTES
            if client.stats()["deleted"] > 0 and held == counted and counted <= 4:
                break
            time.sleep(0.1)
        else:
            pytest.fail(
                f"kvtier holds {held} chunks, LMCache counts {counted}, "
                f"deleted {client.stats()['deleted']}"
            )
        assert client.stats()["evicted"] == 0, "kvtier never had to evict on its own"
        assert [client.tier.contains(hashlib_key(k)) for k in keys].count(True) == held
    finally:
        sm.close()


def hashlib_key(k):
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )

    from kvtier.lmcache import _key

    return _key(_object_key_to_string(k))


def test_a_corrupt_chunk_is_a_logged_counted_miss_never_wrong_bytes(
    tmp_path, tiny_model, kvtier_log
):
    adapter, l1 = native_adapter(tmp_path, tiny_model, 6)
    keys = tiny_keys(13, 3)
    objs = chunk_objs(l1, 3)
    for o in objs:
        o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
    want = [bytes(o.byte_array) for o in objs]
    try:
        store_through(adapter, keys, objs)
    finally:
        adapter.close()
    # Flip one bit of chunk 1's first object on the device.
    pool = tmp_path / "pool" / "kvtier-0.pool"
    raw = pool.read_bytes()
    off = raw.find(want[1][:4096])
    assert off > 0
    with open(pool, "r+b") as f:
        f.seek(off + 99)
        f.write(bytes([raw[off + 99] ^ 0x04]))
        os_fsync(f)
    adapter, l1 = native_adapter(tmp_path, tiny_model, 6)
    try:
        client = adapter._client
        dst = chunk_objs(l1, 3, first=3)
        assert load_through(adapter, keys, dst) == [True, False, True]
        assert bytes(dst[0].byte_array) == want[0] and bytes(dst[2].byte_array) == want[2]
        s = client.stats()
        assert (s["corrupt"], s["loaded_chunks"]) == (1, 2), s
        said = [m for m in kvtier_log if "failed its checksum" in m]
        assert len(said) == 1 and "served as a miss" in said[0], kvtier_log
        # Dropped from the pool: not found again.
        assert not client.tier.contains(hashlib_key(keys[1]))
    finally:
        adapter.close()
    closing = [m for m in kvtier_log if "(closed)" in m]
    assert closing and "corrupt 1" in closing[-1] and "loaded 2" in closing[-1], kvtier_log


def os_fsync(f):
    import os

    f.flush()
    os.fsync(f.fileno())


def test_a_chunk_much_smaller_than_a_block_is_warned_with_its_waste(tmp_path, tiny_model, kvtier_log):
    from kvtier.lmcache import KvtierL2

    l2 = KvtierL2(model=tiny_model, chunk_size=CHUNK, path=str(tmp_path / "p"), capacity="16m")
    try:
        quarter = memoryview(bytearray(CHUNK_BYTES // 4))
        full = memoryview(bytearray(CHUNK_BYTES))
        l2.submit_batch_set(["full", "q1", "q2"], [full, quarter, quarter])
        warned = [m for m in kvtier_log if "takes a whole kvtier block" in m]
        assert len(warned) == 1, kvtier_log  # once per size
        assert f"{CHUNK_BYTES // 4} bytes" in warned[0] and "75% of it wasted" in warned[0]
        assert "chunk_size" in warned[0]
        assert l2.stats()["wasted_bytes"] == 2 * (CHUNK_BYTES - CHUNK_BYTES // 4)
    finally:
        l2.close()
    assert l2.stats()["stored_chunks"] == 3


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_server_command_restores_evicted_chunks_byte_equal_through_kvtier(
    tmp_path, tiny_model
):
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    # The README shows exactly the command this script runs.
    script = SERVER_SCRIPT.read_text()
    command = script[script.index("exec lmcache server") :].strip()
    readme = (REPO / "README.md").read_text()
    assert command.removeprefix("exec ") in readme, "README's LMCache command drifted from the script"

    rpc, http = _free_port(), _free_port()
    env = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        L1_GB="0.004",  # 16 chunks of the tiny model at chunk 256 (256 KiB each)
        L2_GB="0.01",
        POOL=str(tmp_path / "pool"),
        CAPACITY="24m",  # one 64-block group of 256 KiB chunks, and room
        MODEL=tiny_model,
        CHUNK="256",
        LMCACHE_DISABLE_BANNER="1",
    )
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["sh", str(SERVER_SCRIPT), "--port", str(rpc), "--http-port", str(http)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while "Application startup complete" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        cfg = BenchConfig(
            rpc_url=f"tcp://localhost:{rpc}", http_url=f"http://127.0.0.1:{http}", mode="cpu",
            transfer_mode="lmcache_driven", tp_size=1, use_mla=False, num_tokens=1024,
            # the tiny llama: K/V, 1024 paged blocks of 16 tokens, 2 heads of 64, 2 layers
            kvcache_shape_spec="(2,1024,16,2,64):bfloat16:2", num_blocks=1024, block_size=16,
        )
        client = ServerBenchClient(cfg, log=lambda m: None)
        client.start()
        try:
            reqs = [client.create_request(i, f"r{i}", "cold") for i in range(8)]
            kv = list(client._workers[0].kv_caches.values())
            first = reqs[0]
            want = [t.narrow(1, first.block_offset, first.num_blocks).clone() for t in kv]
            # 8 requests of 4 chunks through a 16-chunk L1: the first ones
            # are evicted from L1 once LMCache has written them to kvtier.
            for r in reqs:
                assert client.store(r, 0, r.num_full_tokens).succeeded
            time.sleep(2)
            client.zero_destination(first, 0, first.num_full_tokens)
            assert client.lookup(first).is_full_hit
            assert client.retrieve(first, 0, first.num_full_tokens).succeeded
            got = [t.narrow(1, first.block_offset, first.num_blocks) for t in kv]
            assert all(torch.equal(a, b) for a, b in zip(want, got)), "restored bytes differ"
            # kvtier's counters in LMCache's metrics (/metrics of the server).
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics").read().decode()
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("kvtier_l2_")
            }
            assert values.get("kvtier_l2_loaded_chunks_total", 0) >= 1, values  # came from kvtier
            assert values.get("kvtier_l2_stored_chunks_total", 0) >= 4, values
            assert values.get("kvtier_l2_corrupt_chunks_total") == 0, values
        finally:
            client.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text()
    # kvtier's counters in LMCache's log: the start line and the closing one.
    assert "kvtier L2 on " in text and "(closed): stored " in text, text[-4000:]
    closing = text[text.index("(closed): stored ") :].split("\n")[0]
    assert "loaded 0 " not in closing and "corrupt 0" in closing, closing


def test_the_smallest_llama3_8b_pool_at_chunk_256_is_the_readmes(tmp_path):
    import kvtier
    from kvtier.lmcache import KvtierL2

    smallest = 269_516_800  # README: one group of 8 blocks of 32 MiB, and the superblock area
    assert f"{smallest:,}" in (REPO / "README.md").read_text()
    with pytest.raises(kvtier.UsageError, match=f"capacity\\({smallest}\\)"):
        KvtierL2(model="llama3-8b", path=str(tmp_path / "small"), capacity=smallest - 4096,
                 staging_blocks=1)
    l2 = KvtierL2(model="llama3-8b", path=str(tmp_path / "ok"), capacity=smallest, staging_blocks=1)
    try:
        assert l2.tier.usage()["tier"]["total_blocks"] == 8
    finally:
        l2.close()


def test_batches_larger_than_staging_go_in_parts_and_every_chunk_lands_in_its_own_buffer(
    tmp_path, tiny_model
):
    # 20 chunks through 4 staging blocks, one chunk a job: stores and loads
    # are split into parts that wait for staging; each result must still
    # belong to its own key and buffer.
    n = 20
    adapter, l1 = native_adapter(
        tmp_path, tiny_model, 2 * n, staging_blocks=4, store_job_mb=0.01, load_job_mb=0.01,
        load_inflight_mb=0.04,  # 2 chunks of 16 KiB
    )
    try:
        client = adapter._client
        assert (client.store_job_blocks, client.load_job_blocks, client.load_inflight_blocks) == (1, 1, 2)
        keys = tiny_keys(17, n)
        src = chunk_objs(l1, n)
        for o in src:
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
        store_through(adapter, keys[: n - 1], src[: n - 1])  # the last one is never stored
        dst = chunk_objs(l1, n, first=n)
        got = load_through(adapter, keys[::-1], dst[::-1])
        assert got == [False] + [True] * (n - 1)
        for i in range(n - 1):
            assert torch.equal(dst[i].tensor, src[i].tensor), f"chunk {i}"
        s = client.stats()
        assert (s["stored_chunks"], s["loaded_chunks"], s["missed"]) == (n - 1, n - 1, 1), s
    finally:
        adapter.close()


def test_a_chunk_whose_store_completed_survives_kill_9(tmp_path, tiny_model):
    # The README's durability contract: once the store's completion is
    # handed to LMCache, the chunk is on the device (data and header
    # flushed); SIGKILL right after loses none of them.
    import os
    import select as sel
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, select, sys, time
        from kvtier.lmcache import KvtierL2
        l2 = KvtierL2(model={tiny_model!r}, chunk_size={CHUNK}, path={str(tmp_path / 'p')!r},
                      capacity="16m", staging_blocks=4)
        fid = l2.submit_batch_set([f"k{{i}}" for i in range(6)],
                                  [memoryview(bytes([i]) * {CHUNK_BYTES}) for i in range(6)])
        while True:
            select.select([l2.event_fd()], [], [], 5)
            done = [c for c in l2.drain_completions() if c[0] == fid]
            if done:
                print("acked", done[0][1], flush=True)
                break
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert sel.select([p.stdout], [], [], 60)[0], "no completion in time"
        assert p.stdout.readline().strip() == "acked True"
        # A second LMCache server on the node, on the same path, while the
        # first holds it: refused, naming the holder and how servers share
        # a pool (the service), not only "stop that process".
        from kvtier import UsageError
        from kvtier.lmcache import KvtierL2

        with pytest.raises(UsageError, match=rf"pid {p.pid} .*`kvtier serve` "
                                             r"\(adapter_params.service"):
            KvtierL2(model=tiny_model, chunk_size=CHUNK, path=str(tmp_path / "p"),
                     staging_blocks=4)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    from kvtier.lmcache import KvtierL2

    l2 = KvtierL2(model=tiny_model, chunk_size=CHUNK, path=str(tmp_path / "p"), staging_blocks=4)
    try:
        out = [memoryview(bytearray(CHUNK_BYTES)) for _ in range(6)]
        fid = l2.submit_batch_get([f"k{i}" for i in range(6)], out)
        deadline = time.monotonic() + 30
        done = []
        while not done and time.monotonic() < deadline:
            done = [c for c in l2.drain_completions() if c[0] == fid]
            time.sleep(0.01)
        assert done and done[0][3] == [True] * 6, done
        assert all(bytes(o) == bytes([i]) * CHUNK_BYTES for i, o in enumerate(out))
    finally:
        l2.close()


def service_adapter(sock, tiny_model, n_objs, **params):
    """NativeConnectorL2Adapter over a KvtierL2 on a kvtier serve's socket."""
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps({
        "type": "native_plugin", "module_path": "kvtier.lmcache", "class_name": "KvtierL2",
        "max_capacity_gb": 0.0625,
        "adapter_params": {"service": str(sock), "model": tiny_model, "chunk_size": CHUNK,
                           "staging_blocks": 8, **params},
    })]))
    l1 = torch.zeros(n_objs * (CHUNK_BYTES // 2), dtype=torch.bfloat16)
    desc = L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel() * 2, align_bytes=2)
    return create_l2_adapter(cfg.adapters[0], l1_memory_desc=desc), l1


def test_two_lmcache_l2_clients_share_one_kvtier_service(tmp_path, tiny_model, kvtier_service):
    from kvtier.lmcache import KvtierL2

    sock, _ = kvtier_service(clients=4, client_blocks=8)
    a, l1a = service_adapter(sock, tiny_model, 6)
    b, l1b = service_adapter(sock, tiny_model, 6)
    try:
        keys = tiny_keys(7, 6)
        src = chunk_objs(l1a, 6)
        for o in src:
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
        # More chunks than one job's staging: stored in parts.
        store_through(a, keys, src)
        assert b._client.tier.usage()["tier"]["live_blocks"] == 6, "one pool, seen by both"
        dst = chunk_objs(l1b, 6)
        assert load_through(b, keys, dst) == [True] * 6
        for s_, d in zip(src, dst):
            assert torch.equal(s_.tensor, d.tensor)
        # LMCache's delete through one client is a miss for the other.
        b.delete(keys[:2])
        assert load_through(a, keys[:3], chunk_objs(l1a, 3)) == [False, False, True]
    finally:
        a.close()
        b.close()
    # A config for another model (here: another chunk size) is refused, naming both.
    with pytest.raises(ValueError, match="serves"):
        KvtierL2(model=tiny_model, chunk_size=2 * CHUNK, service=str(sock))
    with pytest.raises(ValueError, match="exactly one of"):
        KvtierL2(model=tiny_model, chunk_size=CHUNK, service=str(sock), path=str(tmp_path / "p"))


def test_lmcache_l2_over_a_service_that_restarts_misses_then_reconnects(tmp_path, tiny_model,
                                                                       restartable_service):
    """`kvtier serve` restarts (an upgrade) under a running LMCache: its
    gets miss while the service is away, never an error out of LMCache's
    thread, and once it is back the adapter connects again and finds the
    chunks stored before the restart, bytes equal."""
    import signal

    sock, start = restartable_service

    def serve(log):
        return start(log, ["--model", tiny_model, "--block-size", str(CHUNK),
                           "--clients", "2", "--client-blocks", "8"])

    proc = serve(tmp_path / "serve1.log")
    a, l1 = service_adapter(sock, tiny_model, 9, service_reconnect_s=0.2)
    try:
        keys = tiny_keys(11, 3)
        src = chunk_objs(l1, 3)
        for o in src:
            o.tensor.copy_(torch.randn(o.tensor.shape).to(torch.bfloat16))
        store_through(a, keys, src)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert load_through(a, keys, chunk_objs(l1, 3, first=3)) == [False] * 3
        proc = serve(tmp_path / "serve2.log")
        dst = chunk_objs(l1, 3, first=6)
        deadline = time.monotonic() + 10
        while (got := load_through(a, keys, dst)) != [True] * 3:
            assert time.monotonic() < deadline, f"no reconnect within 10 s: {got}"
            time.sleep(0.1)
        for s_, d in zip(src, dst):
            assert torch.equal(s_.tensor, d.tensor)
    finally:
        a.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


# Models other than the tiny llama, as LMCache chunks them (KV_2LTD: layers
# x K,V x chunk tokens x heads*dim; MLA's KV_MLA_FMT: layers x chunk tokens x
# 576 latent): config.json as Hugging Face writes it, chunk sizes LMCache
# users pick. (transformers config, layers, chunk, chunk bytes per token and
# layer.)
def _configs():
    import transformers as T

    return {
        "gqa8x128-bf16-3layers-chunk64": (
            T.LlamaConfig(num_hidden_layers=3, hidden_size=256, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16"),
            64, 2 * 8 * 128 * 2),
        "mha32x64-fp16-1layer-chunk32": (
            T.LlamaConfig(num_hidden_layers=1, hidden_size=2048, num_attention_heads=32,
                          num_key_value_heads=32, torch_dtype="float16"),
            32, 2 * 32 * 64 * 2),
        "gemma-gqa4x256-fp32-chunk16": (
            T.GemmaConfig(num_hidden_layers=2, hidden_size=512, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=256, torch_dtype="float32"),
            16, 2 * 4 * 256 * 4),
        "mla-deepseek-v2-lite-chunk256": (
            T.DeepseekV2Config(num_hidden_layers=2, hidden_size=512, num_attention_heads=4,
                               num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                               qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64,
                               torch_dtype="bfloat16"),
            256, 576 * 2),
        # MLA at LMCache's small chunks: an 18432 B layer chunk in a padded block.
        "mla-deepseek-v3-61layers-chunk16": (
            T.DeepseekV3Config(num_hidden_layers=61, hidden_size=256, num_attention_heads=4,
                               num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=96,
                               qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64,
                               torch_dtype="bfloat16"),
            16, 576 * 2),
    }


SHAPES = ["gqa8x128-bf16-3layers-chunk64", "mha32x64-fp16-1layer-chunk32",
          "gemma-gqa4x256-fp32-chunk16", "mla-deepseek-v2-lite-chunk256",
          "mla-deepseek-v3-61layers-chunk16"]


@pytest.mark.parametrize("shape", SHAPES)
def test_other_models_round_trip_full_and_partial_chunks(tmp_path, shape):
    pytest.importorskip("transformers")
    config, chunk, per_token_layer = _configs()[shape]
    model_dir = tmp_path / "model"
    config.save_pretrained(model_dir)
    chunk_bytes = config.num_hidden_layers * chunk * per_token_layer
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps({
        "type": "native_plugin", "module_path": "kvtier.lmcache", "class_name": "KvtierL2",
        "max_capacity_gb": 0.25,
        "adapter_params": {"path": str(tmp_path / "pool"), "capacity": "96m",
                           "model": str(model_dir / "config.json"), "chunk_size": chunk,
                           "staging_blocks": 4}})]))
    n = 5
    l1 = torch.zeros(2 * n * chunk_bytes, dtype=torch.uint8)
    desc = L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel(), align_bytes=1)
    adapter = create_l2_adapter(cfg.adapters[0], l1_memory_desc=desc)
    try:
        # A kvtier block holds one chunk: exactly, or (MLA at 16 tokens,
        # 18432 B per layer) in a padded block of whole 8 KiB pages.
        block = adapter._client.block_bytes
        assert block == chunk_bytes or (
            block > chunk_bytes and block == config.num_hidden_layers * 24576), (block, chunk_bytes)
        keys = [ObjectKey(chunk_hash=bytes([i, 7]) * 8, model_name=shape, kv_rank=0)
                for i in range(n)]
        # The last object is a prompt's partial chunk: a third of the tokens.
        sizes = [chunk_bytes] * (n - 1) + [chunk_bytes // chunk * (chunk // 3)]
        src = [memobj(l1[i * chunk_bytes: i * chunk_bytes + sizes[i]]) for i in range(n)]
        gen = torch.Generator().manual_seed(len(shape))
        for o in src:
            o.tensor.copy_(torch.randint(0, 256, o.tensor.shape, dtype=torch.uint8, generator=gen))
        t = adapter.submit_store_task(keys, src)
        wait_fd(adapter.get_store_event_fd())
        assert adapter.pop_completed_store_tasks()[t].is_successful()
        t = adapter.submit_lookup_and_lock_task(keys, {})
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        assert adapter.query_lookup_and_lock_result(t).popcount() == n
        base = n * chunk_bytes
        dst = [memobj(l1[base + i * chunk_bytes: base + i * chunk_bytes + sizes[i]])
               for i in range(n)]
        t = adapter.submit_load_task(keys, dst)
        wait_fd(adapter.get_load_event_fd())
        assert adapter.query_load_result(t).popcount() == n
        for s, d in zip(src, dst):
            assert torch.equal(s.tensor, d.tensor)
        adapter.submit_unlock(keys)
    finally:
        adapter.close()


@pytest.mark.parametrize("params,match", [
    # JSON written by hand: quoted numbers and bools failed deep inside
    # ("'<' not supported between 'str' and 'int'", "argument 'enabled'")
    # or, for a bool, would read "false" as true.
    ({"chunk_size": "16"}, r"adapter_params.chunk_size is '16'"),
    ({"chunk_size": 0}, r"adapter_params.chunk_size is 0"),
    # A chunk whose K of one layer is not whole 4 KiB sectors (tiny llama:
    # 8 tokens x 2 heads x 64 x 2 B = 2 KiB): the fix named in LMCache's words.
    ({"chunk_size": 8}, r"adapter_params.chunk_size 8 \(LMCache's --chunk-size.*multiple of 16"),
    ({"staging_blocks": "4"}, r"adapter_params.staging_blocks is '4'"),
    ({"prewrite": "false"}, r"adapter_params.prewrite is 'false': give true or false"),
    ({"group_blocks": 8.5}, r"adapter_params.group_blocks is 8.5"),
    ({"store_job_mb": "128"}, r"adapter_params.store_job_mb is '128': give a number"),
])
def test_adapter_params_of_the_wrong_type_are_named(tmp_path, tiny_model, params, match):
    p = json.loads(l2_json(tmp_path, tiny_model))
    p["adapter_params"].update(params)
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(p)]))
    l1 = torch.zeros(1 << 20, dtype=torch.uint8)
    desc = L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel(), align_bytes=1)
    with pytest.raises(ValueError, match=match):
        create_l2_adapter(cfg.adapters[0], l1_memory_desc=desc)
    assert not (tmp_path / "pool").exists()  # refused before any pool was made
