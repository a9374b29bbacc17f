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
