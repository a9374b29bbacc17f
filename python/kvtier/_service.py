"""torch views of the KV memory a client shares with `kvtier serve`, and
the timing of an adapter's connection to it (`ServiceLink`)."""

from __future__ import annotations

import time
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


class ServiceLink:
    """When an adapter's connection to `kvtier serve` went away and when to
    try again: the vLLM worker and LMCache's L2 both serve misses while it
    is gone and connect again every ``every_s`` seconds, once the old
    connection's jobs have drained (theirs to check)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = float(every_s)
        self._gone_at: float | None = None
        self._tried = 0.0
        self._given_up = False

    @property
    def gone(self) -> bool:
        """The connection went away (or was given up) and no new one is up."""
        return self._gone_at is not None or self._given_up

    @property
    def given_up(self) -> bool:
        return self._given_up

    def went_away(self) -> bool:
        """Note the connection gone; True the first time (to say it once)."""
        if self.gone:
            return False
        self._gone_at = self._tried = time.monotonic()
        return True

    def due(self) -> bool:
        """``every_s`` has passed since the last try (or the going away):
        True, and this call counts as the next try."""
        now = time.monotonic()
        if self._given_up or now - self._tried < self.every_s:
            return False
        self._tried = now
        return True

    def back(self) -> float:
        """A new connection is up: the seconds it was gone."""
        since = time.monotonic() - (self._gone_at or time.monotonic())
        self._gone_at = None
        return since

    def give_up(self) -> None:
        """No new connection will do (said by the caller): stop trying."""
        self._given_up = True
