//! Slack tables: loading and lookup.
//!
//! A slack table is profiled offline, once per model and GPU, by
//! `kvtier-profile` (the `profiler/` crate) and kept in
//! `tables/<model>.<gpu>.json`. For every point of a grid of (input length,
//! prefix length) and every layer it says how long the layer's compute runs,
//! how long reading the layer's prefix KV from the SSDs takes, what is left
//! (the slack), how many SMs the I/O kernel may use, and how many read and
//! write IOCBs that means; a decode profile says the same per decode step.
//! The scheduler (`sched`) issues a request's prefix reads within the slack
//! and its new KV's writes only in what the reads leave (Tutti's Algorithm 3),
//! or defers them to decode steps (Algorithm 4).
//!
//! Rooms: `schema` (the file as serde reads it, and the shape check that names a wrong
//! field where it stands), `rules` (the derived columns' arithmetic, shared with the
//! profiler), `table` (validation against the rules, and lookup). All re-exported here.
//!
//! # The file (schema `kvtier-slack/1`)
//!
//! ```text
//! { "schema": "kvtier-slack/1",
//!   "model": {"name": "llama3-8b", "layers": 32, "kv_heads": 8, "head_dim": 128,
//!             "dtype": "bfloat16", "block_size": 16, "hidden_size": 4096,
//!             "intermediate_size": 14336, "attention_heads": 32},
//!   "gpu": {"name": "H100-SXM", "sms": 132, "bf16_tflops": 989, "hbm_gbs": 3350},
//!   "storage": {"read_gbs": 7, "write_gbs": 5, "iocb_service_us": 80, "source": "assumed: ..."},
//!   "mode": "analytic", "estimated": true,
//!   "provenance": {"machine": "...", "kernel": "...", "kvtier_version": "...",
//!                  "date": "2025-01-31", "command": "kvtier-profile ...", "method": "..."},
//!   "input_lengths": [512, ...], "prefix_lengths": [0, ...],
//!   "entries": [ {"input": 512, "prefix": 0, "layers": [
//!       {"compute_us": 412.5, "read_us": 0, "slack_us": 412.5, "sm_budget": 2,
//!        "read_iocbs": 0, "write_iocbs": 1}, ... one per layer ]}, ... ],
//!   "decode": [ {"context": 1024, "step_us": 4345.1, "slack_us": 4318.9,
//!                "sm_budget": 2, "write_iocbs": 0}, ... ] }
//! ```
//!
//! Every field is required and no other field is allowed (a misspelt field is
//! an error, not silently ignored). Units: times in microseconds (µs), bandwidths
//! in GB/s (10^9 bytes per second), lengths in tokens.
//!
//! | field | meaning |
//! | --- | --- |
//! | `schema` | the string `kvtier-slack/1` ([`SCHEMA`]) |
//! | `model.name` | preset name or the model's name (informational) |
//! | `model.layers`, `kv_heads`, `head_dim`, `dtype`, `block_size` | the KV geometry ([`KvGeometry`]) the table was made for; `dtype` as PyTorch names it (`bfloat16`); [`SlackTable::check_geometry`] refuses a table of another geometry |
//! | `model.hidden_size`, `intermediate_size`, `attention_heads` | the rest of the shape the compute times depend on (informational) |
//! | `gpu.name`, `sms`, `bf16_tflops`, `hbm_gbs` | the GPU: name, streaming multiprocessors, dense bf16 peak TFLOPS, HBM bandwidth GB/s |
//! | `storage.read_gbs`, `write_gbs` | SSD bandwidth for reads alone and writes alone, GB/s |
//! | `storage.iocb_service_us` | submission-to-completion time of one IOCB carrying one object-sized read at queue depth 1: the fixed latency of an IOCB round trip (informational for the scheduler; not part of the derived columns) |
//! | `storage.source` | `measured on <pool dir> ...` or `assumed: ...` (how the storage numbers were obtained) |
//! | `mode` | where compute times came from: `analytic` (FLOPs and bytes against the GPU's peaks), `trace` (per-layer times measured elsewhere), `torch` (timed on a GPU by `profiler/torch_harness.py`) |
//! | `estimated` | true when the compute times are a model, not measurements; must be true for `analytic` |
//! | `provenance.machine`, `kernel` | the machine that ran the profiler (CPU from /proc/cpuinfo) and its kernel release |
//! | `provenance.kvtier_version` | the kvtier (and profiler) version that wrote the table |
//! | `provenance.date` | `YYYY-MM-DD` (UTC) |
//! | `provenance.command` | the profiler command line |
//! | `provenance.method` | how compute and storage times were obtained, with the constants used |
//! | `input_lengths` | the grid's L_input values (new tokens of a prefill), strictly increasing, each ≥ 1 |
//! | `prefix_lengths` | the grid's L_prefix values (tokens already cached, read from the SSDs), strictly increasing, may start at 0 |
//! | `entries[]` | one per (input, prefix) grid point, in any order; `input` and `prefix` name the point |
//! | `entries[].layers[]` | one row per model layer, in layer order (exactly `model.layers` rows) |
//! | `.compute_us` | the layer's compute window: its compute time in that prefill, µs, ≥ 0 |
//! | `.read_us` | time to read the layer's prefix KV at `read_gbs`: [`read_us`] = 2 (K and V) × prefix blocks × object bytes / read bandwidth |
//! | `.slack_us` | `compute_us − read_us`: the time the read leaves for writes; negative when the read does not fit (a bubble of `−slack_us`) |
//! | `.sm_budget` | SMs the I/O kernel may use during the layer ([`sm_budget`]) |
//! | `.read_iocbs` | IOCBs the layer's reads need ([`read_iocbs`]) |
//! | `.write_iocbs` | IOCBs of the layer's *new* KV writes that fit in `max(0, slack_us)` at `write_gbs` ([`write_iocbs_fit`]) |
//! | `decode[]` | one row per decode context length, `context` strictly increasing |
//! | `.context` | tokens in the sequence at that decode step |
//! | `.step_us` | one decode step (every layer, batch 1), µs |
//! | `.slack_us` | `step_us` minus the time to write the step's own new KV (one token, every layer, amortised: [`decode_own_write_us`]); decode has no SSD reads, so this is the window for deferred writes |
//! | `.sm_budget` | SMs the I/O kernel may use during the step ([`sm_budget`]) |
//! | `.write_iocbs` | full write IOCBs (of [`IOCB_OBJECTS`] objects) of deferred writes that fit in `max(0, slack_us)` |
//!
//! # IOCBs
//!
//! The table counts IOCBs the way the GPU engine fills them at worst: one
//! object per IOCTX, up to [`IOCB_OBJECTS`] (2048) IOCTXs per IOCB, so a full
//! IOCB moves 2048 objects. The tier's coalescing of consecutive slots only
//! makes real IOCBs fewer; the bytes, and so the times, are the same.
//!
//! # The derived columns are checked
//!
//! `read_us`, `slack_us`, `sm_budget`, `read_iocbs` and `write_iocbs` follow
//! from `compute_us` (or `step_us`), the geometry and the storage numbers by
//! the public functions of this module; the loader recomputes them and refuses
//! a table whose columns disagree (times within 0.002 µs: files keep times to
//! the nanosecond). Edit a table's inputs and regenerate it; do not hand-edit
//! derived columns.
//!
//! # Lookup between grid points
//!
//! [`SlackTable::layer`] and [`SlackTable::prefill`]: input and prefix are first
//! clamped to the grid (a point outside the grid gets the values of the nearest
//! edge: profile a wider grid if traffic lives there). Inside, `compute_us`,
//! `read_us` and `slack_us` are interpolated bilinearly between the four
//! surrounding grid points (read time is linear in prefix blocks, so its
//! interpolation is exact up to block rounding). The integer columns are then
//! derived at the clamped point by the same rules as the table's own rows:
//! `read_iocbs` from the clamped prefix, `write_iocbs` floored from the
//! interpolated slack (an IOCB counts only if it fits whole), `sm_budget` from
//! the interpolated times. At a grid point a lookup returns that row exactly.
//! [`SlackTable::decode`] does the same in one dimension over `context`.
//! Both answers also carry `write_budget_bytes`, the bytes that fit in
//! `max(0, slack_us)` at `write_gbs`, for a scheduler whose write jobs are not
//! whole IOCBs: a full IOCB of a llama3-8b-sized model (64 MiB) takes longer
//! than one of its decode steps, so a decode step's `write_iocbs` is often 0
//! and a scheduler should carry unused decode slack across steps (writes do
//! not slow decode beyond the SM budget: decode does no SSD reads).

use crate::error::{Error, Result};
use crate::json::json_kind;
use crate::model::{DType, KvGeometry};
use crate::ring::abi::IOCB_MAX_IOCTX;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// The `schema` string of the tables this build reads and writes.
pub const SCHEMA: &str = "kvtier-slack/1";

/// Objects (IOCTXs of one object each) in a full IOCB.
pub const IOCB_OBJECTS: u64 = IOCB_MAX_IOCTX as u64;

/// The fewest SMs the I/O kernel gets: one 2-SM scheduling unit (a GPU engine
/// gives each IOCTX of an IOCB a thread of that unit).
pub const SM_BUDGET_MIN: u32 = 2;

/// The most SMs the I/O kernel gets, per 132 SMs of the GPU (8 of an H100's
/// 132, ~6%): enough to keep several IOCBs in flight, few enough that the
/// small operators spilling onto free SMs still find them (Tutti §3.3).
pub const SM_BUDGET_MAX_PER_132: u32 = 8;

/// The largest table file read: the tables kvtier-profile writes are well
/// under 1 MiB for an 8 x 8 grid; 64 MiB leaves room for grids 64 times
/// larger while a wrong file (a disk image, /dev/zero) is refused unread.
pub const MAX_TABLE_BYTES: u64 = 64 << 20;

/// Tolerance when checking a table's times against the rules: files keep
/// times to the nanosecond (0.001 µs).
const TIME_TOLERANCE_US: f64 = 0.002;

mod rules;
mod schema;
mod table;

pub use rules::*;
pub use schema::*;
pub use table::*;

#[cfg(test)]
mod tests;
