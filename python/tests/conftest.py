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
