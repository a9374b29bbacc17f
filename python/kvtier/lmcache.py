"""kvtier as an LMCache L2 tier: the ``native_plugin`` client.

LMCache (multi-process mode) loads it from its ``--l2-adapter`` JSON::

    {"type": "native_plugin", "module_path": "kvtier.lmcache",
     "class_name": "KvtierL2", "max_capacity_gb": 60,
     "eviction": {"eviction_policy": "LRU"},
     "adapter_params": {"path": "/data/kvtier", "capacity": "64g",
                        "model": "llama3-8b", "chunk_size": 256}}

(with ``"eviction"``, LMCache evicts by ``max_capacity_gb`` and deletes what it
evicts here; keep that below the pool's usable size, which the start line in
LMCache's log gives).

and wraps it in its ``NativeConnectorL2Adapter``, which calls
``submit_batch_set/get/exists/delete`` with serialized object keys and
memoryviews over L1 objects, polls :meth:`KvtierL2.event_fd` and collects
results with :meth:`KvtierL2.drain_completions`.

How a batch moves: one I/O thread takes each batch, copies its chunks into
a page-aligned staging cache (LMCache hands over memoryviews only, so its L1
cannot be registered with kvtier ahead of time) a few at a time, and submits
each group as one kvtier job as soon as it is copied, so the copy of the next
group runs while the previous one is written. Loads are submitted together
and each chunk is copied out as its job finishes. The thread waits on the
handle's completion eventfd (no thread blocks per job). A block holds one
LMCache chunk: ``chunk_size`` tokens of every layer's K and V of the model,
the size of LMCache's full chunk in its KV_2LTD format.

Why hashed keys: LMCache's keys (``model@rank@group@hash[@salt]``) can be
longer than the 32 bytes a kvtier key holds; their SHA-256 is the key, so
equal keys in any process map to the same block (no per-process seed).

Operators see what it does: its counters (:meth:`KvtierL2.stats`) go to
LMCache's log every ``log_interval_s`` and at close, and to LMCache's
OpenTelemetry metrics (``/metrics`` of ``lmcache server``) as
``kvtier_l2.*`` counters; a chunk that fails its checksum, a store that
fails and a chunk kvtier evicts on its own are logged as warnings.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from . import (
    BackpressureError,
    ClosedError,
    KvtierError,
    TierBuilder,
    TierHandle,
    UsageError,
    resolve_model,
)
from ._kvtier import _exit_grace, _exiting
from ._service import ServiceLink

__all__ = ["KvtierL2", "COUNTERS"]

# (future_id, ok, error, per-key results or None), as NativeConnectorL2Adapter reads them.
Completion = tuple[int, bool, str, list[bool] | None]

# What an operator can watch: KvtierL2.stats() keys, log fields and the
# ``kvtier_l2.<name>`` OpenTelemetry counters.
COUNTERS = {
    "stored_chunks": "chunks stored and durable",
    "stored_bytes": "bytes of LMCache chunks stored",
    "already_held": "stores of chunks the pool already held (no I/O)",
    "loaded_chunks": "chunks loaded into LMCache's L1, checksums verified",
    "loaded_bytes": "bytes of chunks loaded",
    "missed": "loads of chunks the pool does not hold",
    "corrupt": "chunks that failed their checksum: dropped from the pool, served as misses",
    "failed_loads": "loads that failed with an I/O error (served as misses)",
    "dropped": "chunks LMCache asked to store that were not stored (reported failed)",
    "evicted": "chunks kvtier evicted to make room (LMCache's max_capacity_gb is above the pool)",
    "deleted": "chunks LMCache's L2 eviction deleted",
    "wasted_bytes": "block bytes beyond the chunks' own (chunks smaller than a block)",
}

_DEFAULT_STAGING_BYTES = 512 << 20


def _logger() -> logging.Logger:
    # LMCache's own format and handler when it is there, so kvtier's lines
    # land in the server's log like its adapters' own.
    try:
        from lmcache.logging import init_logger

        return init_logger("kvtier.lmcache")
    except Exception:  # pragma: no cover - LMCache absent or changed
        return logging.getLogger("kvtier.lmcache")


logger = _logger()


def _key(s: str | bytes) -> bytes:
    if isinstance(s, str):
        s = s.encode()
    return hashlib.sha256(s).digest()


# -- OpenTelemetry: one observable counter per name for the process; each live
# KvtierL2 reports its own values tagged with its pool.
_live: "weakref.WeakSet[KvtierL2]" = weakref.WeakSet()
_otel_lock = threading.Lock()
_otel_done = False


def _register_otel() -> None:
    global _otel_done
    with _otel_lock:
        if _otel_done:
            return
        _otel_done = True
        try:
            from opentelemetry import metrics
            from opentelemetry.metrics import Observation
        except ImportError:
            return
        # LMCache's server sets its meter provider before it builds L2
        # adapters; before that (or without it) the API's proxy meter binds
        # these counters to whatever provider is set later.
        meter = metrics.get_meter("kvtier.lmcache")

        def reader(name: str):
            def observe(_options: Any) -> list[Any]:
                return [
                    Observation(l2.stats()[name], {"pool": l2.pool}) for l2 in list(_live)
                ]

            return observe

        for name, what in COUNTERS.items():
            meter.create_observable_counter(
                f"kvtier_l2.{name}",
                callbacks=[reader(name)],
                unit="By" if name.endswith("_bytes") else "chunks",
                description=what,
            )


class _Op:
    """One submit_batch_set/get: its keys, what is still to start, results."""

    __slots__ = ("fid", "kind", "names", "keys", "views", "results", "todo", "jobs", "error")

    def __init__(self, fid: int, kind: str, names: list[str], views: list[memoryview]):
        self.fid = fid
        self.kind = kind
        self.names = names
        self.keys = [_key(k) for k in names]
        self.views = views
        self.results: list[bool] = [False] * len(names)
        self.todo: collections.deque[int] | None = None  # indices still to submit
        self.jobs = 0  # kvtier jobs in flight
        self.error = ""


class KvtierL2:
    """LMCache native_plugin L2 client over a kvtier pool.

    Parameters (``adapter_params``):
      path: pool directory (files ``kvtier-<i>.pool``), or ``files``: a list.
      capacity: pool size to create when it does not exist ("64g" or bytes).
      model: preset name or config.json; ``chunk_size``: LMCache's chunk
        tokens (kvtier's block size); ``dtype``: the KV dtype if not the
        model's.
      devices: pool files in ``path`` (default 1).
      group_blocks: blocks per extent group of a pool created here. The
        smallest pool is one group per file; a layer of consecutive blocks
        is one device extent only within a group. Default: enough blocks
        that a group's run of one layer's K (or V) fills a 4 MiB I/O, 8 to
        64 (8 for llama3-8b at chunk 256: a 257 MiB pool at least).
      staging_blocks: chunks the page-aligned staging cache holds (default:
        512 MiB of chunks, 4 to 64); allocated at start.
      store_job_mb / load_job_mb: MiB of chunks per kvtier job (defaults 128
        and 32; at least one chunk): a batch is copied and submitted in
        groups this size, so copies overlap the I/O (stores: each job is
        flushed, so larger; loads: each chunk is copied out as its job ends).
      load_inflight_mb: MiB of load jobs in flight at once (default 64, at
        least one job): loads then finish one after another, each copied
        out while the next is read, rather than all together at the end.
      log_interval_s: seconds between counter lines in LMCache's log when
        they changed (default 60; 0: only at close).
      engine: "auto" (default) or a kvtier engine name; ``prewrite``: write a
        new pool's files once at creation (first stores at overwrite speed).
      workers: accepted and ignored (one I/O thread serves every batch now).
      service: the socket of a ``kvtier serve`` on this node, instead of
        ``path``/``files``: the pool is the service's, shared with every other
        client on the node (it must serve ``model`` at ``chunk_size``), and
        the staging is the memory the service shares with this process
        (``staging_blocks`` of it, at most the service's ``--client-blocks``;
        by default all of that).
        The pool options (capacity, devices, group_blocks, engine, prewrite,
        namespace) are the service's. A service that goes away (a restart,
        an upgrade) makes every operation a miss (gets) or a dropped store
        (sets) until this client connects again, which it tries once its
        jobs have drained, every ``service_reconnect_s`` seconds (default 5).
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
        group_blocks: int | None = None,
        staging_blocks: int | None = None,
        store_job_mb: float = 128,
        load_job_mb: float = 32,
        load_inflight_mb: float = 64,
        log_interval_s: float = 60.0,
        engine: str = "auto",
        prewrite: bool = False,
        namespace: str | None = None,
        workers: int | None = None,
        service: str | None = None,
        service_reconnect_s: float = 5.0,
    ) -> None:
        if [path, files, service].count(None) != 2:
            raise ValueError(
                "KvtierL2 needs exactly one of adapter_params.path (a pool directory), "
                "adapter_params.files (pool files) or adapter_params.service (the socket of "
                "a kvtier serve)"
            )
        # adapter_params come from JSON: a quoted number or bool would
        # otherwise fail deep inside with a message that names neither the
        # parameter nor the fix (or, for a bool, read "false" as true).
        for name, v in (("chunk_size", chunk_size), ("devices", devices)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"adapter_params.{name} is {v!r}: give an int of at least 1")
        for name, v in (("group_blocks", group_blocks), ("staging_blocks", staging_blocks)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"adapter_params.{name} is {v!r}: give an int, or leave it out")
        if not isinstance(prewrite, bool):
            raise ValueError(f"adapter_params.prewrite is {prewrite!r}: give true or false")
        for name, v in (("store_job_mb", store_job_mb), ("load_job_mb", load_job_mb),
                        ("load_inflight_mb", load_inflight_mb),
                        ("log_interval_s", log_interval_s),
                        ("service_reconnect_s", service_reconnect_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"adapter_params.{name} is {v!r}: give a number")
        for name, mb in (
            ("store_job_mb", store_job_mb),
            ("load_job_mb", load_job_mb),
            ("load_inflight_mb", load_inflight_mb),
        ):
            if not mb > 0:
                raise ValueError(f"adapter_params.{name} is {mb}: give a size in MiB above 0")
        if staging_blocks is not None and staging_blocks < 1:
            raise ValueError(
                f"adapter_params.staging_blocks is {staging_blocks}: give at least 1 "
                "(or leave it out: 512 MiB of chunks)"
            )
        del workers  # accepted for old configurations: one I/O thread now serves all
        self.tier: TierHandle
        # Over a service: how to connect again, whether the connection went
        # away and when to try again.
        self._service = service
        self._connect = lambda: (TierBuilder().service(service, blocks=staging_blocks or 0)
                                 .model(model, block_size=chunk_size, dtype=dtype).build())
        self._link = ServiceLink(service_reconnect_s)
        if service is not None:
            # The service's pool, checked to serve this model at this chunk
            # size; without staging_blocks, all the memory it gives a client.
            try:
                self.tier = self._connect()
            except UsageError as e:
                raise ValueError(
                    f"adapter_params.service: {e} (this LMCache config: {model} at chunk_size "
                    f"{chunk_size}; point adapter_params.service at the service of this model)"
                ) from e
            staging_blocks = self.tier.memory_blocks
            self.pool = f"service {service}"
        else:
            self.tier = self._open_pool(model, chunk_size, path, files, capacity, dtype,
                                        devices, group_blocks, staging_blocks, engine,
                                        prewrite, namespace)
            self.pool = str(path if path is not None else list(files or [])[0])
            staging_blocks = self._staging
        self._setup(staging_blocks, store_job_mb, load_job_mb, load_inflight_mb,
                    log_interval_s)

    def _open_pool(self, model: str, chunk_size: int, path: str | None,
                   files: Sequence[str] | None, capacity: int | str | None,
                   dtype: str | None, devices: int, group_blocks: int | None,
                   staging_blocks: int | None, engine: str, prewrite: bool,
                   namespace: str | None) -> TierHandle:
        b = TierBuilder()
        b = b.directory(path, devices) if path is not None else b.files(list(files or []))
        if capacity is not None:
            b.capacity(capacity)
        try:
            geometry, _ = resolve_model(model, block_size=chunk_size, dtype=dtype)
        except UsageError as e:
            if "block_size" not in str(e):
                raise
            # kvtier's block is LMCache's chunk: name the setting this user has.
            raise ValueError(
                f"adapter_params.chunk_size {chunk_size} (LMCache's --chunk-size, kvtier's "
                f"block_size): {e}") from e
        if group_blocks is None:
            group_blocks = max(8, min(64, (4 << 20) // int(geometry["object_bytes"])))
        b.group_blocks(group_blocks).prewrite(prewrite)
        b.model(model, block_size=chunk_size, dtype=dtype).engine(engine)
        if staging_blocks is None:
            block = int(geometry["block_bytes"])
            staging_blocks = max(4, min(64, _DEFAULT_STAGING_BYTES // block))
        # Naive: an L2 store is already off LMCache's critical path, and
        # nothing else here issues loads that writes could slow.
        b.policy("naive").host_cache(staging_blocks, "cross_layer")
        if namespace is not None:
            b.namespace(namespace)
        self._staging = staging_blocks
        try:
            return b.build()
        except UsageError as e:
            if "it is in use" not in str(e):
                raise
            # Several LMCache servers on one node (one per GPU, say): the
            # fix is to share the pool, not to stop the other server.
            raise UsageError(
                f"{e}; several LMCache servers on one node share one pool through "
                "`kvtier serve` (adapter_params.service instead of path), or give each "
                "its own adapter_params.path") from e

    def _setup(self, staging_blocks: int, store_job_mb: float, load_job_mb: float,
               load_inflight_mb: float, log_interval_s: float) -> None:
        self.block_bytes: int = self.tier.block_bytes
        self.staging_blocks = staging_blocks
        def per_job(mb: float) -> int:
            return max(1, min(staging_blocks, int(mb * 2**20) // self.block_bytes))

        self.store_job_blocks = per_job(store_job_mb)
        self.load_job_blocks = per_job(load_job_mb)
        # Loads in flight at once: few enough that they finish one after
        # another (each then copied out while the next is read), not all
        # at the end together.
        self.load_inflight_blocks = max(
            self.load_job_blocks, int(load_inflight_mb * 2**20) // self.block_bytes
        )
        self._loading = 0  # blocks of load jobs in flight
        self._tier_fd = self.tier.event_fd()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._next = 1
        self._new: collections.deque[_Op] = collections.deque()
        self._closed = False
        # I/O thread state (touched by it alone).
        self._waiting: collections.deque[_Op] = collections.deque()
        self._free = list(range(staging_blocks - 1, -1, -1))
        self._jobs: dict[int, tuple[_Op, list[int], list[int]]] = {}
        self._retry_at = 0.0
        # Counters (under _stats_lock).
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(COUNTERS, 0)
        self._logged_stats: dict[str, int] = dict(self._stats)
        self._log_interval = float(log_interval_s)
        self._next_log = time.monotonic() + self._log_interval
        self._small_sizes: set[int] = set()
        self._warned_evict = False
        usage = self.tier.usage()["tier"]
        self._total_blocks = int(usage["total_blocks"])
        logger.info(
            "kvtier L2 on %s: %d blocks of %d bytes (%.2f GiB usable; keep LMCache's "
            "max_capacity_gb at or below it), %d held; staging %d blocks (%.0f MiB), "
            "%d/%d chunk(s) a store/load job, engine %s",
            self.pool,
            self._total_blocks,
            self.block_bytes,
            self._total_blocks * self.block_bytes / 2**30,
            int(usage["live_blocks"]),
            staging_blocks,
            staging_blocks * self.block_bytes / 2**20,
            self.store_job_blocks,
            self.load_job_blocks,
            self.tier.engine,
        )
        self._thread = threading.Thread(target=self._run, name="kvtier-l2", daemon=True)
        self._thread.start()
        _live.add(self)
        _register_otel()

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
        return self._answer(found)

    def submit_batch_delete(self, keys: Sequence[str]) -> int:
        """LMCache's L2 eviction: take the chunks out of the pool (index only,
        answered at once); per key, whether the pool held it. A load already
        reading one finishes first."""
        self._refuse_if_closed()
        gone = [self.tier.remove([_key(k)]) == 1 for k in keys]
        self._count(deleted=sum(gone))
        return self._answer(gone)

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
            # Under the lock: a submit either queued its operation before
            # this (and it completes) or sees the tier closed.
            self._closed = True
        os.eventfd_write(self._wake, 1)
        # Called from an exit handler: kvtier parks threads coming back from
        # its calls once the interpreter exits (rather than let CPython end
        # them mid-call); while this waits for its I/O thread it may finish.
        grace = _exiting()
        if grace:
            _exit_grace(True)
        try:
            self._thread.join()
        finally:
            if grace:
                _exit_grace(False)
            try:
                self.tier.close()
            finally:
                _live.discard(self)
                self._log_stats(final=True)
                with self._lock:
                    os.close(self._efd)
                    self._efd = -1
                os.close(self._wake)

    # -- what an operator sees -------------------------------------------

    def stats(self) -> dict[str, int]:
        """The counters (see COUNTERS) since this client opened the pool."""
        with self._stats_lock:
            return dict(self._stats)

    def usage(self) -> dict[str, Any]:
        return self.tier.usage()

    # -- internals -------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _log_stats(self, final: bool = False) -> None:
        s = self.stats()
        if not final and s == self._logged_stats:
            return
        self._logged_stats = s
        logger.info(
            "kvtier L2 %s%s: stored %d chunks (%.1f MiB), %d already held; loaded %d "
            "(%.1f MiB); missed %d; corrupt %d; failed loads %d; dropped %d; evicted by "
            "kvtier %d; deleted by LMCache %d; wasted %.1f MiB",
            self.pool,
            " (closed)" if final else "",
            s["stored_chunks"],
            s["stored_bytes"] / 2**20,
            s["already_held"],
            s["loaded_chunks"],
            s["loaded_bytes"] / 2**20,
            s["missed"],
            s["corrupt"],
            s["failed_loads"],
            s["dropped"],
            s["evicted"],
            s["deleted"],
            s["wasted_bytes"] / 2**20,
        )

    def _answer(self, results: list[bool]) -> int:
        with self._lock:
            self._refuse_if_closed()
            fid = self._next
            self._next += 1
            self._done.append((fid, True, "", results))
            os.eventfd_write(self._efd, 1)
        return fid

    def _complete(self, op: _Op) -> None:
        with self._lock:
            self._done.append((op.fid, all(op.results), op.error, op.results))
            os.eventfd_write(self._efd, 1)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("KvtierL2 is closed: open a new one to submit more")

    def _submit(self, kind: str, keys: Sequence[str], memviews: Sequence[memoryview]) -> int:
        self._refuse_if_closed()
        if len(keys) != len(memviews):
            raise ValueError(
                f"{len(keys)} keys but {len(memviews)} buffers: give one buffer per key"
            )
        views = [memoryview(mv) for mv in memviews]
        for i, mv in enumerate(views):
            n = mv.nbytes
            if n > self.block_bytes:
                # Refused here, not failed later: the configuration is wrong.
                raise ValueError(
                    f"object {i} has {n} bytes, more than a kvtier block of {self.block_bytes}: "
                    "adapter_params.chunk_size and model must match LMCache's chunk_size and model"
                )
        if kind == "set":
            self._note_small(views)
        with self._lock:
            self._refuse_if_closed()
            fid = self._next
            self._next += 1
            self._new.append(_Op(fid, kind, list(keys), views))
        os.eventfd_write(self._wake, 1)
        return fid

    def _note_small(self, views: list[memoryview]) -> None:
        waste = 0
        for mv in views:
            n = mv.nbytes
            if n < self.block_bytes:
                waste += self.block_bytes - n
                # LMCache's last chunk of a prompt is partial, so some of
                # this is normal; a size seen again and again below half a
                # block means the configuration gives blocks too large.
                if n < self.block_bytes // 2 and n not in self._small_sizes and len(self._small_sizes) < 8:
                    self._small_sizes.add(n)
                    logger.warning(
                        "kvtier L2: a chunk of %d bytes takes a whole kvtier block of %d bytes "
                        "(%.0f%% of it wasted). A prompt's last chunk is partial; if most chunks "
                        "are this size, adapter_params.chunk_size (%s tokens a block) or model "
                        "do not match LMCache's --chunk-size and model: set them to match",
                        n,
                        self.block_bytes,
                        100 * (self.block_bytes - n) / self.block_bytes,
                        self.tier.geometry["block_size"],
                    )
        if waste:
            self._count(wasted_bytes=waste)

    # -- the I/O thread --------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._step():
                    return
            except Exception:  # a bug here must not leave LMCache waiting silently
                logger.exception("kvtier L2: I/O thread error (carrying on)")
                time.sleep(0.01)

    def _gone(self, e: Exception) -> None:
        """The kvtier service's connection went away: said once; until a new
        one (`_keep_connected`), gets miss and sets are dropped."""
        if self._service is not None and isinstance(e, ClosedError) and self._link.went_away():
            logger.warning("kvtier L2: %s; chunks miss and are not stored until the kvtier "
                           "service answers again (tried every %.0f s)", e, self._link.every_s)

    def _keep_connected(self) -> None:
        """Over a service, every ``service_reconnect_s``: while connected,
        ask it for its usage (a lookup of a gone service answers a miss, not
        an error, so gets alone would never notice); once it went away,
        connect again, when none of the old connection's jobs is left (their
        staging blocks and results belong to it)."""
        if self._service is None or not self._link.due():
            return
        if not self._link.gone:
            try:
                self.tier.usage()
            except KvtierError as e:
                self._gone(e)
            return
        if self._jobs:
            return
        try:
            tier = self._connect()
        except (KvtierError, OSError) as e:
            logger.debug("kvtier L2: the kvtier service does not answer yet: %s", e)
            return
        if tier.memory_blocks < self.staging_blocks:
            tier.close()
            logger.warning("kvtier L2: the kvtier service now shares %d blocks with a client, "
                           "fewer than this client's %d: not connecting again",
                           tier.memory_blocks, self.staging_blocks)
            self._link.give_up()
            return
        old, self.tier = self.tier, tier
        self._tier_fd = tier.event_fd()
        self._free = list(range(self.staging_blocks - 1, -1, -1))
        logger.info("kvtier L2: connected to the kvtier service %s again after %.1f s",
                    self._service, self._link.back())
        try:
            old.close()
        except KvtierError:
            pass

    def _step(self) -> bool:
        """One turn of the I/O thread; True once closed and everything finished."""
        self._keep_connected()
        with self._lock:
            while self._new:
                self._waiting.append(self._new.popleft())
            closing = self._closed and not self._new
        self._start_parts()
        if closing and not self._waiting and not self._jobs:
            return True
        timeout = 1.0
        if self._service is not None:
            timeout = min(timeout, self._link.every_s)
        if self._waiting and self._retry_at:
            timeout = max(0.0, min(timeout, self._retry_at - time.monotonic()))
        if self._log_interval > 0:
            timeout = max(0.0, min(timeout, self._next_log - time.monotonic()))
        readable, _, _ = select.select([self._wake, self._tier_fd], [], [], timeout)
        if self._wake in readable:
            try:
                os.eventfd_read(self._wake)
            except BlockingIOError:
                pass
        self._reap()
        if self._log_interval > 0 and time.monotonic() >= self._next_log:
            self._next_log = time.monotonic() + self._log_interval
            self._log_stats()
        return False

    def _reap(self) -> None:
        """Settle every job that finished (non-blocking); once the service
        has gone, every job of its connection (each fails)."""
        try:
            events = self.tier.drain_completions()
        except KvtierError as e:
            self._gone(e)
            events = []
        for ev in events:
            if ev.kind == "finished" and ev.job in self._jobs:
                self._settle(ev.job)
        if self._link.gone:
            for job in list(self._jobs):
                self._settle(job)

    def _start_parts(self) -> None:
        """Copy and submit groups of waiting operations while staging is free."""
        if self._retry_at and time.monotonic() < self._retry_at:
            return
        self._retry_at = 0.0
        while self._waiting:
            op = self._waiting[0]
            if op.todo is None:
                self._begin(op)
            if op.todo:
                if op.kind == "set":
                    n = min(self.store_job_blocks, len(op.todo), len(self._free))
                else:
                    room = self.load_inflight_blocks - self._loading
                    n = min(self.load_job_blocks, len(op.todo), len(self._free), room)
                if n <= 0:
                    return  # a job ending frees staging or room, and wakes this thread
                idx = [op.todo.popleft() for _ in range(n)]
                blocks = [self._free.pop() for _ in range(n)]
                if not self._submit_part(op, idx, blocks):
                    # Backpressure: put it back and try again shortly.
                    op.todo.extendleft(reversed(idx))
                    self._free.extend(reversed(blocks))
                    self._retry_at = time.monotonic() + 0.001
                    return
                self._reap()
            if not op.todo:
                self._waiting.popleft()
                if op.jobs == 0:
                    self._finish_op(op)

    def _begin(self, op: _Op) -> None:
        if op.kind == "set":
            op.todo = collections.deque(range(len(op.keys)))
            return
        # Pin each key found, so no store evicts it before it is read.
        todo = collections.deque()
        for i, k in enumerate(op.keys):
            if self.tier.lookup_and_pin([k]) == 1:
                todo.append(i)
        self._count(missed=len(op.keys) - len(todo))
        op.todo = todo

    def _submit_part(self, op: _Op, idx: list[int], blocks: list[int]) -> bool:
        keys = [op.keys[i] for i in idx]
        try:
            if op.kind == "set":
                for b, i in zip(blocks, idx):
                    self.tier.write_block(b, op.views[i])
                job = self.tier.submit_store(keys, blocks)
            else:
                job = self.tier.submit_load(keys, blocks)
        except BackpressureError:
            return False
        except Exception as e:  # reported per key, never lost: LMCache waits on this op
            self._gone(e)
            if op.kind == "get" and len(idx) > 1 and not self._link.gone:
                # One key removed meanwhile (LMCache's delete) refuses the
                # whole load: load the others one by one.
                self._free.extend(blocks)
                for i in idx:
                    b = self._free.pop()
                    if not self._submit_part(op, [i], [b]):
                        self._free.append(b)
                        self.tier.unpin([op.keys[i]])
                        self._count(missed=1)
                return True
            self._free.extend(blocks)
            why = f"{type(e).__name__}: {e}"
            if op.kind == "set":
                self._count(dropped=len(idx))
                logger.warning("kvtier L2: %d chunk(s) not stored: %s", len(idx), why)
                op.error = op.error or why
            else:
                self.tier.unpin(keys)
                self._count(missed=len(idx))
            return True
        op.jobs += 1
        if op.kind == "get":
            self._loading += len(blocks)
        self._jobs[job] = (op, idx, blocks)
        return True

    def _settle(self, job: int) -> None:
        op, idx, blocks = self._jobs.pop(job)
        if op.kind == "get":
            self._loading -= len(blocks)
        try:
            r = self.tier.wait(job)
        except KvtierError as e:  # the handle failed as a whole
            self._gone(e)
            why = f"{type(e).__name__}: {e}"
            logger.warning("kvtier L2: a job failed: %s", why)
            op.error = op.error or why
            if op.kind == "set":
                self._count(dropped=len(idx))
            else:
                self._count(failed_loads=len(idx))
                self.tier.unpin([op.keys[i] for i in idx])
            r = None
        if r is not None and op.kind == "set":
            done = held = 0
            nbytes = 0
            for j, (i, outcome) in enumerate(zip(idx, r.outcomes)):
                if outcome == "done":
                    done += 1
                    nbytes += op.views[i].nbytes
                elif outcome == "already_stored":
                    held += 1
                else:
                    why = str(r.errors[j])
                    logger.warning(
                        "kvtier L2: chunk %s not stored (%s): %s", op.names[i], outcome, why
                    )
                    op.error = op.error or why
                    continue
                op.results[i] = True
            self._count(
                stored_chunks=done,
                stored_bytes=nbytes,
                already_held=held,
                dropped=len(idx) - done - held,
                evicted=len(r.evicted),
            )
            if r.evicted and not self._warned_evict:
                self._warned_evict = True
                logger.warning(
                    "kvtier L2: the pool was full and kvtier evicted %d chunk(s) LMCache still "
                    "counts as held (they become misses): set the adapter's max_capacity_gb to "
                    "at most %.2f (%d blocks of %d bytes; less if many chunks are partial) so "
                    "LMCache evicts first",
                    len(r.evicted),
                    self._total_blocks * self.block_bytes / 2**30 * 0.95,
                    self._total_blocks,
                    self.block_bytes,
                )
        elif r is not None:
            loaded = nbytes = corrupt = failed = 0
            for j, (i, b, outcome) in enumerate(zip(idx, blocks, r.outcomes)):
                if outcome == "done":
                    self.tier.read_block_into(b, op.views[i])
                    op.results[i] = True
                    loaded += 1
                    nbytes += op.views[i].nbytes
                elif outcome == "corrupt":
                    # Never served: a miss to LMCache, and said so here.
                    corrupt += 1
                    logger.warning(
                        "kvtier L2: chunk %s failed its checksum and was dropped from the "
                        "pool (served as a miss): %s",
                        op.names[i],
                        r.errors[j],
                    )
                else:
                    failed += 1
                    logger.warning(
                        "kvtier L2: chunk %s could not be loaded (served as a miss): %s",
                        op.names[i],
                        r.errors[j],
                    )
            self.tier.unpin([op.keys[i] for i in idx])
            self._count(
                loaded_chunks=loaded, loaded_bytes=nbytes, corrupt=corrupt, failed_loads=failed
            )
        self._free.extend(blocks)
        op.jobs -= 1
        if op.jobs == 0 and not op.todo and (not self._waiting or self._waiting[0] is not op):
            self._finish_op(op)

    def _finish_op(self, op: _Op) -> None:
        self._complete(op)
