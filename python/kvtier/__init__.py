"""kvtier: a GPU-centric NVMe SSD tier for LLM KV caches, from Python.

Open a pool with :class:`TierBuilder`, get a thread-safe :class:`TierHandle`:

    tier = (kvtier.TierBuilder()
            .directory("/data/kvtier").capacity("64g")
            .model("llama3-8b", block_size=16)
            .kv_memory(layer_tensors)          # or .host_cache(blocks)
            .build())
    n = tier.lookup_and_pin(keys)
    job = tier.submit_load(keys[:n], blocks[:n])
    for layer in range(layers):
        tier.wait_layer(job, layer)            # GIL released while waiting
    tier.wait(job); tier.unpin(keys[:n])

Or share one pool per node with every engine process through the service
(``kvtier serve --socket PATH ...``): ``TierBuilder().service(PATH).build()``
(or its short form ``kvtier.connect(PATH)``) returns a :class:`TierHandle`
with the same methods, over the KV memory the service shares with this
process (``kvtier.service_tensors(handle)``: torch views).

Adapters for serving engines live in :mod:`kvtier.vllm` and
:mod:`kvtier.lmcache` (imported on demand: they need those packages).
"""

from ._kvtier import (
    BackpressureError,
    ClosedError,
    CorruptError,
    Event,
    InternalError,
    IoError,
    JobResult,
    KvtierError,
    ServiceHandle,
    TierBuilder,
    TierHandle,
    UnsupportedError,
    UsageError,
    connect,
    resolve_model,
)
from ._service import service_tensors

__all__ = [
    "BackpressureError",
    "ClosedError",
    "CorruptError",
    "Event",
    "InternalError",
    "IoError",
    "JobResult",
    "KvtierError",
    "ServiceHandle",
    "TierBuilder",
    "TierHandle",
    "UnsupportedError",
    "UsageError",
    "connect",
    "resolve_model",
    "service_tensors",
]
