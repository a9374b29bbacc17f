#!/usr/bin/env bash
# The main job: `kvtier bench` on a pool file under ./kvtier-data (no GPU
# needed), with fio run on the same directory in the same run as the
# reference (installed here if missing), a plot and a JSON report.
# Extra arguments go to `kvtier bench` (see `kvtier bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v fio >/dev/null 2>&1; then
  echo "installing fio (the reference kvtier is measured against)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q fio >/dev/null || apt-get update -q >/dev/null && apt-get install -y -q fio >/dev/null
  else sudo apt-get install -y -q fio >/dev/null; fi
fi
# Reserve huge pages for fio's buffers (kvtier's own are transparent huge
# pages), so the reference runs at the device's best; never lowers a setting.
if [ "$(id -u)" = 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
  have=$(cat /proc/sys/vm/nr_hugepages)
  [ "$have" -ge 300 ] || echo 300 > /proc/sys/vm/nr_hugepages || true
fi
cargo build --release --quiet
mkdir -p kvtier-data
exec ./target/release/kvtier bench --against-fio --plot kvtier-data/bench.svg --json kvtier-data/bench.json "$@"
