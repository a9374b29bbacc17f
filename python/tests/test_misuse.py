"""The kvtier module used wrongly, as a careless user or an attacker would.

Every misuse must end in a Python exception that names the thing and the
fix: never a crash, a hang, a panic, a signal taken over or memory without
bound; and no load may return bytes that differ from what was stored.
Checks that could hang or kill the process when they regress run in a
child interpreter with a time (and memory) limit.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import kvtier

OBJ = 16 * 2 * 64 * 2  # block_size x kv_heads x head_dim x bf16
BLOCK = 2 * 2 * OBJ  # 2 layers, K and V


def open_tier(path, model, blocks=8, **kw):
    b = kvtier.TierBuilder().directory(path / "pool").capacity("16m").model(model, block_size=16)
    for k, v in kw.items():
        getattr(b, k)(v)
    return b.host_cache(blocks).build()


def run_child(tmp_path, model, body, timeout=60, memory_gib=None, policy="slack"):
    """Runs `body` in a fresh interpreter importing this kvtier, with
    `open_tier()` opening a pool in tmp_path (and `tier` one, unless the
    body opens it itself); returns (exit code, output)."""
    pre = f"""
import os, sys, signal, time, threading
# A Python started from a terminal: Ctrl-C raises KeyboardInterrupt (a test
# runner started in the background hands its children SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
import kvtier
if {memory_gib!r}:
    import resource
    lim = {memory_gib!r} << 30
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
def open_tier():
    return (kvtier.TierBuilder().directory({str(tmp_path / "pool")!r}).capacity("16m")
            .policy({policy!r}).model({model!r}, block_size=16).host_cache(8).build())
if "tier = open_tier()" not in {body!r}:
    tier = open_tier()
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        p = subprocess.run(
            [sys.executable, "-c", pre + textwrap.dedent(body)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s: {e.stdout!r} {e.stderr!r}")
    return p.returncode, p.stdout + p.stderr


def test_signals_stay_with_python(tmp_path, tiny_model):
    # Opening a tier must not take over the process's signals: Ctrl-C is
    # still KeyboardInterrupt, and a server's own SIGTERM handler still runs.
    rc, out = run_child(
        tmp_path,
        tiny_model,
        """
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        tier = open_tier()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
            print("no KeyboardInterrupt")
        except KeyboardInterrupt:
            print("KeyboardInterrupt")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("SIGTERM handled", got == [signal.SIGTERM])
        tier.close()
        """,
    )
    assert rc == 0, out
    assert "KeyboardInterrupt" in out and "no KeyboardInterrupt" not in out, out
    assert "SIGTERM handled True" in out, out


def test_a_blocked_wait_lets_signals_through(tmp_path, tiny_model):
    # Under "sync" a store goes at flush_stores() (another thread may call
    # it): a wait() for it blocks until then. Ctrl-C, or any signal handler,
    # must still run meanwhile and end the wait; the job stays collectable.
    rc, out = run_child(
        tmp_path,
        tiny_model,
        """
        tier.write_block(0, b"\\1" * 100)
        job = tier.submit_store([b"k"], [0])
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            tier.wait(job)
            print("waited")
        except KeyboardInterrupt:
            print("interrupted", time.monotonic() - t0 < 5)
        class Alarm(Exception):
            pass
        def on_alarm(s, f):
            raise Alarm()
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            tier.wait(job)
        except Alarm:
            print("alarm ran")
        tier.flush_stores()
        print("after flush", tier.wait(job).ok)
        tier.close()
        """,
        timeout=30,
        policy="sync",
    )
    assert rc == 0, out
    assert "interrupted True" in out and "alarm ran" in out and "after flush True" in out, out


def test_forked_child_is_refused_and_parent_unaffected(tmp_path, tiny_model):
    rc, out = run_child(
        tmp_path,
        tiny_model,
        """
        data = os.urandom(%d)
        tier.write_block(0, data)
        assert tier.wait(tier.submit_store([b"a"], [0])).ok
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            for name, f in [("lookup", lambda: tier.lookup([b"a"])),
                            ("load", lambda: tier.submit_load([b"a"], [1])),
                            ("read_block", lambda: tier.read_block(0)),
                            ("wait", lambda: tier.wait(1)),
                            ("close", lambda: tier.close())]:
                try:
                    f()
                    print("child", name, "ran")
                except kvtier.UsageError as e:
                    print("child", name, "refused", "fork" in str(e))
            del tier
            sys.stdout.flush()
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        print("child exit", st)
        r = tier.wait(tier.submit_load([b"a"], [2]))
        print("parent load", r.ok, tier.read_block(2) == data)
        tier.close()
        """
        % BLOCK,
    )
    assert rc == 0, out
    for name in ("lookup", "load", "read_block", "wait", "close"):
        assert f"child {name} refused True" in out, out
    assert "child exit 0" in out and "parent load True True" in out, out


def test_endless_or_huge_key_lists_are_refused(tmp_path, tiny_model):
    # Memory-limited child: an unbounded list would die of MemoryError.
    rc, out = run_child(
        tmp_path,
        tiny_model,
        """
        import itertools
        for name, f in [("count", lambda: tier.lookup(itertools.count())),
                        ("range", lambda: tier.lookup(range(2**40))),
                        ("blocks", lambda: tier.submit_store([1], range(2**40)))]:
            try:
                f()
                print(name, "accepted")
            except kvtier.UsageError as e:
                print(name, "refused", "split" in str(e))
        """,
        memory_gib=3,
    )
    assert rc == 0, out
    for name in ("count", "range", "blocks"):
        assert f"{name} refused True" in out, out


def test_store_larger_than_the_backlog_is_a_usage_error(tmp_path, tiny_model):
    # Backpressure means "retry later"; a store that can never fit must not
    # say so, or a retrying caller (LMCache's adapter does) spins forever.
    tier = open_tier(tmp_path, tiny_model, backlog_limit_blocks=4, policy="sync")
    with pytest.raises(kvtier.UsageError, match="split"):
        tier.submit_store([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    job = tier.submit_store([1, 2, 3], [0, 1, 2])
    with pytest.raises(kvtier.BackpressureError):
        tier.submit_store([7, 8], [3, 4])  # this one only has to wait
    tier.flush_stores()
    assert tier.wait(job).ok
    tier.close()
    with pytest.raises(kvtier.UsageError, match="at least 1"):
        kvtier.TierBuilder().backlog_limit_blocks(0)


def test_lookalike_tensor_is_refused():
    # kv_memory believes a tensor's data_ptr(): an object that only looks
    # like one would have kvtier DMA into any address it names.
    class Fake:
        shape = (2, 8, 16, 2, 64)

        class device:
            type = "cpu"
            index = None

        def data_ptr(self):
            return 4096

        def is_contiguous(self):
            return True

        def numel(self):
            return 2 * 8 * 16 * 2 * 64

        def element_size(self):
            return 2

    with pytest.raises(TypeError, match="torch.Tensor"):
        kvtier.TierBuilder().kv_memory([Fake(), Fake()])


def test_rust_latency_arguments_are_checked(tmp_path, tiny_model):
    from kvtier._kvtier import rust_latency

    tier = open_tier(tmp_path, tiny_model)
    with pytest.raises(kvtier.UsageError, match="at least one key"):
        rust_latency(tier, "load", [], 3, 0)
    with pytest.raises(kvtier.UsageError, match="iters"):
        rust_latency(tier, "lookup", [1], 2**60, 0)
    with pytest.raises(kvtier.UsageError, match="unknown"):
        rust_latency(tier, "lod", [1], 3, 0)
    assert rust_latency(tier, "lookup", [1], 3, 0) > 0
    assert rust_latency(tier, "store", [], 3, 2**64 - 2) > 0  # keys wrap, no overflow
    tier.close()


def test_random_bytes_round_trip_and_corruption_is_reported(tmp_path, tiny_model):
    data = [os.urandom(BLOCK) for _ in range(6)]
    keys = [os.urandom(32) for _ in range(6)]
    with open_tier(tmp_path, tiny_model) as tier:
        for b, d in enumerate(data):
            tier.write_block(b, d)
        assert tier.wait(tier.submit_store(keys, range(6))).ok
        for b in range(8):
            tier.write_block(b, b"")  # cleared
        r = tier.wait(tier.submit_load(keys[::-1], range(6)))
        assert r.ok
        for b, d in enumerate(data[::-1]):
            assert tier.read_block(b) == d
    # Flip one bit of key 2's second-layer V on disk.
    pool = tmp_path / "pool" / "kvtier-0.pool"
    raw = pool.read_bytes()
    off = raw.find(data[2][3 * OBJ : 4 * OBJ])
    assert off > 0
    with open(pool, "r+b") as f:
        f.seek(off + 17)
        f.write(bytes([raw[off + 17] ^ 0x10]))
    tier = open_tier(tmp_path, tiny_model, create="never")
    tier.write_block(0, b"")
    job = tier.submit_load(keys[1:4], [3, 0, 4])
    tier.wait_layer(job, 0)
    with pytest.raises(kvtier.CorruptError):
        tier.wait_layer(job, 1)
    r = tier.wait(job)
    assert r.outcomes == ["done", "corrupt", "done"]
    assert isinstance(r.errors[1], kvtier.CorruptError)
    assert tier.read_block(3) == data[1] and tier.read_block(4) == data[3]
    tier.close()


def test_block_copies_from_and_into_the_kv_memory_itself(tmp_path, tiny_model):
    # write_block's data (read_block_into's out) may be a view of the KV
    # memory, overlapping the block's own objects: the copy must act as if
    # taken at the call, not abort or mix old and new bytes. In a child: the
    # overlapping copy this replaced aborted the process.
    rc, out = run_child(
        tmp_path,
        tiny_model,
        """
        import ctypes
        addr, n = tier.host_memory()
        mv = memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
        pattern = bytes(range(256)) * (%d // 256)
        tier.write_block(0, pattern)
        tier.write_block(1, pattern[::-1])
        for block, lo in ((0, 100), (1, %d - 300)):
            want = bytes(mv[lo : lo + %d - 500])
            tier.write_block(block, mv[lo : lo + %d - 500])
            print("write", block, tier.read_block(block)[: len(want)] == want)
        tier.write_block(1, pattern)
        want = tier.read_block(1)[:16000]
        tier.read_block_into(1, mv[%d + 50 : %d + 50 + 16000])
        print("read", bytes(mv[%d + 50 : %d + 50 + 16000]) == want)
        """
        % ((BLOCK,) * 8),
    )
    assert rc == 0, out
    assert "write 0 True" in out and "write 1 True" in out and "read True" in out, out


def test_builder_errors_name_the_python_call(tmp_path, tiny_model):
    # The pool's checks are shared with the CLI; from Python they must name
    # the TierBuilder call that fixes them, not a command-line flag.
    b = kvtier.TierBuilder().directory(tmp_path / "p").capacity(4096).model(tiny_model)
    with pytest.raises(kvtier.UsageError, match=r"give at least capacity\(\d+\)") as e:
        b.host_cache(4).build()
    assert "--" not in str(e.value)
    (tmp_path / "foreign").write_bytes(b"not a pool" * 1000)
    b = kvtier.TierBuilder().files([tmp_path / "foreign"]).capacity("16m").model(tiny_model)
    with pytest.raises(kvtier.UsageError, match=r'create\("always"\)') as e:
        b.host_cache(4).build()
    assert (tmp_path / "foreign").read_bytes() == b"not a pool" * 1000
    for bad in (-1, 2**70):
        with pytest.raises(kvtier.UsageError, match="out of range"):
            kvtier.TierBuilder().capacity(bad)


def test_registered_buffers_cannot_be_resized_and_ranges_are_checked(tmp_path, tiny_model):
    import mmap

    m = mmap.mmap(-1, 2 * 8 * 2 * OBJ)  # page aligned, 8 blocks per layer
    layers = [memoryview(m)[: 8 * 2 * OBJ], memoryview(m)[8 * 2 * OBJ :]]
    b = kvtier.TierBuilder().directory(tmp_path / "p").capacity("16m").model(tiny_model)
    tier = b.kv_memory(layers).build()
    del layers
    with pytest.raises(BufferError):
        m.close()  # the handle keeps the memory exported, so it stays mapped
    tier.write_block(0, b"\x07" * BLOCK)
    assert tier.wait(tier.submit_store([b"k"], [0])).ok
    with pytest.raises(kvtier.UsageError, match="layers"):
        tier.submit_load([b"k"], [1], layers=range(0, 2**70))
    with pytest.raises(kvtier.UsageError, match="layers"):
        tier.submit_load([b"k"], [1], layers=range(1, 0))
    assert tier.wait(tier.submit_load([b"k"], [1], layers=range(1, 2))).ok
    assert tier.read_block(1)[2 * OBJ :] == b"\x07" * (2 * OBJ)
    tier.close()


def test_bad_int_arguments_name_the_argument(tmp_path, tiny_model):
    # pyo3's own conversion error ("out of range integral type conversion
    # attempted") names nothing: every int argument's error says which.
    b = kvtier.TierBuilder()
    for call, name in [
        (lambda: b.directory(tmp_path, devices=-1), "devices"),
        (lambda: b.model(tiny_model, block_size=-16), "block_size"),
        (lambda: b.host_cache(-1), "blocks"),
        (lambda: b.tp_rank(2**40), "tp_rank"),
        (lambda: b.backlog_limit_blocks(-5), "backlog_limit_blocks"),
        (lambda: kvtier.resolve_model(tiny_model, block_size=2**33), "block_size"),
        (lambda: b.staging(layer_buffers=-1), "layer_buffers"),
        (lambda: b.staging(load_blocks=-1), "load_blocks"),
    ]:
        with pytest.raises(kvtier.UsageError, match=name):
            call()
    with pytest.raises(TypeError, match="block_size"):
        b.model(tiny_model, block_size=16.0)
    with pytest.raises(TypeError, match=r"files\(\[path\]\)"):
        b.files(str(tmp_path / "a.pool"))
    tier = open_tier(tmp_path, tiny_model)
    for call, name in [
        (lambda: tier.wait(-1), "job"),
        (lambda: tier.wait(2**64), "job"),
        (lambda: tier.wait_layer(1, -1), "layer"),
        (lambda: tier.try_result(-3), "job"),
        (lambda: tier.write_block(-1, b""), "block"),
        (lambda: tier.read_block(2**32), "block"),
    ]:
        with pytest.raises(kvtier.UsageError, match=name):
            call()
    with pytest.raises(TypeError, match="job"):
        tier.wait("1")
    tier.close()


def test_events_nobody_drains_stay_bounded(tmp_path, tiny_model):
    # The module subscribes to completion events at build; a caller that
    # only uses wait() never drains them. They must not pile up per job.
    tier = open_tier(tmp_path, tiny_model)
    tier.write_block(0, b"\x01" * BLOCK)
    assert tier.wait(tier.submit_store([1], [0])).ok
    kept = tier.submit_load([1], [7])  # not collected: its events stay
    tier.wait_layer(kept, 1)
    for i in range(2500):
        tier.wait(tier.submit_load([1], [1 + i % 6]))
    events = tier.drain_completions()
    assert len(events) <= 4096 + 64, len(events)
    assert [e.kind for e in events if e.job == kept] == ["layer", "layer", "finished"]
    assert tier.wait(kept).ok
    tier.close()


def test_overlapping_loads_and_writes_never_cost_a_stored_key(tmp_path, tiny_model):
    # A load checks the bytes that landed in its memory block against the
    # stored checksum. A second load (or a write_block) into the same block
    # meanwhile used to fail that check and drop a good key as corrupt.
    tier = open_tier(tmp_path, tiny_model, policy="sync")
    a, b = os.urandom(BLOCK), os.urandom(BLOCK)
    tier.write_block(0, a)
    tier.write_block(1, b)
    tier.flush_stores()
    job = tier.submit_store([1, 2], [0, 1])
    tier.flush_stores()
    assert tier.wait(job).ok
    refused = 0
    for _ in range(20):
        ja = tier.submit_load([1], [3])
        try:
            jb = tier.submit_load([2], [3])
        except kvtier.UsageError as e:
            assert "block 3" in str(e)
            refused += 1
        else:
            # Accepted only because the first (tiny) load had already finished:
            # both keys stay good and the block holds the second one's bytes.
            assert tier.wait(ja).ok and tier.wait(jb).ok
            assert tier.read_block(3) == b
            continue
        want = a
        try:
            tier.write_block(3, b)
            want = b  # accepted only once the load was done
        except kvtier.UsageError as e:
            assert "block 3" in str(e)
        assert tier.wait(ja).ok
        assert tier.read_block(3) == want
    assert refused > 0, "no second load was ever refused while the first was in flight"
    assert tier.lookup([1, 2]) == 2
    # Under a store (held by the sync policy): the block may be read, not written.
    tier.write_block(4, a)
    js = tier.submit_store([3], [4])
    with pytest.raises(kvtier.UsageError, match="block 4"):
        tier.write_block(4, b)
    assert tier.read_block(4) == a
    tier.flush_stores()
    assert tier.wait(js).ok
    tier.close()


def test_a_failed_build_can_be_retried_and_a_builder_serves_once(tmp_path, tiny_model):
    first = open_tier(tmp_path, tiny_model)
    b = kvtier.TierBuilder().directory(tmp_path / "pool").model(tiny_model).host_cache(4)
    with pytest.raises(kvtier.UsageError, match="open"):
        b.build()  # the pool is open in `first`
    first.close()
    del first
    tier = b.build()  # the same builder, once the pool is free
    assert tier.memory_blocks == 4
    with pytest.raises(kvtier.UsageError, match="no KV memory"):
        b.build()  # its memory belongs to `tier` now
    tier.close()


def test_tensor_subclasses_and_shadowed_methods_are_not_believed(tmp_path, tiny_model):
    torch = pytest.importorskip("torch")
    obj = 16 * 2 * 64 * 2
    n = 2 * 4 * obj
    raws = [torch.zeros(n + 4096, dtype=torch.uint8) for _ in range(2)]
    layers = []
    for raw in raws:
        off = (-raw.data_ptr()) % 4096
        layers.append(raw[off:off + n].view(torch.bfloat16).view(2, 4, 16, 2, 64))

    class Evil(torch.Tensor):
        def data_ptr(self):
            return 4096 * 1000

    def build(mem, d):
        return (kvtier.TierBuilder().directory(tmp_path / d).capacity("16m")
                .model(tiny_model).kv_memory(mem).build())

    with pytest.raises(TypeError, match="subclass of torch.Tensor"):
        build([layers[0].as_subclass(Evil), layers[1]], "a")
    # An attribute set on a plain tensor does not stand in for its method:
    # the tier registers (and uses) the real address.
    layers[0].data_ptr = lambda: 4096 * 1000
    tier = build(layers, "b")
    data = bytes(range(256)) * (2 * 2 * obj // 256)
    tier.write_block(1, data)
    assert tier.read_block(1) == data
    tier.close()
    del layers[0].data_ptr
    # Nor does a torch function mode that answers for tensors' methods.
    from torch.overrides import TorchFunctionMode

    class Lying(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.data_ptr, torch.Tensor.numel):
                return 4096 * 1000
            return func(*args, **(kwargs or {}))

    with Lying():
        assert torch.Tensor.data_ptr(layers[1]) == 4096 * 1000  # the mode is live
        tier = build(layers, "c")
    tier.write_block(2, data)
    assert tier.read_block(2) == data
    tier.close()


def test_read_only_memory_is_refused_at_registration(tmp_path, tiny_model):
    import mmap
    import warnings

    torch = pytest.importorskip("torch")
    per = 2 * 4 * 16 * 2 * 64 * 2
    m = mmap.mmap(-1, 2 * per, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ro = torch.frombuffer(m, dtype=torch.bfloat16)
    layers = [ro[: per // 2].view(2, 4, 16, 2, 64), ro[per // 2:].view(2, 4, 16, 2, 64)]
    with pytest.raises(kvtier.KvtierError, match="cannot receive loads"):
        (kvtier.TierBuilder().directory(tmp_path / "p").capacity("16m")
         .model(tiny_model).kv_memory(layers).build())


def test_exit_with_a_daemon_thread_waiting_is_clean(tmp_path, tiny_model):
    # CPython ends daemon threads at exit as they retake the GIL; a thread
    # inside a kvtier wait must not turn that into an abort (exit 134).
    script = textwrap.dedent(f"""
        import threading, time, kvtier
        t = (kvtier.TierBuilder().directory({str(tmp_path / 'p')!r}).capacity("16m")
             .model({tiny_model!r}).host_cache(2).policy("sync").build())
        t.write_block(0, b"x")
        job = t.submit_store([b"k"], [0])   # held until flush_stores()
        for _ in range(3):
            threading.Thread(target=t.wait, args=(job,), daemon=True).start()
        time.sleep(0.2)
        print("main returns", flush=True)
    """)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        assert "main returns" in r.stdout


def test_exit_while_threads_wait_to_retake_the_gil_is_clean(tmp_path, tiny_model):
    # The race behind the test above, made certain: threads that came back
    # from a kvtier call just before kvtier's exit hook ran are still
    # waiting for the GIL when CPython begins finalizing, and CPython ends
    # them as they take it (pthread_exit through PyO3's catch_unwind:
    # "FATAL: exception not rethrown", exit 134). An atexit callback that
    # runs before kvtier's (last in, first out) holds the GIL past several
    # 50 ms wait slices (a PyDLL call keeps it) while the waiting and the
    # churning threads end their calls (or wait in Python code run from one);
    # an object freed at finalization then releases the GIL to them.
    script = textwrap.dedent(f"""
        import atexit, ctypes, gc, threading, time, kvtier
        t = (kvtier.TierBuilder().directory({str(tmp_path / 'p')!r}).capacity("16m")
             .model({tiny_model!r}).host_cache(2).policy("sync").build())
        t.write_block(0, b"x")
        job = t.submit_store([b"k"], [0])   # held until flush_stores()
        started = threading.Barrier(3 + 3 + 1)
        def churn(call):
            started.wait()
            while True:
                call()
        for _ in range(3):
            threading.Thread(target=t.wait, args=(job,), daemon=True).start()
            threading.Thread(target=churn, args=(lambda: t.contains(b"k"),), daemon=True).start()
            # usage() runs Python code (json.loads), which hands the GIL over.
            threading.Thread(target=churn, args=(t.usage,), daemon=True).start()
        started.wait()
        atexit.register(ctypes.PyDLL(None).usleep, 300_000)
        class ReleasesTheGilWhileFinalizing:
            def __del__(self, sleep=time.sleep):
                sleep(0.05)
        gc.disable()
        c = ReleasesTheGilWhileFinalizing()
        c.cycle = c   # freed by the collection during finalization
        del c
        print("main returns", flush=True)
    """)
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        assert "main returns" in r.stdout


def test_a_child_forked_while_threads_churn_kvtier_calls_exits(tmp_path, tiny_model):
    # kvtier's exit hook waits for the threads counted as retaking the GIL;
    # a child forked while some were counted has none of them and must not
    # wait for them (it hung at exit).
    script = textwrap.dedent(f"""
        import os, threading, time, kvtier
        t = (kvtier.TierBuilder().directory({str(tmp_path / 'p')!r}).capacity("16m")
             .model({tiny_model!r}).host_cache(2).policy("sync").build())
        def churn():
            while True:
                t.contains(b"k")
        for _ in range(3):
            threading.Thread(target=churn, daemon=True).start()
        for i in range(5):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:
                raise SystemExit(0)   # a normal exit: kvtier's exit hook runs
            deadline = time.monotonic() + 20
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    raise SystemExit(f"child {{i}} did not exit")
                time.sleep(0.01)
        print("children exited", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert "children exited" in r.stdout


def test_a_damaged_superblock_names_the_python_fix(tmp_path, tiny_model):
    tier = open_tier(tmp_path, tiny_model)
    tier.close()
    (pool,) = [p for p in (tmp_path / "pool").iterdir() if p.suffix == ".pool"]
    # One damaged copy costs nothing (the pool opens from a backup) ...
    with open(pool, "r+b") as f:
        f.seek(105)
        b = f.read(1)
        f.seek(105)
        f.write(bytes([b[0] ^ 1]))
    open_tier(tmp_path, tiny_model, create="never").close()
    # ... every copy (at 0, 256 KiB and 768 KiB) damaged loses the pool.
    with open(pool, "r+b") as f:
        for at in (256 << 10, 768 << 10):
            f.seek(at + 105)
            b = f.read(1)
            f.seek(at + 105)
            f.write(bytes([b[0] ^ 1]))
    with pytest.raises(kvtier.CorruptError) as e:
        open_tier(tmp_path, tiny_model, create="never")
    msg = str(e.value)
    assert 'create("always")' in msg and "kvtier pool create" not in msg, msg
    assert "create create" not in msg and "--force" not in msg, msg


def test_sizes_and_cache_lengths_out_of_reach_are_named(tmp_path, tiny_model):
    b = lambda: kvtier.TierBuilder().directory(tmp_path / "p").model(tiny_model)
    with pytest.raises(TypeError, match="not a bool"):
        b().capacity(True)
    with pytest.raises(kvtier.UsageError, match="out of range"):
        b().capacity("99999999999999999999t")
    with pytest.raises(kvtier.UsageError, match=r"smallest pool .* give at least capacity"):
        b().capacity("1e3").host_cache(2).build()
    with pytest.raises(kvtier.UsageError, match="fewer blocks"):
        b().capacity("16m").host_cache(2**32 - 1).build()
    for bad in ("a\x00b", "a\nb"):
        with pytest.raises(kvtier.UsageError, match="control character"):
            b().capacity("16m").namespace(bad).host_cache(2).build()
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


def test_opaque_chunks_name_the_size_rule(tmp_path):
    b = kvtier.TierBuilder().directory(tmp_path / "p").capacity("16m")
    for bad in (0, 4096, 12288):
        with pytest.raises(kvtier.UsageError, match="multiple of 8192"):
            b.opaque_chunks(bad, name="chunks")
    with pytest.raises(kvtier.UsageError, match="printable"):
        b.opaque_chunks(8192, name="")
    t = b.opaque_chunks(3 * 8192, name="chunks").host_cache(4).build()
    assert t.block_bytes == 3 * 8192 and t.geometry["layers"] == 1
    t.close()
