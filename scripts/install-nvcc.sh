#!/usr/bin/env bash
# Install nvcc from PyPI, pinned to CUDA 13.0, so kvtier's build.rs can compile
# kernels/*.cu on machines with no CUDA toolkit (developers' machines and CI have
# no GPU; the kernels are still built there so a broken one fails the build).
#
# Why 13.0: Cargo.toml pins cudarc to cuda-13000, and the cubin/PTX must load on
# the driver the GPU engine runs against. Why four packages, all pinned: the
# nvcc wheel alone lacks the CUDA runtime headers (nvidia-cuda-runtime) and the
# crt headers (nvidia-cuda-crt), and an unpinned nvidia-nvvm (cicc) emits PTX
# of a newer ISA version than 13.0's ptxas accepts.
#
# Layout note: the CUDA 13 wheels install into site-packages/nvidia/cu13/
# (bin/nvcc, include/, nvvm/), not nvidia/cuda_nvcc/ as the CUDA 12 wheels did,
# and there is no `nvidia.cuda_nvcc` module any more; nvcc is therefore located
# through the distribution's file list, as build.rs does.
#
# Idempotent: pip runs only when one of the four is missing or not 13.0.x.
# Environment: PYTHON (default python3), PIP_ARGS (extra arguments for pip).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
CUDA_SERIES="13.0"
PACKAGES=(
    "nvidia-cuda-nvcc==${CUDA_SERIES}.*"
    "nvidia-cuda-crt==${CUDA_SERIES}.*"
    "nvidia-cuda-runtime==${CUDA_SERIES}.*"
    "nvidia-nvvm==${CUDA_SERIES}.*"
)
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "install-nvcc: $PYTHON not found; install Python 3 first" >&2
    exit 1
fi

# Prints the path of nvcc when all four distributions are installed at 13.0.x
# and nvcc is executable; fails (printing nothing) otherwise.
locate_nvcc() {
    "$PYTHON" - "$CUDA_SERIES" <<'PY'
import os, sys
from importlib import metadata
series = sys.argv[1]
for dist in ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-runtime", "nvidia-nvvm"):
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if version != series and not version.startswith(series + "."):
        sys.exit(1)
for f in metadata.files("nvidia-cuda-nvcc") or []:
    if str(f).replace("\\", "/").endswith("bin/nvcc"):
        path = str(f.locate())
        if os.access(path, os.X_OK):
            print(path)
            sys.exit(0)
sys.exit(1)
PY
}

if NVCC="$(locate_nvcc)"; then
    echo "install-nvcc: CUDA ${CUDA_SERIES} nvcc wheels already installed"
else
    echo "install-nvcc: installing ${PACKAGES[*]}"
    # shellcheck disable=SC2086  # PIP_ARGS is a word list on purpose
    "$PYTHON" -m pip install --disable-pip-version-check ${PIP_ARGS:-} "${PACKAGES[@]}"
    if ! NVCC="$(locate_nvcc)"; then
        echo "install-nvcc: pip finished but no CUDA ${CUDA_SERIES} nvcc was found" >&2
        exit 1
    fi
    # build.rs does not watch site-packages (that would rerun it on every
    # build); make cargo rerun it so a tree built before this install gets its
    # kernels.
    if [[ -f "$REPO_ROOT/build.rs" ]]; then
        touch "$REPO_ROOT/build.rs"
    fi
fi

"$NVCC" --version | grep -E 'release|^Build' || true
echo "nvcc: $NVCC"
