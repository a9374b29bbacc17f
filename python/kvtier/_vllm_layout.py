"""How a vLLM KV cache's physical bytes map onto kvtier's objects.

vLLM (0.32) hands a connector one view per attention layer, logically
``[B, H, N, C]`` (kernel blocks, head slots, states, content), whose strides
follow the KV cache layout the engine resolved (``KVCacheLayout``: LBHNC,
LBNHC, BLHNC, ... and the backend's choice among them). Nothing here guesses
from a shape: the mapping is read off the tensors' own addresses and strides
and checked against what kvtier can address.

kvtier moves each block's bytes as they lie in memory. A block of one layer
(its *page*: every head, token and content byte of that block) is two kvtier
objects, the page's first and second half, whatever the page holds (K and V
interleaved per head on the CPU backend, an MLA latent, K then V). So:

- layer-outermost layouts (LBHNC, LBNHC; LHBNC when H is 1): each layer is
  one region of pages, block after block: kvtier's ``block_major`` layout;
- block-outermost layouts (BLHNC, BLNHC; BHLNC when H is 1): every layer's
  page of a block lies together: kvtier's ``cross_layer`` layout;
- anything else (a page split into runs per head, padded pages) is refused
  at start with the layout's name and a fix.

The pool's namespace carries a fingerprint of the physical layout (and the
model), so a pool never hands bytes laid out one way to an engine that lays
them out another.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from . import KvtierError

# Bump when the bytes kvtier stores for the same vLLM layout change meaning.
MAPPING_VERSION = 1

_DTYPES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.uint8: "fp8",
    torch.int8: "fp8",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8_e5m2",
}


@dataclass
class KvMapping:
    """vLLM's KV tensors as kvtier sees them."""

    layout: str
    """kvtier's memory layout: "block_major" (a region per layer) or "cross_layer"."""
    layer_names: list[str]
    """The layer of each kvtier layer index (one per distinct KV tensor)."""
    layer_of: dict[str, int]
    """Every layer name vLLM passed, aliases of a shared KV cache included."""
    regions: list[torch.Tensor]
    """Flat byte views kvtier registers: one per layer, or one for all."""
    pages: list[torch.Tensor]
    """Per kvtier layer, a ``(num_blocks, page_bytes)`` byte view of the pages."""
    num_blocks: int
    page_bytes: int
    """Bytes of one block of one layer in vLLM's memory."""
    slot_bytes: int
    """Bytes kvtier keeps for a page: ``page_bytes`` or, when that is not two
    whole sectors, the next size that is (the page then goes through staging)."""
    padding_fix: str | None
    """When pages are padded: why, and the block size that avoids it."""
    kv_heads: int
    head_dim: int
    dtype: str
    vllm_layout: str
    fingerprint: str

    @property
    def layers(self) -> int:
        return len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer's page, as vLLM holds it."""
        return self.layers * self.page_bytes

    @property
    def padded(self) -> bool:
        return self.slot_bytes != self.page_bytes

    def describe(self) -> str:
        pad = f" in {self.slot_bytes} B slots" if self.padded else ""
        return (f"{self.layers} layers x {self.num_blocks} blocks of {self.page_bytes} B pages"
                f"{pad} (vLLM layout {self.vllm_layout}, kvtier {self.layout})")


def kvtier_dtype(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        raise KvtierError(
            f"vLLM's KV cache dtype {dtype} has no kvtier equivalent; kvtier stores "
            f"{', '.join(sorted(set(_DTYPES.values())))} caches (set kv_cache_dtype accordingly)"
        )
    return name


def _dense_span(t: torch.Tensor) -> bool:
    """Whether dims 1.. of ``t`` cover one contiguous run of elements."""
    dims = sorted((t.stride(d), t.shape[d]) for d in range(1, t.dim()) if t.shape[d] != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True


def _byte_view(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """A uint8 view of ``t``'s storage from ``t``'s first byte."""
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return torch.as_strided(raw, size, stride)


def map_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int | None,
    block_size: int,
    vllm_layout: str | None = None,
    identity: dict[str, Any] | None = None,
) -> KvMapping:
    """Maps vLLM's per-layer KV views onto kvtier objects, or refuses.

    ``num_blocks``: the engine's KV blocks (``KVCacheConfig.num_blocks``);
    None takes dim 0 of the tensors. ``block_size``: tokens per block of the
    cache manager (a block may hold several kernel blocks). ``identity``:
    facts about the model and engine hashed into the fingerprint.
    """
    if not kv_caches:
        raise KvtierError("vLLM registered no KV tensors: the model has no attention KV cache "
                          "for kvtier to serve")
    # Layers that share another layer's KV cache (vLLM's cross-layer KV
    # sharing) pass the same tensor under another name: one kvtier layer.
    layer_names: list[str] = []
    layer_of: dict[str, int] = {}
    tensors: list[torch.Tensor] = []
    seen: dict[tuple, int] = {}
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise KvtierError(f"KV cache of {name} is a {type(t).__name__}, not a tensor")
        ident = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            layer_of[name] = seen[ident]
            continue
        seen[ident] = len(tensors)
        layer_of[name] = len(tensors)
        layer_names.append(name)
        tensors.append(t)
    t0 = tensors[0]
    for name, t in zip(layer_names, tensors):
        if (t.shape, t.stride(), t.dtype, t.device) != (t0.shape, t0.stride(), t0.dtype, t0.device):
            raise KvtierError(
                f"KV tensors differ between layers: {layer_names[0]} is {tuple(t0.shape)} "
                f"{t0.dtype} strides {t0.stride()}, {name} is {tuple(t.shape)} {t.dtype} strides "
                f"{t.stride()}; kvtier serves one KV cache group of identical attention layers "
                "(models mixing attention kinds or sizes are not served)"
            )
    if t0.dim() < 2:
        raise KvtierError(f"KV tensor {layer_names[0]} has shape {tuple(t0.shape)}; vLLM's "
                          "per-layer KV view is [blocks, heads, tokens, content]")
    esz = t0.element_size()
    dtype = kvtier_dtype(t0.dtype)
    nb = num_blocks if num_blocks is not None else t0.shape[0]
    if nb <= 0 or t0.shape[0] % nb:
        raise KvtierError(
            f"KV tensor {layer_names[0]} has {t0.shape[0]} blocks in dim 0, not a multiple of "
            f"the engine's {nb} KV blocks"
        )
    ratio = t0.shape[0] // nb  # kernel blocks per cache-manager block
    layout_name = vllm_layout or "unknown"
    kpage = math.prod(t0.shape[1:])  # elements of one kernel block's page
    if not _dense_span(t0) or (ratio > 1 and t0.stride(0) != kpage):
        raise KvtierError(
            f"vLLM's KV cache layout {layout_name} splits a block's page of layer "
            f"{layer_names[0]} into separate runs (shape {tuple(t0.shape)}, strides "
            f"{t0.stride()}); kvtier moves each block's page as one run: use a layout whose "
            "blocks' [heads, tokens, content] are contiguous (VLLM_KV_CACHE_LAYOUT=LBNHC, "
            "LBHNC, BLNHC or BLHNC where the attention backend supports it)"
        )
    page = ratio * kpage * esz  # bytes of one block of one layer
    bstride = ratio * t0.stride(0) * esz
    bases = [t.data_ptr() for t in tensors]
    nl = len(tensors)
    if bstride == page:
        layout = "block_major"
        regions = [_byte_view(t, (nb * page,), (1,)) for t in tensors]
        order = list(range(nl))
    else:
        # Block-outermost: every layer's page of a block lies together. The
        # kvtier layer index is the page's place inside the block.
        order = sorted(range(nl), key=lambda i: bases[i])
        lo = bases[order[0]]
        if bstride != nl * page or [bases[i] - lo for i in order] != [k * page for k in range(nl)]:
            raise KvtierError(
                f"vLLM's KV cache layout {layout_name} puts block b of a layer at {bstride} B "
                f"strides with {page} B pages, layers at offsets "
                f"{sorted(b - lo for b in bases)[:4]}...; kvtier serves layers of dense pages "
                "(LBNHC, LBHNC) or blocks holding every layer's page once (BLNHC, BLHNC), not "
                "padded or shared pages: set VLLM_KV_CACHE_LAYOUT to one of those"
            )
        layout = "cross_layer"
        regions = [_byte_view(tensors[order[0]], (nb * nl * page,), (1,))]
    layer_names = [layer_names[i] for i in order]
    tensors = [tensors[i] for i in order]
    remap = {old: new for new, old in enumerate(order)}
    layer_of = {n: remap[i] for n, i in layer_of.items()}
    pages = [_byte_view(t, (nb, page), (bstride, 1)) for t in tensors]
    # Two objects per page: each half is block_size x kv_heads x head_dim
    # elements, in whole 4096-byte sectors (direct I/O). A page that does not
    # halve into sectors (an MLA latent at 16-token blocks: 18432 B) gets a
    # padded slot, copied through kvtier's staging; nothing is read into or
    # written from vLLM's own memory directly then.
    tok = page // block_size if page % block_size == 0 else 0
    unit = math.lcm(8192, 2 * block_size * esz)
    slot = -(-page // unit) * unit
    per_token = slot // (2 * block_size * esz)  # elements per token in each half
    heads = t0.shape[1] if t0.dim() >= 4 and per_token % t0.shape[1] == 0 else 1
    fix = (f"a block of this model's KV cache is {page} B per layer ({block_size} tokens"
           + (f" x {tok} B" if tok else "") + "); kvtier stores a page as two objects of whole "
           "4096-byte sectors (direct I/O), so a page it moves without staging must be a "
           "multiple of 8192 B")
    if tok:
        fix += (": use a block_size (vLLM: --block-size) that is a multiple of "
                f"{8192 // math.gcd(8192, tok)}")
    logical = [int(x) for x in t0.shape[1:]]
    inner_order = sorted(range(1, t0.dim()), key=lambda d: -t0.stride(d))
    fp_src = {
        "mapping": MAPPING_VERSION,
        "vllm_layout": layout_name,
        "kvtier_layout": layout,
        "page_bytes": page,
        "slot_bytes": slot,
        "kernel_blocks_per_block": ratio,
        "page_shape": logical,
        "page_order": inner_order,
        "dtype": str(t0.dtype),
        "layers": nl,
        "block_size": block_size,
        **(identity or {}),
    }
    text = json.dumps(fp_src, sort_keys=True, default=str)
    return KvMapping(
        layout=layout,
        layer_names=layer_names,
        layer_of=layer_of,
        regions=regions,
        pages=pages,
        num_blocks=nb,
        page_bytes=page,
        slot_bytes=slot,
        padding_fix=fix if slot != page else None,
        kv_heads=heads,
        head_dim=per_token // heads,
        dtype=dtype,
        vllm_layout=layout_name,
        fingerprint=hashlib.sha256(text.encode()).hexdigest(),
    )
