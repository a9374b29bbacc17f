"""kvtier under vLLM: a layer-wise KV connector and a secondary offloading tier.

:class:`KvtierConnector` (a ``KVConnectorBase_V1``) is enabled by config alone::

    KVTransferConfig(kv_connector="KvtierConnector",
                     kv_connector_module_path="kvtier.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"pool_dir": "/data/kvtier",
                                                "capacity": "64g"})

Who owns the pool, and why: vLLM runs the scheduler-side connector in the
engine-core process and the worker-side one in each worker process (on CPU
too: the executor is multi-process even at TP 1). kvtier flocks a pool's
files, exclusively for the process that writes it, so two processes cannot
both open it; and only the worker can do the I/O, since the KV memory is
its. So each TP rank's worker owns its rank's pool (``pool_dir/tp<rank>``,
its own namespace) and serves lookups to the scheduler over a Unix socket
(abstract namespace, named from the pool's path). The scheduler therefore
sees exactly what the worker's pool holds, and ``lookup_and_pin`` keeps the
matched blocks from being evicted between the scheduler's decision and the
worker's load; the worker drops those pins when the load finishes.

With ``"service": PATH`` no process owns a pool: the node's ``kvtier serve``
does, and every engine's workers and schedulers are its clients. A worker
shares memory with it (its staging); the scheduler opens a lookup-only
connection of its own (no memory) and looks up and pins there, so it sees
exactly what the service holds. Pins are per connection: the scheduler
drops its pins once each worker reports the load done, and the service
drops them if the scheduler's process dies. Each TP rank's worker is one
client; a rank's KV shard differs from another's, so its keys are the
block's keys salted with the rank (``rank_keys``), and the pool's geometry
is one rank's shard. The scheduler counts a block as a hit only where
every rank holds it, and pins every rank's keys.

Keys are a SHA-256 chain over each full block's token ids (and the request's
cache salt), computed the same way in every process and every restart,
whatever vLLM's own prefix-hash settings: with a non-cryptographic
``prefix_caching_hash_algo`` (xxhash) vLLM seeds its block hashes randomly
per process unless PYTHONHASHSEED is set, which would lose every hit after
a restart.

Memory: the layout is read off vLLM's own tensors (``_vllm_layout``): each
block's page per layer is two kvtier objects, layer-outermost layouts a
region per layer (``block_major``), block-outermost ones ``cross_layer``.
kvtier does direct I/O (O_DIRECT, DMA) and needs 4096-byte aligned memory;
vLLM's CPU cache is one torch allocation 64 bytes past a page, so the
connector then stages through page-aligned kvtier memory (a memcpy per
page, done layer by layer as each ``wait_for_layer_load`` returns); when
the cache is page aligned it registers it as it is and kvtier reads and
writes it directly.

:class:`KvtierTier` is a vLLM ``SecondaryTierManager`` (the
``TieringOffloadingSpec``'s ``secondary_tiers``) over the primary CPU tier's
``primary_kv_view``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from . import BackpressureError, ClosedError, KvtierError, TierBuilder, TierHandle
from ._service import ServiceLink
from ._vllm_layout import KvMapping, map_kv_caches
from ._vllm_lookup import LOOKUP as _LOOKUP
from ._vllm_lookup import PIN as _PIN
from ._vllm_lookup import UNPIN as _UNPIN
from ._vllm_lookup import LookupClient, LookupServer, ServiceLookups, socket_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierTier", "block_keys", "rank_keys"]

# Under vLLM's logger tree ("vllm."), so kvtier's lines appear in vLLM's log
# with its format and level (a logger outside it is never configured).
logger = init_logger(f"vllm.{__name__}")

# The medium kvtier's KV events carry: a KV-aware router (llm-d's KV cache
# indexer, vLLM's router) tells blocks on a node's SSDs from those in its
# GPU or CPU memory by it.
KV_EVENT_MEDIUM = "KVTIER"
# Blocks the scheduler remembers for KV events (a planned or stored block's
# vLLM hash, ~200 B each): bounded, oldest forgotten (their events are then
# not sent, never wrong).
_MAX_EVENT_KEYS = 1 << 18
_ROOT = b"kvtier-vllm-v1"


def block_keys(token_ids: Iterable[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The kvtier key of every full block of ``token_ids``: a SHA-256 chain,
    so a key names its whole prefix, identical in every process."""
    toks = list(token_ids)
    prev = hashlib.sha256(_ROOT + (salt or "").encode()).digest()
    keys = []
    for i in range(len(toks) // block_size):
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{block_size}q", *toks[i * block_size : (i + 1) * block_size]))
        prev = h.digest()
        keys.append(prev)
    return keys


def rank_keys(keys: list[bytes], rank: int, tp_size: int) -> list[bytes]:
    """The keys of TP rank ``rank``'s shard of each block, on a kvtier
    service every rank shares: each rank holds another part of a block's KV
    (its heads), so a rank's key is the block's key salted with the rank and
    the TP size. With one rank, the block's keys."""
    if tp_size == 1:
        return keys
    tag = _ROOT + b"/tp" + struct.pack("<II", rank, tp_size)
    return [hashlib.sha256(tag + k).digest() for k in keys]


@dataclass
class _Load:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    # Keys the scheduler pinned on each TP rank's pool (a prefix of `keys`).
    pinned: list[int]
    # The scheduler's number for it: over a service the workers report it
    # done by it, and the scheduler then drops its pins.
    load_id: int = 0


@dataclass
class _Store:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class _InflightLoad:
    """A kvtier load job of this step, on the worker."""

    job: int
    load: _Load
    # Staging slot per block (host staging), else None: kvtier writes vLLM's blocks.
    slots: list[int] | None
    block_ids: list[int]
    done: set[int] = field(default_factory=set)
    # The job's result, once taken (a failed layer takes it early).
    result: Any = None


@dataclass
class _GoneResult:
    """A job's result once the worker's kvtier service connection is gone
    (``kvtier serve`` restarted or died): every key failed, a miss (vLLM
    recomputes the blocks; stores are dropped), never an exception into
    vLLM's step, which would end the engine."""

    keys: list[bytes]
    error: KvtierError
    evicted: list[bytes] = field(default_factory=list)
    ok: bool = False

    @property
    def outcomes(self) -> list[str]:
        return ["failed"] * len(self.keys)

    @property
    def errors(self) -> list[KvtierError]:
        return [self.error] * len(self.keys)


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    stores: list[_Store] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: the kvtier keys whose stores became
    durable and those that left the pool (evicted, or dropped as corrupt),
    for the scheduler's KV events. Workers' lists are concatenated: with
    tensor parallelism a block counts as stored once every rank stored it."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    # Over a service: (load id, rank) of every load of the scheduler's
    # metadata the rank is done with (its pins there can go).
    loaded: list[tuple[int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtierWorkerMetadata":
        if isinstance(other, KvtierWorkerMetadata):
            return KvtierWorkerMetadata(self.stored + other.stored, self.removed + other.removed,
                                        self.loaded + other.loaded)
        return self


@dataclass
class _ReqState:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Blocks below this index are computed and either stored or in flight.
    stored_upto: int | None = None
    match_start: int = 0
    had_stores: bool = False


def _copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor,
               src_rows: list[int]) -> None:
    """dst[dst_rows] = src[src_rows] for byte pages, a memcpy per page: an
    indexed assignment of uint8 rows copies byte by byte (~8x slower here,
    most of a restored prefix's time to first token)."""
    for d, s in zip(dst_rows, src_rows):
        dst[d].copy_(src[s])


def _model_tail(model: str) -> str:
    """The last 40 characters of a model's name or path, printable: it names
    the pool's model and starts its namespace."""
    clean = "".join(c if c.isalnum() or c in "._-/" else "_" for c in model).strip("/.")
    return clean[-40:] or "model"


def _write_stats(path: str | None, stats: dict[str, Any]) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(stats, f)
    os.replace(tmp, path)


# Counters the connector reports to vLLM each step (KVConnectorStats): summed
# over workers and steps, logged by vLLM's periodic "KV Transfer metrics" line
# and exported as Prometheus counters vllm:kvtier_<name>_total.
STAT_COUNTERS = {
    "lookups": "scheduler lookups of a request's prefix in kvtier",
    "hit_blocks": "blocks found in kvtier by the scheduler",
    "miss_blocks": "blocks looked up and not found in kvtier",
    "deferred_lookups": "hits deferred to a later step (the step's load staging was full)",
    "loaded_blocks": "blocks loaded from kvtier into vLLM's KV cache",
    "loaded_bytes": "bytes loaded from kvtier",
    "load_error_blocks": "blocks whose load failed (reported to vLLM, recomputed)",
    "corrupt_blocks": "blocks that failed their checksum on the device (dropped from the pool)",
    "stored_blocks": "blocks submitted to kvtier for storing",
    "stored_bytes": "bytes submitted to kvtier for storing",
    "stores_dropped": "blocks not stored (back-pressure: staging or store backlog full)",
    "layer_waits_total": "waits for a layer's load before its attention",
    "layer_wait_s": "seconds spent waiting for layers' loads",
}


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """kvtier's counters for one interval, as vLLM collects connector stats."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvtierConnectorStats":
        for k, v in (other.data or {}).items():
            if k in STAT_COUNTERS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in STAT_COUNTERS
                                       if self.data.get(k)}
        if self.data.get("layer_waits_total"):
            out["layer_wait_ms_avg"] = round(
                1e3 * self.data.get("layer_wait_s", 0) / self.data["layer_waits_total"], 3)
        if "layer_wait_s" in out:
            out["layer_wait_s"] = round(out["layer_wait_s"], 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in STAT_COUNTERS)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counters as Prometheus counters, per engine."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: self.create_metric_per_engine(self._counter_cls(
                name=f"vllm:kvtier_{k.removesuffix('_total')}_total", documentation=doc,
                labelnames=labelnames))
            for k, doc in STAT_COUNTERS.items()
        }

    def create_metric_per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values)
                for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(k)
            if per_engine is not None and v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)


# kv_connector_extra_config's keys and what each takes: a misspelt key would
# otherwise be ignored (a pool of the default 4g for "capacty": "64g").
_EXTRA_CONFIG = {
    "pool_dir": "a directory (str)",
    "service": "the socket path of a kvtier serve (str)",
    "capacity": 'bytes per TP rank (an int, or a str like "64g")',
    "prewrite": "true or false",
    "staging_blocks": "an int of at least 1",
    "engine": '"auto", "uring", "nvme", "gpu" or "gpu-host"',
    "policy": '"slack", "naive" or "sync"',
    "stats_path": "a file path (str)",
    "service_reconnect_s": "seconds above 0",
    "test_only_staged_host_double": "true or false (a test double, never for serving)",
}


def _check_extra_config(extra: dict[str, Any]) -> None:
    """Refuses keys KvtierConnector does not know and values of the wrong
    type, naming the key and what it takes."""
    import difflib

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"kv_connector_extra_config[{key!r}] {why}; it takes "
                          f"{_EXTRA_CONFIG[key]}")

    for key in extra:
        if key not in _EXTRA_CONFIG:
            near = difflib.get_close_matches(str(key), list(_EXTRA_CONFIG), n=1)
            raise ValueError(
                f"kv_connector_extra_config has {key!r}, which KvtierConnector does not know"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f"; its keys are {', '.join(_EXTRA_CONFIG)}")
    for key in ("prewrite", "test_only_staged_host_double"):
        if key in extra and not isinstance(extra[key], bool):
            raise bad(key, f"is {extra[key]!r}, not a bool")
    if "staging_blocks" in extra:
        v = extra["staging_blocks"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad("staging_blocks", f"is {v!r}")
    if "service_reconnect_s" in extra:
        v = extra["service_reconnect_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise bad("service_reconnect_s", f"is {v!r}")
    for key in ("pool_dir", "service", "stats_path", "engine", "policy"):
        if key in extra and extra[key] is not None and not isinstance(extra[key], str):
            raise bad(key, f"is a {type(extra[key]).__name__}")
    if "capacity" in extra and (isinstance(extra["capacity"], bool)
                                or not isinstance(extra["capacity"], (int, str))):
        raise bad("capacity", f"is {extra['capacity']!r}")


class KvtierConnector(KVConnectorBase_V1):
    """vLLM KV connector over a kvtier pool, loading layer by layer.

    ``kv_connector_extra_config``:
      pool_dir (required, unless ``service``): the pool's directory; TP rank r
        uses ``pool_dir/tp<r>``.
      service: instead of a pool of the engine's own, the socket of this
        node's ``kvtier serve``: every engine on the node shares its pool (a
        block one stored is a hit for the others). The worker's staging
        (``staging_blocks`` for loads and as many for stores) is the memory
        the service shares with it; the scheduler looks up and pins over a
        lookup-only connection of its own. Keys carry a hash of the model's
        identity (and TP size), so engines of different models on one service
        never share a block; with TP, each rank is a client and its keys are
        salted with its rank (the service then serves one rank's shard:
        ``kvtier serve --tp-size N`` for ``tensor_parallel_size=N``). CUDA KV
        caches go through the staged GPU path with the memory the service
        shares as its staging (registered as pinned here; the copies run on
        this process's copy stream). A worker whose service went away (a
        restart, an upgrade) serves misses and connects again, once its
        jobs have drained, every ``service_reconnect_s`` seconds (default 5).
      capacity: bytes of pool to create per rank when absent (default "4g").
      prewrite: write a new pool's files once at creation (capacity at the
        disk's write speed) so first stores run at overwrite speed, not at
        the ~0.6x of filling a file system's unwritten extents (default False).
      staging_blocks: blocks of page-aligned staging for loads and as many for
        stores, when vLLM's tensors are not page aligned (default 64). A step
        loads at most this many blocks from kvtier.
      engine: kvtier engine ("auto" default), policy: store policy ("slack").
      CUDA KV caches go through kvtier's staged HBM path (pinned host staging
        of ``staging_blocks`` blocks per load and per store, copy kernels);
        ``wait_for_layer_load`` then makes the current CUDA stream wait for the
        layer on the GPU, without a host wait.
      test_only_staged_host_double: TEST DOUBLE, never for serving: CPU KV
        tensors go through the staged HBM path as if they were GPU memory,
        the CPU doing the copy kernels' work (tests of the HBM plumbing on
        machines without a GPU).
      stats_path: a JSON file the connector keeps its counters in (per rank:
        ``<stats_path>.tp<r>``; the scheduler's: ``<stats_path>.scheduler``).
    """

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        _check_extra_config(dict(tc.kv_connector_extra_config or {}))
        self._pool_dir = tc.get_from_extra_config("pool_dir", None)
        self._service = tc.get_from_extra_config("service", None)
        if bool(self._pool_dir) == bool(self._service):
            raise ValueError(
                "KvtierConnector needs kv_connector_extra_config={'pool_dir': '/path/to/pool', ...} "
                "(a pool of this engine's own) or {'service': '/run/kvtier/kvtier.sock', ...} "
                "(this node's kvtier serve), one of them"
            )
        self._capacity = tc.get_from_extra_config("capacity", "4g")
        self._prewrite = bool(tc.get_from_extra_config("prewrite", False))
        self._staging = int(tc.get_from_extra_config("staging_blocks", 64))
        self._engine = tc.get_from_extra_config("engine", "auto")
        self._policy = tc.get_from_extra_config("policy", "slack")
        self._stats_path = tc.get_from_extra_config("stats_path", None)
        self._block_size = vllm_config.cache_config.block_size
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ValueError(
                "KvtierConnector serves tensor parallelism only; pipeline_parallel_size must be 1"
            )
        self._tp_size = par.tensor_parallel_size
        # Keys on a shared service carry the model's identity: block hashes
        # are of token ids only.
        self._key_salt = ""
        if self._service:
            ident = {k: v for k, v in self._identity().items() if k != "tp_rank"}
            self._key_salt = hashlib.sha256(
                json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]
        self._interval: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            # Over a service: one lookup-only connection for every rank's
            # keys; else each rank's worker answers for its own pool.
            self._svc = ServiceLookups(self._service, logger) if self._service else None
            self._clients = [] if self._service else [
                LookupClient(socket_name(self._rank_dir(r))) for r in range(self._tp_size)
            ]
            self._next_load = 1
            # Over a service, per load id: each rank's keys this scheduler
            # pinned (None once that rank reported the load done).
            self._pins: dict[int, list[list[bytes] | None]] = {}
            # Over a service with TP: a rank's key -> the block's key, for
            # the keys the workers report stored or removed.
            self._base_of: OrderedDict[bytes, bytes] = OrderedDict()
            self._reqs: dict[str, _ReqState] = {}
            self._loads: list[_Load] = []
            self._step_load_blocks = 0
            # KV events: what each planned store's block is to vLLM (its
            # block hash, parent, tokens), until the workers report it
            # stored; then kept (bounded) to name it when it leaves kvtier.
            self._planned: OrderedDict[bytes, tuple[Any, Any, list[int]]] = OrderedDict()
            self._stored_ranks: dict[bytes, int] = {}
            self._held: OrderedDict[bytes, Any] = OrderedDict()
            self._events: list[Any] = []
            self._sched_stats = {"lookups": 0, "matched_tokens": 0, "load_requests": 0,
                                 "pin_shortfall_blocks": 0, "store_blocks": 0,
                                 "deferred_lookups": 0}
        else:
            self._init_worker()

    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self._pool_dir, f"tp{rank}")

    def _count(self, stats: dict[str, Any], name: str, n: float) -> None:
        """Adds to a counter of the stats file and of this interval's stats."""
        stats[name] = stats.get(name, 0) + n
        if name in STAT_COUNTERS:
            self._interval[name] = self._interval.get(name, 0) + n

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not any(self._interval.values()):
            return None
        out, self._interval = KvtierConnectorStats(data=self._interval), {}
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        # No layout pinned: register_kv_caches checks the tensors it gets
        # (block-major per layer, vLLM's CPU cache) and refuses others.
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # CPU caches: wait_for_layer_load blocks on the host, which a CUDA
        # graph cannot replay. CUDA caches: the wait is a GPU-side
        # cuStreamWaitValue32, but on a per-load counter whose target value
        # (the counter's base, which moves with every load, plus the layer)
        # and even address are only known once the step's loads are
        # submitted; a captured graph would replay the capture-time values.
        # So graphs stay piecewise, attention (and these hooks) run eagerly.
        return True

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def _lookup(self, op: bytes, keys: list[bytes]) -> list[int]:
        """How many leading keys each rank holds (and pins them, `_PIN`)."""
        if self._svc is not None:
            return [self._svc.call(op, rank_keys(keys, r, self._tp_size))
                    for r in range(self._tp_size)]
        return [c.call(op, keys) for c in self._clients]

    def _state(self, request: "Request") -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            if getattr(request, "lora_request", None) or getattr(request, "mm_features", None):
                # Their KV depends on more than the token ids the keys hash.
                return None
            st = _ReqState(request=request)
            self._reqs[request.request_id] = st
        return st

    def _keys_upto(self, st: _ReqState, nblocks: int) -> list[bytes]:
        if len(st.keys) < nblocks:
            toks = st.request.all_token_ids
            salt = getattr(st.request, "cache_salt", None)
            if self._key_salt:
                salt = f"{self._key_salt}|{salt or ''}"
            st.keys = block_keys(toks[: nblocks * self._block_size], self._block_size, salt)
        return st.keys[:nblocks]

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        bs = self._block_size
        start = num_computed_tokens // bs
        # At least one token must be computed, so the last full block of a
        # prompt that is all in kvtier is left to the forward pass.
        end = (request.num_tokens - 1) // bs
        budget = max(self._staging - self._step_load_blocks, 0)
        st.match_start = start
        if end <= start:
            return 0, False
        keys = self._keys_upto(st, end)[start:]
        n = min(self._lookup(_LOOKUP, keys))
        self._count(self._sched_stats, "lookups", 1)
        self._count(self._sched_stats, "miss_blocks", len(keys) - n)
        if n and not budget:
            # This step's loads fill the worker's staging: ask again next
            # step rather than recompute what kvtier holds.
            self._count(self._sched_stats, "deferred_lookups", 1)
            return None, False
        return min(n, budget) * bs, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens == 0:
            return
        n = num_external_tokens // self._block_size
        start = st.match_start
        keys = self._keys_upto(st, start + n)[start:]
        ids = list(blocks.get_block_ids()[0][start : start + n])
        pinned = self._lookup(_PIN, keys)
        self._count(self._sched_stats, "pin_shortfall_blocks", n - min(pinned))
        load_id, self._next_load = self._next_load, self._next_load + 1
        if self._svc is not None:
            # This scheduler's pins on the service, until each rank's worker
            # reports the load done (update_connector_output).
            self._pins[load_id] = [rank_keys(keys[:p], r, self._tp_size) if p else None
                                   for r, p in enumerate(pinned)]
        self._loads.append(_Load(request.request_id, keys, ids, pinned, load_id))
        self._step_load_blocks += n
        self._count(self._sched_stats, "matched_tokens", num_external_tokens)
        self._count(self._sched_stats, "hit_blocks", n)
        self._count(self._sched_stats, "load_requests", 1)
        st.stored_upto = start + n

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvtierConnectorMetadata(
            loads=self._loads, preempted=set(scheduler_output.preempted_req_ids or ())
        )
        self._loads = []
        self._step_load_blocks = 0
        bs = self._block_size
        sched = scheduler_output.num_scheduled_tokens

        def plan(req_id: str, num_computed: int) -> None:
            st = self._reqs.get(req_id)
            if st is None:
                return
            if st.stored_upto is None or num_computed // bs < st.stored_upto:
                # New, resumed, or sent back: vLLM recomputes from num_computed
                # after a failed load (kv_load_failure_policy="recompute"), so
                # the blocks from there on are stored again as they are computed.
                st.stored_upto = num_computed // bs
            done = (num_computed + sched.get(req_id, 0)) // bs
            done = min(done, len(st.request.all_token_ids) // bs, len(st.block_ids))
            if done > st.stored_upto:
                keys = self._keys_upto(st, done)[st.stored_upto :]
                self._plan_events(st, keys, st.stored_upto)
                meta.stores.append(_Store(req_id, keys, st.block_ids[st.stored_upto : done]))
                self._count(self._sched_stats, "store_blocks", len(keys))
                st.stored_upto = done
                st.had_stores = True

        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
            plan(new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
                st.stored_upto = None
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            plan(req_id, cached.num_computed_tokens[i])
        _write_stats(f"{self._stats_path}.scheduler" if self._stats_path else None,
                     self._sched_stats)
        return meta

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        # Blocks with a store planned are freed once the worker reports the
        # store's copy done (get_finished), never while kvtier may read them.
        return bool(st and st.had_stores), None

    def _plan_events(self, st: _ReqState, keys: list[bytes], first: int) -> None:
        hashes = getattr(st.request, "block_hashes", None) or []
        if len(hashes) < first + len(keys) or self._kv_hash_block_size() != self._block_size:
            return  # vLLM hashes at another granularity: no events to name them by
        toks = st.request.all_token_ids
        bs = self._block_size
        for i, key in enumerate(keys):
            b = first + i
            self._planned[key] = (hashes[b], hashes[b - 1] if b else None,
                                  list(toks[b * bs:(b + 1) * bs]))
            self._planned.move_to_end(key)
        while len(self._planned) > _MAX_EVENT_KEYS:
            self._planned.popitem(last=False)
        if self._svc is not None and self._tp_size > 1:
            # The workers report their ranks' keys: name the block by them.
            for r in range(self._tp_size):
                for rk, key in zip(rank_keys(keys, r, self._tp_size), keys):
                    self._base_of[rk] = key
                    self._base_of.move_to_end(rk)
            while len(self._base_of) > _MAX_EVENT_KEYS * self._tp_size:
                self._base_of.popitem(last=False)

    def _kv_hash_block_size(self) -> int:
        cfg = self._kv_cache_config
        return (getattr(cfg, "hash_block_size", None) if cfg is not None else None) or \
            self._block_size

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, KvtierWorkerMetadata):
            return
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for load_id, rank in meta.loaded:
            self._release_pins(load_id, rank)
        if self._base_of:
            meta = KvtierWorkerMetadata([self._base_of.get(k, k) for k in meta.stored],
                                        [self._base_of.get(k, k) for k in meta.removed])
        for key in meta.stored:
            n = self._stored_ranks.get(key, 0) + 1
            if n < self._tp_size:
                self._stored_ranks[key] = n
                continue
            self._stored_ranks.pop(key, None)
            info = self._planned.pop(key, None)
            if info is None:
                continue
            h, parent, toks = info
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h)],
                parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                token_ids=toks, block_size=self._block_size, lora_id=None,
                medium=KV_EVENT_MEDIUM, lora_name=None))
            self._held[key] = h
            while len(self._held) > _MAX_EVENT_KEYS:
                self._held.popitem(last=False)
        gone = [self._held.pop(k) for k in dict.fromkeys(meta.removed) if k in self._held]
        if gone:
            self._events.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(h) for h in gone],
                medium=KV_EVENT_MEDIUM))

    def _release_pins(self, load_id: int, rank: int) -> None:
        """Rank ``rank``'s worker is done with load ``load_id``: drop the
        pins this scheduler took for it on the service."""
        ranks = self._pins.get(load_id)
        if ranks is None or not 0 <= rank < len(ranks):
            return
        keys, ranks[rank] = ranks[rank], None
        if keys:
            self._svc.call(_UNPIN, keys)
        if all(k is None for k in ranks):
            del self._pins[load_id]

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def _init_worker(self) -> None:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        except Exception:  # no distributed state: a single rank
            self._rank = 0
        self._tier: TierHandle | None = None
        # Over a service: whether its connection went away, when to try again.
        self._link = ServiceLink(self._kv_transfer_config.get_from_extra_config(
            "service_reconnect_s", 5.0))
        self._double = False
        self._server: LookupServer | None = None
        self._map: KvMapping | None = None
        # The staged HBM path (CUDA caches, or its CPU test double).
        self._hbm = False
        self._cuda = False
        self._stage: torch.Tensor | None = None
        self._stage_owner: Any = None
        self._free_load: list[int] = []
        self._free_store: list[int] = []
        self._inflight: list[_InflightLoad] = []
        # store job -> (staging slots or None, request id when direct)
        self._store_jobs: dict[int, tuple[list[int] | None, str | None]] = {}
        self._store_reqs: dict[str, int] = {}
        self._sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._ev_stored: list[bytes] = []
        self._ev_removed: list[bytes] = []
        self._ev_loaded: list[tuple[int, int]] = []
        self._stats: dict[str, Any] = {"rank": self._rank, "staged": None, "hbm": None,
                                       "stream_waits": 0, "loaded_blocks": 0,
                                       "layer_waits": [], "load_error_blocks": 0,
                                       "corrupt_blocks": 0, "loaded_bytes": 0,
                                       "stored_blocks": 0, "stored_bytes": 0,
                                       "stores_dropped": 0, "layer_wait_s": 0.0}

    def _kv_groups_check(self) -> None:
        """Refuses, at start, a model whose KV cache kvtier would serve wrong:
        several cache groups (hybrid models) or state that is not attention KV."""
        cfg = self._kv_cache_config
        if cfg is None:
            return
        groups = [g for g in cfg.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
        kinds = [f"{type(g.kv_cache_spec).__name__} x {len(g.layer_names)} layers" for g in groups]
        if len(groups) != 1:
            raise KvtierError(
                f"this model's KV cache has {len(groups)} groups ({'; '.join(kinds)}); "
                "KvtierConnector serves one group of attention layers: run vLLM with "
                "--disable-hybrid-kv-cache-manager where the model allows it, or without kvtier"
            )
        from vllm.v1.kv_cache_interface import AttentionSpec

        spec = groups[0].kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise KvtierError(
                f"this model's KV cache is {kinds[0]}, not attention KV; KvtierConnector "
                "serves attention KV caches (full attention, GQA, MHA, MLA)"
            )

    def _identity(self) -> dict[str, Any]:
        """What, besides the physical layout, decides the bytes of a block."""
        mc = self._vllm_config.model_config
        try:
            hf = mc.hf_config.to_json_string(use_diff=False)
        except Exception:  # a config transformers cannot serialise: its repr
            hf = repr(mc.hf_config)
        cfg = self._kv_cache_config
        spec = repr(cfg.kv_cache_groups[0].kv_cache_spec) if cfg and cfg.kv_cache_groups else None
        return {
            "model": str(mc.model),
            "hf_config": hashlib.sha256(hf.encode()).hexdigest(),
            "kv_cache_dtype": str(self._vllm_config.cache_config.cache_dtype),
            "kv_spec": spec,
            "tp_size": self._tp_size,
            "tp_rank": getattr(self, "_rank", 0),
        }

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_groups_check()
        devices = {t.device.type for t in kv_caches.values()}
        if devices - {"cpu", "cuda"} or len(devices) != 1:
            raise KvtierError(
                f"KV tensors on {sorted(devices)}; KvtierConnector registers one device's "
                "CPU or CUDA KV tensors"
            )
        self._cuda = devices == {"cuda"}
        double = bool(self._kv_transfer_config.get_from_extra_config(
            "test_only_staged_host_double", False))
        if double and self._cuda:
            raise KvtierError("test_only_staged_host_double stands CPU tensors in for GPU "
                              "memory; drop it to serve CUDA KV caches")
        self._hbm = self._cuda or double
        self._double = double
        cfg = self._kv_cache_config
        # The layout vLLM resolved; the mapping itself is read off the
        # tensors' addresses and strides (see _vllm_layout).
        vllm_layout = (getattr(cfg, "kv_cache_layout", None)
                       or getattr(self._vllm_config.cache_config, "kv_cache_layout", None))
        m = map_kv_caches(kv_caches, cfg.num_blocks if cfg is not None else None,
                          self._block_size, vllm_layout, self._identity())
        self._map = m
        self._stats["layer_waits"] = [0] * m.layers
        self._stats["layout"] = {"vllm": m.vllm_layout, "kvtier": m.layout,
                                 "page_bytes": m.page_bytes, "layers": m.layers}
        if self._service:
            self._connect_service(m, double)
            return
        rank_dir = self._rank_dir(self._rank)
        name = _model_tail(str(self._vllm_config.model_config.model))
        b = (
            TierBuilder()
            .directory(os.path.join(rank_dir, "pool"))
            .capacity(self._capacity)
            .prewrite(self._prewrite)
            .geometry(layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, dtype=m.dtype,
                      block_size=self._block_size, name=f"vllm:{name}"[:64])
            .namespace(f"vllm/{name}@{m.fingerprint[:16]}/tp{self._rank}")
            .tp_rank(self._rank)
            .engine(self._engine)
            .policy(self._policy)
        )
        aligned = not m.padded and all(r.data_ptr() % 4096 == 0 for r in m.regions)
        if m.padded and self._hbm:
            raise KvtierError(m.padding_fix + " (CUDA caches are copied by kvtier's kernels "
                              "page by page, which needs whole-sector pages)")
        if m.padded:
            logger.warning("kvtier: %s; serving it through staging in %d B slots, %.0f%% of "
                           "the pool is padding", m.padding_fix, m.slot_bytes,
                           100 * (1 - m.page_bytes / m.slot_bytes))
        if self._hbm:
            # kvtier's own pinned staging; the copies only need 16 bytes of
            # alignment, which torch's allocations have.
            b = b.staging(layer_buffers=4, load_blocks=self._staging, store_blocks=self._staging)
            if double:
                b = b.test_only_staged_host_double()
            b = b.kv_memory(m.regions, layout=m.layout)
            aligned = True  # no host staging of the connector's own
        elif aligned:
            b = b.kv_memory(m.regions, layout=m.layout)
        else:
            b = b.host_cache(2 * self._staging, layout="cross_layer")
        try:
            self._tier = b.build()
        except KvtierError as e:
            if "it is in use" in str(e):
                # Several engines on one node (one per GPU, say): the fix is
                # to share the pool, not to stop the other engine.
                raise KvtierError(
                    f"{e}; several vLLM engines on one node share one pool through "
                    "`kvtier serve` (kv_connector_extra_config \"service\" instead of "
                    "\"pool_dir\"), or give each engine its own pool_dir") from e
            if "namespace" not in str(e):
                raise
            raise KvtierError(
                f"{e}: this pool_dir holds KV of another model, cache layout, TP layout or an "
                f"older kvtier (pools from before the layout fingerprint, 2026-11-27, are not "
                f"reused); give this engine its own pool_dir, or delete {rank_dir}/pool to "
                "start it over") from e
        self._stats["staged"] = not aligned
        self._stats["hbm"] = ("cuda" if self._cuda else "host double") if self._hbm else None
        if not aligned:
            addr, size = self._tier.host_memory()
            self._stage_owner = (ctypes.c_char * size).from_address(addr)
            # Staging slot s holds block pages in kvtier's cross-layer order:
            # [slot, layer, page bytes], the same bytes the pages hold.
            self._stage = torch.frombuffer(self._stage_owner, dtype=torch.uint8).view(
                2 * self._staging, m.layers, m.slot_bytes)[:, :, : m.page_bytes]
            self._free_load = list(range(self._staging))
            self._free_store = list(range(self._staging, 2 * self._staging))
            logger.info(
                "kvtier: vLLM's KV cache is not 4096-byte aligned (%#x); staging through "
                "%d page-aligned blocks (%d MiB)", m.regions[0].data_ptr(), 2 * self._staging,
                (2 * self._staging * m.layers * m.slot_bytes) >> 20)
        self._server = LookupServer(socket_name(rank_dir), self._tier, logger)
        logger.info("kvtier: rank %d pool %s, engine %s, %s", self._rank, rank_dir,
                    self._tier.engine, m.describe())

    def _connect_service(self, m: KvMapping, double: bool) -> None:
        """The worker's side over ``kvtier serve``: the service's shared
        memory is the staging (loads land in it, stores read it), copied per
        layer from and into vLLM's own pages; for CUDA caches by kvtier's
        staged GPU path (the copies on this process's copy stream, each
        layer's copy waited for on the GPU, as with a pool of its own). No
        lookup socket: the scheduler asks the service. The pool's geometry
        is this rank's shard (``m``: the tensors vLLM gave this worker)."""
        if self._hbm:
            self._connect_service_hbm(m, double)
            return
        # The service's pool, checked (by the library) to serve this geometry
        # (a padded page's slot: `kvtier serve --model` pads an MLA latent's
        # objects the same way, `mla_head_dim` in src/model.rs).
        h = (
            TierBuilder()
            .service(self._service, blocks=2 * self._staging)
            .geometry(layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, dtype=m.dtype,
                      block_size=self._block_size, name="vllm")
            .build()
        )
        if 2 * h.geometry["object_bytes"] != m.slot_bytes:
            h.close()
            raise KvtierError(
                f"the kvtier service at {self._service} stores {2 * h.geometry['object_bytes']} B "
                f"per block and layer, but this engine's KV pages are {m.page_bytes} B"
                + (f" (in {m.slot_bytes} B slots: {m.padding_fix})" if m.padded else "")
            )
        self._tier = h
        addr, size = h.host_memory()
        per_layer = size // m.layers
        self._stage_owner = (ctypes.c_char * size).from_address(addr)
        # The service's memory is per layer (blocks, K|V slot); the staging
        # is indexed [slot, layer] as the connector's own, a page's bytes at
        # the start of its slot.
        self._stage = (torch.frombuffer(self._stage_owner, dtype=torch.uint8)
                       .view(m.layers, per_layer)[:, : 2 * self._staging * m.slot_bytes]
                       .view(m.layers, 2 * self._staging, m.slot_bytes)[:, :, : m.page_bytes]
                       .permute(1, 0, 2))
        self._free_load = list(range(self._staging))
        self._free_store = list(range(self._staging, 2 * self._staging))
        self._stats["staged"] = True
        self._stats["service"] = self._service
        logger.info("kvtier: rank %d of %d on the kvtier service %s (engine %s, namespace %s), "
                    "%s", self._rank, self._tp_size, self._service, h.engine, h.namespace,
                    m.describe())

    def _my_keys(self, keys: list[bytes]) -> list[bytes]:
        """The keys of this rank's shard of the blocks ``keys`` name."""
        return rank_keys(keys, self._rank, self._tp_size) if self._service else keys

    def _done_with(self, ld: _Load, n: int) -> None:
        """This rank is done with load ``ld`` (``n`` blocks were pinned for
        it here): its pins go. Over a service they are the scheduler's, so
        the scheduler is told; else this worker's pool holds them."""
        if self._service:
            self._ev_loaded.append((ld.load_id, self._rank))
        elif n:
            self._tier.unpin(ld.keys[:n])

    def _gone(self, e: ClosedError) -> None:
        """The kvtier service connection is gone: said once; until a new one
        (`_reconnect`), every load and store of this worker is a miss."""
        if self._link.went_away():
            logger.warning("kvtier: %s; this worker's loads and stores are misses until the "
                           "kvtier service answers again (tried every %.0f s)", e,
                           self._link.every_s)

    def _reconnect(self) -> None:
        """Over a service that went away: connect again, every
        ``service_reconnect_s``, once none of the old connection's jobs is
        left here (their staging slots and results belong to it)."""
        if not self._link.gone or self._inflight or self._store_jobs or not self._link.due():
            return
        old = self._tier
        try:
            self._connect_service(self._map, self._double)
        except (KvtierError, OSError) as e:
            self._tier = old
            logger.debug("kvtier: the kvtier service does not answer yet: %s", e)
            return
        logger.info("kvtier: rank %d connected to the kvtier service %s again after %.1f s",
                    self._rank, self._service, self._link.back())
        if old is not None:
            try:
                old.close()
            except KvtierError:
                pass

    def _wait_job(self, job: int, keys: list[bytes]) -> Any:
        """Job ``job``'s result (its keys: ``keys``); once the service is
        gone, every key failed."""
        try:
            return self._tier.wait(job)
        except ClosedError as e:
            self._gone(e)
            return _GoneResult(list(keys), e)

    def _flush(self) -> None:
        try:
            self._tier.flush_stores()
        except ClosedError as e:
            self._gone(e)

    def _connect_service_hbm(self, m: KvMapping, double: bool) -> None:
        """CUDA KV caches (or, with the test double, CPU tensors posing as
        them) over ``kvtier serve``: the memory the service shares is the
        staged path's staging, registered as pinned in this process; vLLM's
        tensors are the KV memory, loaded into and stored from directly."""
        if m.padded:
            raise KvtierError(m.padding_fix + " (CUDA caches are copied by kvtier's kernels "
                              "page by page, which needs whole-sector pages)")
        # The service's pool, checked (by the library) to serve this geometry;
        # its staging block counts follow the blocks the service shares.
        b = (
            TierBuilder()
            .service(self._service)
            .geometry(layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim, dtype=m.dtype,
                      block_size=self._block_size, name="vllm")
            .staging(layer_buffers=4)
        )
        if double:
            b = b.test_only_staged_host_double()
        self._tier = b.kv_memory(m.regions, layout=m.layout).build()
        self._stats["staged"] = False
        self._stats["hbm"] = "cuda" if self._cuda else "host double"
        self._stats["service"] = self._service
        logger.info("kvtier: rank %d of %d on the kvtier service %s (engine %s, namespace %s, GPU "
                    "KV memory through its shared staging), %s", self._rank, self._tp_size,
                    self._service, self._tier.engine, self._tier.namespace, m.describe())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        if self._service:
            self._reconnect()
        if self._tier is None:
            for ld in meta.loads:
                self._done_with(ld, 0)
            return
        for ld in meta.loads:
            n = min(ld.pinned[self._rank], len(ld.keys))
            # Blocks the scheduler matched but could not pin here were evicted
            # in between: vLLM recomputes or fails them (kv_load_failure_policy).
            self._load_errors.update(ld.block_ids[n:])
            if n == 0:
                self._done_with(ld, 0)
                continue
            slots = None
            if self._stage is not None:
                if len(self._free_load) < n:
                    self._load_errors.update(ld.block_ids[:n])
                    self._done_with(ld, n)
                    continue
                slots = [self._free_load.pop() for _ in range(n)]
            try:
                job = self._tier.submit_load(self._my_keys(ld.keys[:n]),
                                             slots if slots is not None else ld.block_ids[:n])
            except KvtierError as e:
                logger.warning("kvtier: load of %d blocks for %s refused: %s", n, ld.req_id, e)
                self._load_errors.update(ld.block_ids[:n])
                self._done_with(ld, n)
                if slots:
                    self._free_load.extend(slots)
                continue
            self._inflight.append(_InflightLoad(job, ld, slots, ld.block_ids[:n]))

    def _finish_layer(self, ld: "_InflightLoad", layer: int) -> None:
        if layer in ld.done:
            return
        ld.done.add(layer)
        # (Not once the job's result is taken after a failed layer: the job
        # is gone from the tier and every later layer is handled below.)
        if self._cuda and ld.result is None and self._tier.stream_wait_layer(
                ld.job, layer, torch.cuda.current_stream().cuda_stream):
            # The layer's bytes are read and verified and its copy is
            # queued: the compute stream waits for the copy on the GPU. (A
            # failed layer answers False and is handled below.)
            self._count(self._stats, "stream_waits", 1)
            return
        ok = ld.block_ids
        slots = ld.slots
        failed = ld.result is not None  # the job ended early: a layer failed
        if not failed:
            try:
                self._tier.wait_layer(ld.job, layer)
            except KvtierError as e:
                # Some block of the layer failed (corrupt, unreadable). Which
                # ones the job's result says: wait for it (this step only, and
                # only on a failure) so that exactly those blocks are reported
                # to vLLM and the others, whose attention runs next, get their
                # bytes (every layer of the job is in once it has ended).
                logger.warning("kvtier: layer %d of %s failed to load: %s", layer,
                               ld.load.req_id, e)
                ld.result = self._wait_job(ld.job, ld.load.keys[:len(ld.block_ids)])
                failed = True
        if failed:
            r = ld.result
            good = [i for i, err in enumerate(r.errors) if err is None]
            ok = [ld.block_ids[i] for i in good]
            slots = [ld.slots[i] for i in good] if ld.slots is not None else None
        if slots is not None and ok:
            _copy_rows(self._map.pages[layer], ok, self._stage[:, layer], slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._map.layer_of.get(layer_name) if self._map is not None else None
        if layer is None or not self._inflight:
            return
        self._stats["layer_waits"][layer] += 1
        t0 = time.monotonic()
        try:
            self._wait_layer_all(layer)
        finally:
            self._count(self._stats, "layer_waits_total", 1)
            self._count(self._stats, "layer_wait_s", time.monotonic() - t0)

    def _wait_layer_all(self, layer: int) -> None:
        for ld in self._inflight:
            self._finish_layer(ld, layer)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are freed and reused: direct stores
        # still reading them must finish first (staged ones copied already).
        if self._tier is None or not isinstance(kv_connector_metadata, KvtierConnectorMetadata):
            return
        waiting = [j for j, (_, r) in self._store_jobs.items()
                   if r is not None and r in kv_connector_metadata.preempted]
        if waiting:
            self._flush()  # the slack and sync policies may hold them
        for job in waiting:
            _, req_id = self._store_jobs[job]
            self._wait_job(job, [])
            del self._store_jobs[job]
            self._store_reqs[req_id] -= 1

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # kvtier stores whole blocks (every layer's K and V in one object
        # group): the store is submitted in wait_for_save, once the last
        # layer of the step is written.
        return

    def _reap_stores(self) -> None:
        for job in list(self._store_jobs):
            try:
                r = self._tier.try_result(job)
            except ClosedError as e:
                self._gone(e)
                r = _GoneResult([], e)
            if r is None:
                continue
            slots, req_id = self._store_jobs.pop(job)
            if slots is not None:
                self._free_store.extend(slots)
            if req_id is not None:
                self._store_reqs[req_id] -= 1
            if not r.ok:
                logger.warning("kvtier: store job %d failed: %s", job, r)
            self._ev_stored += [k for k, o in zip(r.keys, r.outcomes) if o == "done"]
            self._ev_removed += list(r.evicted)

    def wait_for_save(self) -> None:
        if self._tier is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        # Loads: every layer of this step's loads is in by now; take the
        # per-key outcomes, drop the scheduler's pins, free the staging.
        for ld in self._inflight:
            if not self._cuda:
                for layer in range(self._map.layers):
                    self._finish_layer(ld, layer)
            r = ld.result or self._wait_job(ld.job, ld.load.keys[:len(ld.block_ids)])
            bad = [bid for bid, err in zip(ld.block_ids, r.errors) if err is not None]
            corrupt = [k for k, o in zip(r.keys, r.outcomes) if o == "corrupt"]
            self._ev_removed += corrupt
            self._load_errors.update(bad)
            if bad:
                self._count(self._stats, "corrupt_blocks", len(corrupt))
                logger.warning("kvtier: %d of %d blocks of %s failed to load (%d corrupt, "
                               "dropped from the pool); vLLM recomputes them and kvtier stores "
                               "them again", len(bad), len(ld.block_ids), ld.load.req_id,
                               len(corrupt))
            good = len(ld.block_ids) - len(bad)
            self._count(self._stats, "loaded_blocks", good)
            self._count(self._stats, "loaded_bytes", good * self._map.block_bytes)
            self._done_with(ld.load, len(ld.block_ids))
            if ld.slots is not None:
                self._free_load.extend(ld.slots)
        self._inflight = []
        self._reap_stores()
        if self._cuda and meta.stores:
            # kvtier gathers the blocks on its own stream: the forward that
            # wrote them on the compute stream must be done first.
            torch.cuda.current_stream().synchronize()
        for st in meta.stores:
            self._store(st)
        _write_stats(f"{self._stats_path}.tp{self._rank}" if self._stats_path else None,
                     self._stats)

    def _store(self, st: _Store) -> None:
        # The scheduler holds this request's blocks until it is reported
        # here, stored or dropped.
        self._store_reqs.setdefault(st.req_id, 0)
        n = len(st.keys)
        slots = None
        if self._stage is not None:
            # Back-pressure: the blocks that do not fit the free staging are
            # dropped (a future miss, not an error); the keys are a chain, so
            # the prefix that fits is the part worth keeping.
            fit = min(n, len(self._free_store))
            self._count(self._stats, "stores_dropped", n - fit)
            if fit == 0:
                return
            if fit < n:
                st = _Store(st.req_id, st.keys[:fit], st.block_ids[:fit])
                n = fit
            slots = [self._free_store.pop() for _ in range(n)]
            for layer, pages in enumerate(self._map.pages):
                _copy_rows(self._stage[:, layer], slots, pages, st.block_ids)
        try:
            job = self._tier.submit_store(self._my_keys(st.keys),
                                          slots if slots is not None else st.block_ids)
        except (BackpressureError, ClosedError) as e:
            if isinstance(e, ClosedError):
                self._gone(e)
            self._count(self._stats, "stores_dropped", n)
            if slots:
                self._free_store.extend(slots)
            return
        self._count(self._stats, "stored_blocks", n)
        self._count(self._stats, "stored_bytes", n * self._map.block_bytes)
        # Staged stores copied the blocks already; direct ones read vLLM's
        # own blocks, which stay allocated until the job is done. The HBM
        # path counts as direct: it gathers a store's chunks as its store
        # staging frees, so later chunks read vLLM's blocks after this call.
        direct = slots is None
        self._store_jobs[job] = (slots, st.req_id if direct else None)
        self._store_reqs[st.req_id] = self._store_reqs.get(st.req_id, 0) + int(direct)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._tier is None:
            return None, None
        self._reap_stores()
        self._sending |= {r for r in finished_req_ids if r in self._store_reqs}
        done = {r for r in self._sending if self._store_reqs.get(r, 0) == 0}
        if len(done) < len(self._sending) and self._policy == "sync":
            # Finished requests wait on direct stores the sync policy holds
            # until a flush: issue them, or their blocks are never freed.
            self._flush()
        self._sending -= done
        for r in done:
            self._store_reqs.pop(r, None)
        return (done or None), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not (self._ev_stored or self._ev_removed or self._ev_loaded):
            return None
        meta = KvtierWorkerMetadata(self._ev_stored, self._ev_removed, self._ev_loaded)
        self._ev_stored, self._ev_removed, self._ev_loaded = [], [], []
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        self._count(self._stats, "load_error_blocks", len(errs))
        return errs

    def shutdown(self) -> None:
        if getattr(self, "_svc", None) is not None:
            self._svc.close()
            self._svc = None
        if getattr(self, "_server", None) is not None:
            self._server.close()
            self._server = None
        if getattr(self, "_tier", None) is not None:
            tier, self._tier = self._tier, None
            try:
                tier.close()
            except ClosedError:
                pass  # the service went first: its jobs ended with it
        if getattr(self, "_stats", None) is not None:
            _write_stats(f"{self._stats_path}.tp{self._rank}" if self._stats_path else None,
                         self._stats)


# The secondary tier lives in kvtier.vllm_tier; `"module_path": "kvtier.vllm"`
# in a secondary_tiers entry keeps finding it here.
from .vllm_tier import KvtierTier  # noqa: E402,F401
