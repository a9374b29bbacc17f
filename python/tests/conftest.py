import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent
TINY = HERE / "tiny-llama"

# Hugging Face hubs are not reachable from CI: everything reads the local config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def tiny_model() -> str:
    """A tiny llama: 2 layers, 2 KV heads of 64, bf16; a 16-token block's K
    of one layer is 4 KiB, the direct-I/O alignment."""
    return str(TINY / "config.json")


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_dir():
    """vLLM's engines open ZMQ IPC sockets named by a fresh UUID in
    VLLM_RPC_BASE_PATH (default: the temporary directory) and leave them
    there: keep them in a directory of the session's, removed at its end."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="kvtier-vllm-rpc-")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = d
    yield d
    if old is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = old
    shutil.rmtree(d, ignore_errors=True)


REPO = HERE.parents[1]


def kvtier_bin() -> str | None:
    """The `kvtier` binary: KVTIER_BIN, or the repository's
    target/{debug,release}/kvtier (`cargo build` makes it)."""
    env = os.environ.get("KVTIER_BIN")
    if env:
        return env
    for kind in ("debug", "release"):
        p = REPO / "target" / kind / "kvtier"
        if p.exists():
            return str(p)
    return None


def serve_process(binary, pool_dir, sock, log, args):
    """`kvtier serve` on a pool of 64 MiB in `pool_dir` at `sock` (its
    stderr in `log`, more arguments in `args`), once it says it serves: the
    process. Started again on the same pool, it serves what was stored."""
    import subprocess
    import time

    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [binary, "serve", "--dir", str(pool_dir), "--capacity", "64m", "--socket", str(sock)]
            + list(args), stderr=err)
    deadline = time.monotonic() + 30
    while b"serving " not in log.read_bytes():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return proc


@pytest.fixture
def restartable_service(tmp_path):
    """(socket, start): ``start(log, args)`` runs `kvtier serve` (with
    ``args``: model, block size, clients) on one pool in tmp_path at the
    socket, and again on the same pool after the test stopped it (a
    restart): the process. The test stops each one it starts."""
    binary = kvtier_bin()
    if binary is None:
        pytest.skip("no kvtier binary: run `cargo build` (or set KVTIER_BIN)")
    sock = tmp_path / "kvtier.sock"
    return sock, lambda log, args: serve_process(binary, tmp_path / "svc-pool", sock, log, args)


@pytest.fixture
def kvtier_service(tmp_path, tiny_model):
    """Starts `kvtier serve` for the tiny model on a pool in tmp_path:
    kvtier_service(clients=, client_blocks=, model=, block_size=) -> (socket,
    log path). Each is
    stopped with SIGTERM at the end and must exit 0."""
    binary = kvtier_bin()
    if binary is None:
        pytest.skip("no kvtier binary: run `cargo build` (or set KVTIER_BIN)")
    started = []

    def start(clients: int = 4, client_blocks: int = 32, model: str | None = None,
              block_size: int = 16, dtype: str | None = None, tp_size: int = 1):
        n = len(started)
        sock = tmp_path / f"kvtier{n}.sock"
        log = tmp_path / f"serve{n}.log"
        proc = serve_process(binary, tmp_path / f"svc-pool{n}", sock, log,
                             ["--model", model or tiny_model, "--block-size", str(block_size),
                              "--clients", str(clients), "--client-blocks", str(client_blocks),
                              "--tp-size", str(tp_size)] + (["--dtype", dtype] if dtype else []))
        started.append((proc, log))
        return sock, log

    yield start
    for proc, log in started:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()
