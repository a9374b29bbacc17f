"""The GPU pass's time-to-first-token script (scripts/gpu/ttft.py) runs here
on the CPU, over the staged path's host double, so a GPU session (15 minutes,
by chance) never spends its time on a bug the CPU could have shown: the three
prefills (recompute, restore under the suffix's layers, prefix in memory),
the prefix stored and restored through kvtier into permuted blocks, (b)'s
logits bit-identical to (c)'s and within bf16 of (a)'s, the explicit forward
equal to transformers' own, and one JSON per case."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
TTFT = os.path.join(HERE, "..", "..", "scripts", "gpu", "ttft.py")


@pytest.mark.parametrize("wait", ["stream", "host"])
def test_ttft_script_runs_on_the_cpu_double(tmp_path, wait):
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, TTFT, "--device", "cpu", "--models", "tiny", "--prefixes", "64,256",
         "--suffix", "32", "--rounds", "1", "--b-wait", wait, "--dir", str(tmp_path / "pool"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for prefix in (64, 256):
        with open(out / f"ttft-tiny-{prefix}.json") as f:
            rec = json.load(f)
        assert rec["prefix"] == prefix and rec["b_wait"] == wait
        assert rec["logits_b_equal_c"] is True
        assert rec["logits_b_within_bf16_of_a"] is True, rec["logits_b_vs_a"]
        assert len(rec["a_s"]) == len(rec["b_s"]) == len(rec["c_s"]) == 1
        assert rec["median"]["read_GBps"] > 0
    with open(out / "ttft-tiny-64.json") as f:
        rec = json.load(f)
    assert rec["logits_a_within_bf16_of_transformers"] is True, rec["logits_a_vs_transformers"]
