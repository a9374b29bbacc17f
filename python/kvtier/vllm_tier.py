"""vLLM's secondary offloading tier over a kvtier pool (``KvtierTier``).

vLLM's KV offloading runs tiers below its CPU primary tier in the scheduler
process; this one keeps the primary's chunks in a kvtier pool. Configure it
as a ``secondary_tiers`` entry with ``"module_path": "kvtier.vllm"`` (which
re-exports it) or ``"kvtier.vllm_tier"``. The connector is ``kvtier.vllm``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from . import BackpressureError, KvtierError, TierBuilder

logger = init_logger(f"vllm.{__name__}")


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary offloading tier over a kvtier pool.

    vLLM runs it in the scheduler process, beside the CPU primary tier, and
    passes ``primary_kv_view``: (num_chunks, chunk_bytes) over the primary's
    shared memory. That memory is page aligned, so it is registered with
    kvtier as it is (one kvtier block per primary chunk): stores read a
    chunk and loads write one by DMA, with no copy and no thread of ours.

    Every method returns at once: ``submit_store``/``submit_load`` queue
    kvtier jobs, ``get_finished_jobs`` collects what finished. Back-pressure:
    when kvtier's store backlog is full (``backlog_limit_blocks``) a store
    is refused whole (BackpressureError), reported as a failed job, and
    counted with the detector's policy when one is configured.

    Config (``secondary_tiers`` entry): ``{"type": "KvtierTier",
    "module_path": "kvtier.vllm", "pool_dir": ..., "capacity": "64g",
    "engine": "auto", "backlog_limit_blocks": N}``.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        pool_dir: str | None = None,
        capacity: int | str = "4g",
        engine: str = "auto",
        policy: str = "naive",
        backlog_limit_blocks: int | None = None,
        backpressure_detector: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not pool_dir:
            raise ValueError("KvtierTier needs 'pool_dir' in its secondary_tiers entry")
        if kwargs:
            logger.warning("KvtierTier: ignoring unknown parameters %s", sorted(kwargs))
        chunk = self.block_size_bytes
        if chunk % 8192:
            # vLLM rounds a chunk up to a 4 KiB page; kvtier's direct I/O moves
            # a block as two halves of whole 4 KiB sectors, and the primary's
            # chunks are registered where they lie (no room to pad them).
            per_chunk = getattr(offloading_spec, "blocks_per_chunk", None)
            tokens = getattr(offloading_spec, "tokens_per_block", None)
            now = (f" (now {per_chunk} GPU block(s) of {tokens[0]} tokens per chunk)"
                   if per_chunk and tokens else "")
            raise ValueError(
                f"KvtierTier: vLLM's offloaded chunks are {chunk} B, an odd number of 4 KiB "
                "pages; kvtier stores a chunk as two halves of whole 4 KiB sectors (direct "
                "I/O), so a chunk must be a multiple of 8192 B: double the OffloadingConnector's "
                f"kv_connector_extra_config 'block_size' (tokens per offloaded chunk){now}")
        b = (
            TierBuilder()
            .directory(os.path.join(pool_dir, "pool"))
            .capacity(capacity)
            .opaque_chunks(chunk, name=f"vllm-offload-chunk-{chunk}")
            .engine(engine)
            .policy(policy)
            .kv_memory([primary_kv_view], layout="cross_layer")
        )
        if backlog_limit_blocks is not None:
            b = b.backlog_limit_blocks(int(backlog_limit_blocks))
        self._tier = b.build()
        # kvtier job -> (vLLM job id, vLLM keys, is_promotion, submit time)
        self._jobs: dict[int, tuple[int, list[OffloadKey], bool, float]] = {}
        self._done: list[JobResult] = []
        self.stores_refused = 0

    @staticmethod
    def _key(key: OffloadKey) -> bytes:
        # vLLM's key (block hash + group index) can exceed kvtier's 32 bytes.
        return hashlib.sha256(key).digest()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self._tier.contains(self._key(key)) else LookupResult.MISS

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys = list(job.keys)
        kk = [self._key(k) for k in keys]
        chunks = [int(c) for c in job.chunk_ids]
        try:
            if store:
                kj = self._tier.submit_store(kk, chunks)
            else:
                kj = self._tier.submit_load(kk, chunks)
        except BackpressureError as e:
            if store:
                self.stores_refused += len(keys)
                if self.bp_detector is not None:
                    self.bp_detector.policy.on_store_skipped(len(keys))
            else:
                # Loads meet back-pressure only from a full job table.
                logger.warning("kvtier tier: load %d refused: %s", job.job_id, e)
            self._done.append(JobResult(job_id=job.job_id, success=False))
            return
        except KvtierError as e:
            logger.warning("kvtier tier: job %d refused: %s", job.job_id, e)
            self._done.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[kj] = (job.job_id, keys, not store, time.monotonic())

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def _result(self, r: Any) -> JobResult | None:
        entry = self._jobs.pop(r.job, None)
        if entry is None:
            return None
        job_id, keys, promotion, t0 = entry
        ok = [e is None for e in r.errors]
        return JobResult(
            job_id=job_id,
            success=all(ok),
            successful_keys=[k for k, g in zip(keys, ok) if g] if promotion and not all(ok) else None,
            transfer_time=time.monotonic() - t0,
            transfer_bytes=len(keys) * self.block_size_bytes,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done = self._done, []
        for r in self._tier.get_finished():
            jr = self._result(r)
            if jr is not None:
                out.append(jr)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        # Stores still in kvtier's backlog (the slack and sync policies hold
        # them) are issued first, or waiting for them would never end.
        self._tier.flush_stores()
        for kj in list(self._jobs):
            jr = self._result(self._tier.wait(kj))
            if jr is not None:
                self._done.append(jr)

    def shutdown(self) -> None:
        if self._tier is not None:
            self.drain_jobs()
            self._tier.close()
