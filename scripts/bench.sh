#!/usr/bin/env bash
# The main job: `kvtier bench` on a pool file under ./kvtier-data (no GPU
# needed), with fio run on the same directory in the same run as the
# reference (installed here if missing), a plot and a JSON report.
# Extra arguments go to `kvtier bench` (see `kvtier bench --help`).
#
# Memory: each context's KV cache is held in host memory (llama3-8b: 128 KiB
# a token, so 4K tokens 512 MiB, 16K 2 GiB, 64K 8 GiB). KVTIER_BENCH_MEM sets
# the most one context may take (default 4g: a peak RSS of about 4 GiB, fit
# for a 16 GiB laptop or a CI runner); `auto` takes what the machine has
# available less 2 GiB, which runs the 64K context where memory allows. Never
# more than is available less 1 GiB. Contexts over the budget are skipped and
# the report says why.
set -euo pipefail
cd "$(dirname "$0")/.."

# Bytes of a size like 4g, 512m, 8589934592.
bytes_of() {
  local v=${1,,} m=1
  case $v in
    *t) m=$((1 << 40)); v=${v%t} ;; *g) m=$((1 << 30)); v=${v%g} ;;
    *m) m=$((1 << 20)); v=${v%m} ;; *k) m=$((1 << 10)); v=${v%k} ;;
  esac
  [[ $v =~ ^[0-9]+$ ]] || { echo "KVTIER_BENCH_MEM=$1: give a size such as 4g or 512m, or auto" >&2; exit 2; }
  echo $((v * m))
}

have_flag() {
  local f=$1; shift
  for a in "$@"; do [[ $a == "$f" || $a == "$f="* ]] && return 0; done
  return 1
}

if ! command -v fio >/dev/null 2>&1; then
  echo "installing fio (the reference kvtier is measured against)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q fio >/dev/null || apt-get update -q >/dev/null && apt-get install -y -q fio >/dev/null
  else sudo apt-get install -y -q fio >/dev/null; fi
fi

avail=$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) * 1024 ))
want=${KVTIER_BENCH_MEM:-4g}
if [ "$want" = auto ]; then
  budget=$(( avail > (2 << 30) ? avail - (2 << 30) : 0 ))
else
  budget=$(bytes_of "$want")
fi
cap=$(( avail > (1 << 30) ? avail - (1 << 30) : 0 ))
if [ "$budget" -gt "$cap" ]; then
  echo "memory budget lowered to $((cap >> 20)) MiB: $((avail >> 20)) MiB available, 1 GiB kept free" >&2
  budget=$cap
fi
[ "$budget" -ge 4096 ] || budget=4096
args=()
have_flag --contexts "$@" || args+=(--contexts 4096,16384,65536)
have_flag --mem-budget "$@" || args+=(--mem-budget "$budget")
echo "KV cache budget per context: $((budget >> 20)) MiB (KVTIER_BENCH_MEM=${KVTIER_BENCH_MEM:-4g}; auto runs the 64K context where memory allows)" >&2

# Reserve huge pages for fio's buffers (kvtier's own are transparent huge
# pages), so the reference runs at the device's best; never lowers a
# setting, and gives back what it raised when the bench ends, however.
if [ "$(id -u)" = 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
  had=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$had" -lt 300 ] && echo 300 > /proc/sys/vm/nr_hugepages 2>/dev/null; then
    trap 'echo "$had" > /proc/sys/vm/nr_hugepages && echo "vm.nr_hugepages back to $had" >&2' EXIT
    trap 'exit 130' INT TERM
    echo "vm.nr_hugepages raised from $had to 300 for fio's buffers (restored at exit)" >&2
  fi
fi
cargo build --release --quiet
mkdir -p kvtier-data
./target/release/kvtier bench --against-fio --plot kvtier-data/bench.svg --json kvtier-data/bench.json "${args[@]}" "$@"
