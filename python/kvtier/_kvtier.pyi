"""Type stubs of the native module (python/src/lib.rs)."""

from collections.abc import Sequence
from os import PathLike
from typing import Any, Literal, Self

Key = bytes | int
"""A content hash of 1 to 32 bytes, or an int in 0..2**64."""

DTypeName = Any
"""A KV dtype: a name ("bfloat16", "float16", "float32", "fp8", "fp8_e5m2")
or a torch dtype (torch.bfloat16, a cache tensor's .dtype)."""

BlockIds = Any
"""Memory block indexes: a sequence of ints, a numpy array or a torch tensor
of ints (a vLLM block table's row)."""

class KvtierError(Exception):
    kind: str
    """usage, backpressure, io, corrupt, unsupported, closed or internal."""
    io: dict[str, Any] | None
    """For device failures: device, offset, len, op, cause."""

class UsageError(KvtierError): ...
class BackpressureError(KvtierError): ...
class IoError(KvtierError): ...
class CorruptError(KvtierError): ...
class UnsupportedError(KvtierError): ...
class ClosedError(KvtierError): ...
class InternalError(KvtierError): ...

class JobResult:
    job: int
    kind: Literal["load", "store"]
    keys: list[bytes]
    outcomes: list[Literal["done", "already_stored", "failed", "corrupt"]]
    errors: list[KvtierError | None]
    evicted: list[bytes]
    @property
    def ok(self) -> bool: ...
    def raise_for_failure(self) -> None: ...

class Event:
    kind: Literal["layer", "finished"]
    job: int
    layer: int | None
    job_kind: Literal["load", "store"] | None
    ok: bool
    error: KvtierError | None

class TierBuilder:
    def __init__(self) -> None: ...
    def files(self, paths: Sequence[str | PathLike[str]]) -> Self: ...
    def directory(self, path: str | PathLike[str], devices: int | None = None) -> Self: ...
    def capacity(self, size: int | str) -> Self: ...
    def group_blocks(self, n: int) -> Self: ...
    def prewrite(self, enabled: bool = True) -> Self: ...
    def create(self, mode: Literal["auto", "always", "never"]) -> Self: ...
    def model(self, spec: str, block_size: int = 16, dtype: DTypeName | None = None) -> Self: ...
    def geometry(self, *, layers: int, kv_heads: int, head_dim: int, dtype: DTypeName,
                 block_size: int, name: str) -> Self: ...
    def opaque_chunks(self, chunk_bytes: int, *, name: str) -> Self:
        """Blocks that are opaque chunks of chunk_bytes (a multiple of 8192), moved as they are."""
    def namespace(self, ns: str) -> Self: ...
    def tp_rank(self, rank: int) -> Self: ...
    def engine(self, name: Literal["auto", "uring", "nvme", "gpu", "gpu-host"]) -> Self: ...
    def policy(self, name: Literal["slack", "naive", "sync"]) -> Self: ...
    def backlog_limit_blocks(self, n: int) -> Self: ...
    def host_cache(self, blocks: int, layout: Literal["cross_layer", "per_layer"] = "cross_layer") -> Self: ...
    def kv_memory(self, tensors: Any, layout: Literal["per_layer", "block_major", "cross_layer"] = "per_layer") -> Self:
        """CPU tensors or buffers (direct I/O: 4096-byte aligned), or CUDA
        tensors (the staged HBM path: 16-byte aligned); contiguous, the KV
        dtype itself or a byte/integer view of it (a float tensor of another
        dtype is refused), every layer the same number of blocks. Never
        resize a registered tensor's storage while the tier is open: kvtier
        would write memory torch freed."""
    def staging(self, layer_buffers: int = 4, load_blocks: int | None = None, store_blocks: int | None = None, store_chunk_blocks: int | None = None) -> Self:
        """Pinned host staging of the staged HBM path (CUDA tensors); stores go
        in chunks of store_chunk_blocks (default: a quarter of store_blocks),
        each gathered while the ones before are written."""
    def test_only_staged_host_double(self) -> Self:
        """TEST DOUBLE: CPU tensors given to kv_memory pose as GPU memory on
        the staged HBM path, the CPU doing the copy kernels' work. Never for serving."""
    def service(self, path: str | PathLike[str], blocks: int = 0, lookup_only: bool = False) -> Self:
        """The node's `kvtier serve` pool instead of one of this process's own;
        its KV memory is the `blocks` blocks the service shares (0: its
        --client-blocks). Pool, engine, policy, namespace and memory calls are
        refused with it (UsageError naming them); model()/geometry() are checked
        against what the service serves. With kv_memory(CUDA tensors) (and
        staging()), the tensors are the KV memory, through the staged GPU path
        whose staging is the memory the service shares (model() required).
        lookup_only=True: lookups, pins and unpins only (an engine's
        scheduler): no memory, no client slot; loads and stores are refused."""
    def build(self) -> TierHandle: ...

class TierHandle:
    """Thread-safe. Not usable in a fork()ed child (UsageError there): open
    tiers in workers started with 'spawn'. A pool of this process's own, or
    the node's service (TierBuilder().service(PATH), kvtier.connect(PATH)):
    the same methods."""
    @property
    def engine(self) -> str: ...
    @property
    def engine_reason(self) -> str: ...
    @property
    def namespace(self) -> str:
        """The pool's key namespace (through a service: the service's pool's)."""
    @property
    def model_name(self) -> str:
        """The model name the pool recorded (through a service: the service's pool's)."""
    @property
    def service(self) -> str | None:
        """The socket of the service serving this handle; None for an own pool."""
    def layer_region(self, layer: int) -> SharedRegion:
        """Through a service: layer `layer` of the memory it shares."""
    @property
    def geometry(self) -> dict[str, Any]: ...
    @property
    def memory_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def memory_device(self) -> str:
        """"cpu" or "cuda:N"."""
    @property
    def staged(self) -> bool:
        """Served through the staged HBM path (CUDA tensors or the host double)."""
    def lookup(self, keys: Sequence[Key]) -> int: ...
    def lookup_and_pin(self, keys: Sequence[Key]) -> int: ...
    def unpin(self, keys: Sequence[Key]) -> None: ...
    def contains(self, key: Key) -> bool: ...
    def remove(self, keys: Sequence[Key]) -> int:
        """Take keys out of the pool (never served again; loads already
        reading them finish); returns how many were held. Not durable alone:
        a pool reopened before a removed block's slot is reused may hold it."""
    def submit_store(self, keys: Sequence[Key], blocks: BlockIds) -> int:
        """BackpressureError when the backlog is full (retry later); UsageError
        for a store larger than the whole backlog (split it). At most 2**22
        keys per call, as for every call that takes keys."""
    def submit_load(self, keys: Sequence[Key], blocks: BlockIds, layers: range | None = None) -> int: ...
    def wait(self, job: int) -> JobResult:
        """Blocks with the GIL released; Python's signal handlers run meanwhile
        (KeyboardInterrupt leaves the job running, its result collectable)."""
    def wait_layer(self, job: int, layer: int) -> None:
        """As wait(), for one layer of a load."""
    def stream_wait_layer(self, job: int, layer: int, stream: int) -> bool:
        """Make CUDA stream `stream` (torch.cuda.current_stream().cuda_stream)
        wait on the GPU until `layer` of load `job` is in memory; False when
        there is no GPU counter (then use wait_layer)."""
    def try_result(self, job: int) -> JobResult | None: ...
    def get_finished(self) -> list[JobResult]:
        """Results of every finished job not yet collected. Collect each job's
        result once (here or with wait): at most 65536 jobs may be running or
        uncollected, past that submits raise BackpressureError."""
    def flush_stores(self) -> None: ...
    def event_fd(self) -> int: ...
    def drain_completions(self) -> list[Event]: ...
    def usage(self) -> dict[str, Any]: ...
    def write_block(self, block: int, data: Any) -> None: ...
    def read_block_into(self, block: int, out: Any) -> None: ...
    def read_block(self, block: int) -> bytes: ...
    def host_memory(self) -> tuple[int, int]: ...
    def close(self) -> None:
        """Issue the write backlog, then stop. A handle dropped without
        close() keeps acknowledged stores but not those still in the backlog."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> bool: ...

class SharedRegion:
    """Writable buffer over part of the memory shared with the service."""
    def __len__(self) -> int: ...

ServiceHandle = TierHandle
"""The name kvtier.connect's handles had; they are TierHandles."""

def connect(path: str | PathLike[str], blocks: int = 0, memory: Literal["cpu"] = "cpu", lookup_only: bool = False) -> TierHandle:
    """TierBuilder().service(path, blocks, lookup_only).build()."""
def resolve_model(spec: str, block_size: int = 16, dtype: DTypeName | None = None) -> tuple[dict[str, Any], str]: ...
def rust_latency(handle: TierHandle, op: Literal["lookup", "store", "load"], keys: Sequence[Key], iters: int, key_base: int) -> int: ...
def _exiting() -> bool:
    """Whether the interpreter has begun exiting (kvtier's atexit hook ran)."""
def _exit_grace(on: bool) -> None:
    """Enter or leave a stretch of an exit handler that waits for threads inside kvtier calls."""
