"""kvtier as an LMCache L2 tier: the ``native_plugin`` client.

LMCache (multi-process mode) loads it from its ``--l2-adapter`` JSON::

    {"type": "native_plugin", "module_path": "kvtier.lmcache",
     "class_name": "KvtierL2", "max_capacity_gb": 64,
     "adapter_params": {"path": "/data/kvtier", "capacity": "64g",
                        "model": "llama3-8b", "chunk_size": 256}}

and wraps it in its ``NativeConnectorL2Adapter``, which calls
``submit_batch_set/get/exists`` with serialized object keys and memoryviews
over L1 objects, polls :meth:`KvtierL2.event_fd` and collects results with
:meth:`KvtierL2.drain_completions`.

Why a staging cache: LMCache's L1 objects are neither 4096-byte aligned nor
registered ahead, and their sizes vary (a partial last chunk). kvtier does
direct I/O only into memory it registered at open, so each object is copied
into (or out of) one block of a kvtier-allocated, page-aligned staging cache.
A block holds one LMCache chunk: ``chunk_size`` tokens of every layer's K
and V of the model, the size of LMCache's full chunk in its KV_2LTD format.

Why hashed keys: LMCache's keys (``model@rank@group@hash[@salt]``) can be
longer than the 32 bytes a kvtier key holds; their SHA-256 is the key, so
equal keys in any process map to the same block (no per-process seed).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

from . import BackpressureError, KvtierError, TierBuilder, TierHandle
from ._kvtier import _exit_grace, _exiting

__all__ = ["KvtierL2"]

# (future_id, ok, error, per-key results or None), as NativeConnectorL2Adapter reads them.
Completion = tuple[int, bool, str, list[bool] | None]


def _key(s: str | bytes) -> bytes:
    if isinstance(s, str):
        s = s.encode()
    return hashlib.sha256(s).digest()


class KvtierL2:
    """LMCache native_plugin L2 client over a kvtier pool.

    Parameters (``adapter_params``):
      path: pool directory (files ``kvtier-<i>.pool``), or ``files``: a list.
      capacity: pool size to create when it does not exist ("64g" or bytes).
      model: preset name or config.json; ``chunk_size``: LMCache's chunk
        tokens (kvtier's block size); ``dtype``: the KV dtype if not the
        model's.
      devices: pool files in ``path`` (default 1).
      staging_blocks: chunks the staging cache holds (default 64); each of
        ``workers`` (default 2) threads owns an equal share.
      engine: "auto" (default) or a kvtier engine name.
    """

    def __init__(
        self,
        model: str,
        chunk_size: int = 256,
        path: str | None = None,
        files: Sequence[str] | None = None,
        capacity: int | str | None = None,
        dtype: str | None = None,
        devices: int = 1,
        staging_blocks: int = 64,
        workers: int = 2,
        engine: str = "auto",
        namespace: str | None = None,
    ) -> None:
        if (path is None) == (files is None):
            raise ValueError(
                "KvtierL2 needs exactly one of adapter_params.path (a pool directory) "
                "or adapter_params.files (pool files)"
            )
        if workers < 1 or staging_blocks < workers:
            raise ValueError(
                f"staging_blocks ({staging_blocks}) must be at least workers ({workers}) >= 1"
            )
        b = TierBuilder()
        b = b.directory(path, devices) if path is not None else b.files(list(files or []))
        if capacity is not None:
            b.capacity(capacity)
        b.model(model, block_size=chunk_size, dtype=dtype).engine(engine)
        # Naive: an L2 store is already off LMCache's critical path, and
        # nothing else here issues loads that writes could slow.
        b.policy("naive").host_cache(staging_blocks, "cross_layer")
        if namespace is not None:
            b.namespace(namespace)
        self.tier: TierHandle = b.build()
        self.block_bytes = self.tier.block_bytes
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._next = 1
        self._ops: queue.Queue[Any] = queue.Queue()
        per = staging_blocks // workers
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(list(range(w * per, (w + 1) * per)),),
                name=f"kvtier-l2-{w}",
                daemon=True,
            )
            for w in range(workers)
        ]
        self._closed = False
        for t in self._threads:
            t.start()

    # -- the native_plugin contract ------------------------------------

    def event_fd(self) -> int:
        """Readable while completions wait in drain_completions()."""
        return self._efd

    def submit_batch_set(self, keys: Sequence[str], memviews: Sequence[memoryview]) -> int:
        return self._submit("set", keys, memviews)

    def submit_batch_get(self, keys: Sequence[str], memviews: Sequence[memoryview]) -> int:
        return self._submit("get", keys, memviews)

    def submit_batch_exists(self, keys: Sequence[str]) -> int:
        # Answered at once: a kvtier lookup is an index read, never I/O.
        self._refuse_if_closed()
        found = [self.tier.contains(_key(k)) for k in keys]
        with self._lock:
            self._refuse_if_closed()
            fid = self._next
            self._next += 1
            self._done.append((fid, True, "", found))
            os.eventfd_write(self._efd, 1)
        return fid

    def drain_completions(self) -> list[Completion]:
        """Completions since the last call. After close() it returns what
        was left and never touches the event fd (closed, its number free
        for reuse by any file)."""
        with self._lock:
            done, self._done = self._done, []
            if not self._closed:
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
        return done

    def close(self) -> None:
        """Finish queued operations, then issue the write backlog and close the pool."""
        with self._lock:
            if self._closed:
                return
            # Under the lock: a submit either queued its operation before the
            # workers' stop marks (and it completes) or sees the tier closed.
            self._closed = True
            for _ in self._threads:
                self._ops.put(None)
        # Called from an exit handler: kvtier parks threads coming back from
        # its calls once the interpreter exits (rather than let CPython end
        # them mid-call); while this waits for its workers they may finish.
        grace = _exiting()
        if grace:
            _exit_grace(True)
        try:
            for t in self._threads:
                t.join()
        finally:
            if grace:
                _exit_grace(False)
            try:
                self.tier.close()
            finally:
                with self._lock:
                    os.close(self._efd)
                    self._efd = -1

    def usage(self) -> dict[str, Any]:
        return self.tier.usage()

    # -- internals -------------------------------------------------------

    def _complete(self, fid: int, ok: bool, error: str, results: list[bool] | None) -> None:
        with self._lock:
            self._done.append((fid, ok, error, results))
            os.eventfd_write(self._efd, 1)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("KvtierL2 is closed: open a new one to submit more")

    def _submit(self, op: str, keys: Sequence[str], memviews: Sequence[memoryview]) -> int:
        self._refuse_if_closed()
        if len(keys) != len(memviews):
            raise ValueError(
                f"{len(keys)} keys but {len(memviews)} buffers: give one buffer per key"
            )
        for i, mv in enumerate(memviews):
            n = memoryview(mv).nbytes
            if n > self.block_bytes:
                # Refused here, not failed later: the configuration is wrong.
                raise ValueError(
                    f"object {i} has {n} bytes, more than a kvtier block of {self.block_bytes}: "
                    "adapter_params.chunk_size and model must match LMCache's chunk_size and model"
                )
        with self._lock:
            self._refuse_if_closed()
            fid = self._next
            self._next += 1
            self._ops.put((op, fid, list(keys), list(memviews)))
        return fid

    def _worker(self, staging: list[int]) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            op, fid, keys, views = item
            try:
                if op == "set":
                    results = self._set(staging, keys, views)
                else:
                    results = self._get(staging, keys, views)
                self._complete(fid, all(results), "", results)
            except KvtierError as e:
                self._complete(fid, False, f"{type(e).__name__}: {e}", [False] * len(keys))
            except Exception as e:  # reported, never lost: LMCache waits on this id
                self._complete(fid, False, f"{type(e).__name__}: {e}", [False] * len(keys))

    def _set(self, staging: list[int], keys: list[str], views: list[memoryview]) -> list[bool]:
        out: list[bool] = []
        for s in range(0, len(keys), len(staging)):
            ks = [_key(k) for k in keys[s : s + len(staging)]]
            blocks = staging[: len(ks)]
            for b, v in zip(blocks, views[s : s + len(ks)]):
                self.tier.write_block(b, v)
            while True:
                try:
                    job = self.tier.submit_store(ks, blocks)
                    break
                except BackpressureError:
                    # The backlog drains on the I/O thread; LMCache's store
                    # controller already bounds what it has in flight.
                    threading.Event().wait(0.001)
            r = self.tier.wait(job)
            out += [o in ("done", "already_stored") for o in r.outcomes]
        return out

    def _get(self, staging: list[int], keys: list[str], views: list[memoryview]) -> list[bool]:
        out: list[bool] = []
        for s in range(0, len(keys), len(staging)):
            ks = [_key(k) for k in keys[s : s + len(staging)]]
            vs = views[s : s + len(ks)]
            # Pin each key found, so no store evicts it before it is read.
            hit = [self.tier.lookup_and_pin([k]) == 1 for k in ks]
            idx = [i for i, h in enumerate(hit) if h]
            res = [False] * len(ks)
            if idx:
                blocks = staging[: len(idx)]
                try:
                    r = self.tier.wait(self.tier.submit_load([ks[i] for i in idx], blocks))
                    for j, (i, b) in enumerate(zip(idx, blocks)):
                        # Only a verified load is served: "corrupt" (bytes that
                        # failed their checksum) and "failed" are misses.
                        if r.outcomes[j] == "done":
                            self.tier.read_block_into(b, vs[i])
                            res[i] = True
                finally:
                    self.tier.unpin([ks[i] for i in idx])
            out += res
        return out
