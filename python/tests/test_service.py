"""kvtier.connect: two Python processes on one `kvtier serve` service.

The service is the `kvtier` binary (KVTIER_BIN, or the repository's
target/{debug,release}/kvtier: `cargo build` makes it)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

import kvtier

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvtier_bin() -> str | None:
    env = os.environ.get("KVTIER_BIN")
    if env:
        return env
    for kind in ("debug", "release"):
        p = REPO / "target" / kind / "kvtier"
        if p.exists():
            return str(p)
    return None


@pytest.fixture
def service(tmp_path, tiny_model):
    binary = kvtier_bin()
    if binary is None:
        pytest.skip("no kvtier binary: run `cargo build` (or set KVTIER_BIN)")
    sock = tmp_path / "kvtier.sock"
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [binary, "serve", "--dir", str(tmp_path / "pool"), "--capacity", "64m",
             "--model", tiny_model, "--socket", str(sock), "--clients", "4",
             "--client-blocks", "32"],
            stderr=err,
        )
    deadline = time.monotonic() + 30
    while b"serving " not in log.read_bytes():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    yield sock, log
    proc.terminate()
    assert proc.wait(timeout=30) == 0, log.read_text()


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
