#!/usr/bin/env bash
# The main job: `kvtier bench` on a pool file under ./kvtier-data (no GPU
# needed). Extra arguments go to `kvtier bench` (see `kvtier bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
exec ./target/release/kvtier bench "$@"
