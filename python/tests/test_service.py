"""kvtier.connect: two Python processes on one `kvtier serve` service.

The service is the `kvtier` binary (conftest's kvtier_service fixture)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kvtier


@pytest.fixture
def service(kvtier_service):
    return kvtier_service(clients=4, client_blocks=32)


def expected(key: int, layer: int, shape) -> torch.Tensor:
    """A block's bytes follow from its key and layer."""
    g = torch.Generator().manual_seed(key * 1000 + layer)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


STORER = r"""
import sys, torch, kvtier
sys.path.insert(0, sys.argv[2])
from test_service import expected
h = kvtier.connect(sys.argv[1])
kv = kvtier.service_tensors(h)
keys = list(range(100, 140))
for start in range(0, len(keys), h.memory_blocks):
    part = keys[start:start + h.memory_blocks]
    for b, k in enumerate(part):
        for layer, t in enumerate(kv):
            t[b].copy_(expected(k, layer, t[b].shape))
    r = h.wait(h.submit_store(part, list(range(len(part)))))
    assert r.ok, r
print("STORED", flush=True)
sys.stdin.readline()
h.close()
"""


def test_two_processes_share_stored_blocks_layer_by_layer(service):
    sock, _ = service
    storer = subprocess.Popen(
        [sys.executable, "-c", STORER, str(sock), str(pathlib.Path(__file__).parent)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert storer.stdout.readline().strip() == "STORED"
        # The storer is still connected while this process loads its blocks.
        with kvtier.connect(sock) as h:
            kv = kvtier.service_tensors(h)
            assert kv[0].shape == (32, 2, 16, 2, 64) and kv[0].dtype == torch.bfloat16
            assert kv[0].data_ptr() % 4096 == 0
            keys = list(range(100, 140))
            assert h.lookup(keys) == 40
            part = keys[:32]
            assert h.lookup_and_pin(part) == 32
            blocks = list(reversed(range(32)))
            job = h.submit_load(part, blocks)
            for layer, t in enumerate(kv):
                h.wait_layer(job, layer)
                for k, b in zip(part, blocks):
                    assert torch.equal(t[b], expected(k, layer, t[b].shape)), (k, layer)
            assert h.wait(job).ok
            h.unpin(part)
            assert h.lookup(list(range(1000, 1004))) == 0
        storer.stdin.write("\n")
        storer.stdin.flush()
        assert storer.wait(timeout=30) == 0
    finally:
        storer.kill()


def test_misuse_is_refused_clearly(service):
    sock, _ = service
    with pytest.raises(kvtier.UnsupportedError, match="issue 25"):
        kvtier.connect(sock, memory="cuda")
    with pytest.raises(kvtier.UsageError, match="client_blocks"):
        kvtier.connect(sock, blocks=33)
    with kvtier.connect(sock, blocks=8) as h:
        assert h.memory_blocks == 8
        with pytest.raises(kvtier.UsageError, match="out of range"):
            h.submit_store([1], [8])
    with pytest.raises(kvtier.IoError, match="connecting to the kvtier service"):
        kvtier.connect(sock.parent / "nobody.sock")
