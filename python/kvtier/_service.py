"""torch views of the KV memory a client shares with `kvtier serve`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ._kvtier import TierHandle


def service_tensors(handle: TierHandle) -> list[torch.Tensor]:
    """One CPU tensor per layer over the memory `handle` shares with the
    service, shaped ``(blocks, 2, block_size, kv_heads, head_dim)`` (K then V
    of each block: vLLM's CPU KV layout), page-aligned and in shared memory:
    the service reads stores from and loads into exactly these bytes. Each
    tensor keeps the mapping alive. Block ``b`` of every layer is the block
    number ``b`` that ``submit_store`` / ``submit_load`` take."""
    import torch

    g = handle.geometry
    dtype = getattr(torch, g["dtype"])
    shape = (handle.memory_blocks, 2, g["block_size"], g["kv_heads"], g["head_dim"])
    out = []
    for layer in range(g["layers"]):
        raw = torch.frombuffer(handle.layer_region(layer), dtype=torch.uint8)
        out.append(raw.view(dtype).view(shape))
    return out
