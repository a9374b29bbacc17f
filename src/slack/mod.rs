//! Slack tables: loading and lookup (issue 6).
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

// ---------------------------------------------------------------------------
// The file, as serde reads and writes it.

/// `model`: the model the table was profiled for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    pub name: String,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// PyTorch spelling (`bfloat16`); see [`DType::name`].
    pub dtype: String,
    pub block_size: u32,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub attention_heads: u32,
}

/// `gpu`: the GPU the compute times are for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    pub name: String,
    pub sms: u32,
    /// Dense bf16 peak, TFLOPS.
    pub bf16_tflops: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbs: f64,
}

/// `storage`: the SSD side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageInfo {
    /// Reads alone, GB/s (10^9 B/s).
    pub read_gbs: f64,
    /// Writes alone, GB/s.
    pub write_gbs: f64,
    /// One IOCB (one object-sized read) at queue depth 1, submission to completion, µs.
    pub iocb_service_us: f64,
    /// `measured on <dir> ...` or `assumed: ...`.
    pub source: String,
}

/// `mode`: where the compute times came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Analytic,
    Trace,
    Torch,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Analytic => "analytic",
            Mode::Trace => "trace",
            Mode::Torch => "torch",
        }
    }
}

/// `provenance`: who made the table, where, when, how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    pub machine: String,
    pub kernel: String,
    pub kvtier_version: String,
    /// `YYYY-MM-DD`.
    pub date: String,
    pub command: String,
    pub method: String,
}

/// One row of `entries[].layers[]`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRow {
    pub compute_us: f64,
    pub read_us: f64,
    pub slack_us: f64,
    pub sm_budget: u32,
    pub read_iocbs: u32,
    pub write_iocbs: u32,
}

/// One element of `entries`: a grid point and its layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub input: u64,
    pub prefix: u64,
    pub layers: Vec<LayerRow>,
}

/// One element of `decode`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeRow {
    pub context: u64,
    pub step_us: f64,
    pub slack_us: f64,
    pub sm_budget: u32,
    pub write_iocbs: u32,
}

/// The whole file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableFile {
    pub schema: String,
    pub model: ModelInfo,
    pub gpu: GpuInfo,
    pub storage: StorageInfo,
    pub mode: Mode,
    pub estimated: bool,
    pub provenance: Provenance,
    pub input_lengths: Vec<u64>,
    pub prefix_lengths: Vec<u64>,
    pub entries: Vec<Entry>,
    pub decode: Vec<DecodeRow>,
}

/// Everything of a table but its rows: what [`SlackTable::build`] derives rows under.
#[derive(Clone, Debug, PartialEq)]
pub struct TableHeader {
    pub model: ModelInfo,
    pub gpu: GpuInfo,
    pub storage: StorageInfo,
    pub mode: Mode,
    pub estimated: bool,
    pub provenance: Provenance,
}

// ---------------------------------------------------------------------------
// The rules the derived columns follow.

/// Microseconds to move `bytes` at `gbs` GB/s (10^9 B/s).
pub fn transfer_us(bytes: u64, gbs: f64) -> f64 {
    bytes as f64 / (gbs * 1e3)
}

/// Rounds a time to the nanosecond, as tables store it.
pub fn round_us(us: f64) -> f64 {
    (us * 1000.0).round() / 1000.0
}

/// Time to read one layer's prefix KV: 2 objects (K and V) per prefix block,
/// at `read_gbs`, rounded to the nanosecond.
pub fn read_us(geometry: &KvGeometry, read_gbs: f64, prefix: u64) -> f64 {
    let objects = 2 * geometry.tokens_to_blocks(prefix);
    round_us(transfer_us(
        objects.saturating_mul(geometry.object_bytes()),
        read_gbs,
    ))
}

/// IOCBs one layer's prefix reads need: `ceil(2 × prefix blocks / 2048)`
/// (one object per IOCTX; see the module docs).
pub fn read_iocbs(geometry: &KvGeometry, prefix: u64) -> u32 {
    let objects = 2 * geometry.tokens_to_blocks(prefix);
    u32::try_from(objects.div_ceil(IOCB_OBJECTS)).unwrap_or(u32::MAX)
}

/// How many IOCBs of one layer's new KV writes fit, whole, one after another,
/// in `window_us` at `write_gbs`, and how long those take (µs).
///
/// The layer's new KV is 2 objects (K and V) per block of `input` tokens, cut
/// into IOCBs of up to [`IOCB_OBJECTS`] objects in order (all full but the
/// last). IOCBs are counted while their cumulative write time is within the
/// window; a negative window fits none.
pub fn write_iocbs_fit(
    geometry: &KvGeometry,
    write_gbs: f64,
    input: u64,
    window_us: f64,
) -> (u32, f64) {
    let mut objects = 2 * geometry.tokens_to_blocks(input);
    let (mut n, mut used) = (0u32, 0.0f64);
    while objects > 0 {
        let k = objects.min(IOCB_OBJECTS);
        let t = transfer_us(k.saturating_mul(geometry.object_bytes()), write_gbs);
        if used + t > window_us {
            break;
        }
        used += t;
        n += 1;
        objects -= k;
    }
    (n, used)
}

/// Bytes that `write_gbs` moves in `max(0, window_us)`.
pub fn write_budget_bytes(window_us: f64, write_gbs: f64) -> u64 {
    (window_us.max(0.0) * write_gbs * 1e3).floor() as u64
}

/// Time to write one full IOCB ([`IOCB_OBJECTS`] objects) at `write_gbs`.
pub fn full_iocb_write_us(geometry: &KvGeometry, write_gbs: f64) -> f64 {
    transfer_us(IOCB_OBJECTS * geometry.object_bytes(), write_gbs)
}

/// Full write IOCBs that fit, whole, in `window_us`; a negative window fits none.
pub fn full_write_iocbs_fit(geometry: &KvGeometry, write_gbs: f64, window_us: f64) -> u32 {
    let per = full_iocb_write_us(geometry, write_gbs);
    if window_us <= 0.0 || per <= 0.0 {
        return 0;
    }
    let n = (window_us / per).floor();
    if n >= u32::MAX as f64 {
        u32::MAX
    } else {
        n as u32
    }
}

/// A decode step's own new KV write, amortised: one token of every layer (K
/// and V) per step, i.e. a block's bytes every `block_size` steps.
pub fn decode_own_write_us(geometry: &KvGeometry, write_gbs: f64) -> f64 {
    transfer_us(geometry.block_bytes(), write_gbs) / f64::from(geometry.block_size)
}

/// The most SMs the I/O kernel may use on a GPU of `sms` SMs:
/// `round(sms × 8 / 132)`, at least [`SM_BUDGET_MIN`] (8 on H100 and H200).
pub fn sm_budget_max(sms: u32) -> u32 {
    let scaled = (f64::from(sms) * f64::from(SM_BUDGET_MAX_PER_132) / 132.0).round() as u32;
    scaled.max(SM_BUDGET_MIN)
}

/// SMs the I/O kernel may use in a window of `window_us` in which it has
/// `io_us` of I/O to run: the maximum ([`sm_budget_max`]) scaled by the I/O
/// fraction `min(1, io_us / window_us)`, rounded up, and never below
/// [`SM_BUDGET_MIN`]. For a prefill layer `io_us` is the read time plus the
/// write IOCBs that fit; for a decode step, its own write plus the write IOCBs
/// that fit.
pub fn sm_budget(sms: u32, window_us: f64, io_us: f64) -> u32 {
    let max = sm_budget_max(sms);
    let fraction = if window_us > 0.0 {
        (io_us.max(0.0) / window_us).min(1.0)
    } else if io_us > 0.0 {
        1.0
    } else {
        0.0
    };
    ((f64::from(max) * fraction).ceil() as u32).clamp(SM_BUDGET_MIN, max)
}

/// Derives a layer row from its compute time (rounded to the nanosecond).
pub fn derive_layer(
    geometry: &KvGeometry,
    gpu: &GpuInfo,
    storage: &StorageInfo,
    input: u64,
    prefix: u64,
    compute_us: f64,
) -> LayerRow {
    let compute_us = round_us(compute_us);
    let read = read_us(geometry, storage.read_gbs, prefix);
    let slack_us = round_us(compute_us - read);
    complete_layer(
        geometry, gpu, storage, input, prefix, compute_us, read, slack_us,
    )
}

/// The integer columns of a layer row, from its three times.
#[allow(clippy::too_many_arguments)]
fn complete_layer(
    geometry: &KvGeometry,
    gpu: &GpuInfo,
    storage: &StorageInfo,
    input: u64,
    prefix: u64,
    compute_us: f64,
    read_us: f64,
    slack_us: f64,
) -> LayerRow {
    let (write_iocbs, write_us) =
        write_iocbs_fit(geometry, storage.write_gbs, input, slack_us.max(0.0));
    LayerRow {
        compute_us,
        read_us,
        slack_us,
        sm_budget: sm_budget(gpu.sms, compute_us, read_us + write_us),
        read_iocbs: read_iocbs(geometry, prefix),
        write_iocbs,
    }
}

/// Derives a decode row from its step time (rounded to the nanosecond).
pub fn derive_decode(
    geometry: &KvGeometry,
    gpu: &GpuInfo,
    storage: &StorageInfo,
    context: u64,
    step_us: f64,
) -> DecodeRow {
    let step_us = round_us(step_us);
    let slack_us = round_us(step_us - decode_own_write_us(geometry, storage.write_gbs));
    complete_decode(geometry, gpu, storage, context, step_us, slack_us)
}

fn complete_decode(
    geometry: &KvGeometry,
    gpu: &GpuInfo,
    storage: &StorageInfo,
    context: u64,
    step_us: f64,
    slack_us: f64,
) -> DecodeRow {
    let write_iocbs = full_write_iocbs_fit(geometry, storage.write_gbs, slack_us);
    let io_us = decode_own_write_us(geometry, storage.write_gbs)
        + f64::from(write_iocbs) * full_iocb_write_us(geometry, storage.write_gbs);
    DecodeRow {
        context,
        step_us,
        slack_us,
        sm_budget: sm_budget(gpu.sms, step_us, io_us),
        write_iocbs,
    }
}

// ---------------------------------------------------------------------------
// Lookup results.

/// What a layer of a prefill allows: the answer of [`SlackTable::layer`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSlack {
    /// The layer's compute window, µs.
    pub compute_us: f64,
    /// Time to read the layer's prefix KV, µs.
    pub read_us: f64,
    /// `compute_us − read_us`; negative when the read does not fit.
    pub slack_us: f64,
    /// SMs the I/O kernel may use.
    pub sm_budget: u32,
    /// IOCBs the layer's reads need.
    pub read_iocbs: u32,
    /// IOCBs of the layer's new KV writes that fit in the slack.
    pub write_iocbs: u32,
    /// Bytes of writes that fit in `max(0, slack_us)` at the table's write
    /// bandwidth (for a scheduler whose write jobs are not whole IOCBs).
    pub write_budget_bytes: u64,
}

impl LayerSlack {
    /// Time the compute would wait for the read if nothing else were done: `max(0, −slack)`.
    pub fn bubble_us(&self) -> f64 {
        (-self.slack_us).max(0.0)
    }

    /// Time left for writes after the read: `max(0, slack)`.
    pub fn write_window_us(&self) -> f64 {
        self.slack_us.max(0.0)
    }
}

/// What a decode step allows: the answer of [`SlackTable::decode`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSlack {
    /// The (clamped) context the answer is for.
    pub context: u64,
    pub step_us: f64,
    pub slack_us: f64,
    pub sm_budget: u32,
    /// Full write IOCBs of deferred writes that fit in the step.
    pub write_iocbs: u32,
    /// Bytes of writes that fit in `max(0, slack_us)` at the table's write
    /// bandwidth: for a scheduler whose write jobs are not whole IOCBs, and
    /// (decode slack being short next to a full IOCB) for carrying unused
    /// slack across steps.
    pub write_budget_bytes: u64,
}

// ---------------------------------------------------------------------------
// The loaded table.

/// A validated slack table. Build one with [`SlackTable::load`],
/// [`SlackTable::from_json_str`] or [`SlackTable::build`].
#[derive(Clone, Debug)]
pub struct SlackTable {
    file: TableFile,
    source: String,
    geometry: KvGeometry,
    /// `cells[i * prefixes + p]` = index in `file.entries` of grid point (i, p).
    cells: Vec<usize>,
}

impl SlackTable {
    /// Reads and validates a table file; errors name the file, the field and the fix.
    pub fn load(path: impl AsRef<Path>) -> Result<SlackTable> {
        let path = path.as_ref();
        let source = path.display().to_string();
        let text = crate::json::read_user_file(path, MAX_TABLE_BYTES).map_err(|why| {
            Error::invalid(format!(
                "{source}: cannot read the slack table: {why}; pass a table made by kvtier-profile, e.g. tables/llama3-8b.h100.json"
            ))
        })?;
        Self::from_json_str(&text, &source)
    }

    /// Parses and validates a table; `source_name` (a path) starts every error message.
    pub fn from_json_str(text: &str, source_name: &str) -> Result<SlackTable> {
        let err = |what: String| Error::invalid(format!("{source_name}: {what}"));
        let top = crate::json::parse_object(
            text,
            "a slack table is the JSON kvtier-profile writes",
            "a slack table is the JSON object kvtier-profile writes",
        )
        .map_err(err)?;
        // The schema first: a file of another kind or version should say so,
        // not list every field it lacks.
        match top.get("schema") {
            None => {
                return Err(err(format!(
                    "schema is missing; a slack table starts with \"schema\": \"{SCHEMA}\" (make tables with kvtier-profile)"
                )))
            }
            Some(Value::String(s)) if s == SCHEMA => {}
            Some(other) => {
                return Err(err(format!(
                    "schema is {}, not \"{SCHEMA}\"; this kvtier reads {SCHEMA} tables only: regenerate the table with this version's kvtier-profile",
                    crate::json::value_excerpt(other)
                )))
            }
        }
        let value = Value::Object(top);
        check_shape(&value, TABLE_TY, "", source_name)?;
        let file: TableFile = serde_json::from_value(value).map_err(|e| {
            err(format!(
                "does not match the slack table schema ({}); regenerate it with kvtier-profile",
                crate::json::excerpt(&e.to_string(), 200)
            ))
        })?;
        Self::validate(file, source_name)
    }

    /// Derives every row from compute times by this module's rules, then
    /// validates the result like a loaded table.
    ///
    /// `compute_us[i * prefix_lengths.len() + p]` holds the per-layer compute
    /// times of grid point (`input_lengths[i]`, `prefix_lengths[p]`);
    /// `decode_step_us` holds (context, step µs) pairs. `source_name` names the
    /// table in errors (the path it will be written to).
    pub fn build(
        header: TableHeader,
        input_lengths: Vec<u64>,
        prefix_lengths: Vec<u64>,
        compute_us: &[Vec<f64>],
        decode_step_us: &[(u64, f64)],
        source_name: &str,
    ) -> Result<SlackTable> {
        let geometry = model_geometry(&header.model, source_name)?;
        check_storage(&header.storage, source_name)?;
        let points = input_lengths.len() * prefix_lengths.len();
        if compute_us.len() != points {
            return Err(Error::invalid(format!(
                "{source_name}: {} grid points of compute times for a {} x {} grid",
                compute_us.len(),
                input_lengths.len(),
                prefix_lengths.len()
            )));
        }
        let mut entries = Vec::with_capacity(points);
        for (i, &input) in input_lengths.iter().enumerate() {
            for (p, &prefix) in prefix_lengths.iter().enumerate() {
                let layers = compute_us[i * prefix_lengths.len() + p]
                    .iter()
                    .map(|&c| {
                        derive_layer(&geometry, &header.gpu, &header.storage, input, prefix, c)
                    })
                    .collect();
                entries.push(Entry {
                    input,
                    prefix,
                    layers,
                });
            }
        }
        let decode = decode_step_us
            .iter()
            .map(|&(context, step)| {
                derive_decode(&geometry, &header.gpu, &header.storage, context, step)
            })
            .collect();
        let file = TableFile {
            schema: SCHEMA.to_string(),
            model: header.model,
            gpu: header.gpu,
            storage: header.storage,
            mode: header.mode,
            estimated: header.estimated,
            provenance: header.provenance,
            input_lengths,
            prefix_lengths,
            entries,
            decode,
        };
        Self::validate(file, source_name)
    }

    /// Checks everything serde cannot: ranges, the grid, the rows' count and
    /// consistency with the rules.
    fn validate(file: TableFile, src: &str) -> Result<SlackTable> {
        let err = |what: String| Error::invalid(format!("{src}: {what}"));
        let geometry = model_geometry(&file.model, src)?;
        for (name, v) in [
            ("model.hidden_size", file.model.hidden_size),
            ("model.intermediate_size", file.model.intermediate_size),
            ("model.attention_heads", file.model.attention_heads),
            ("gpu.sms", file.gpu.sms),
        ] {
            if v == 0 {
                return Err(err(format!("{name} is 0; it must be a positive integer")));
            }
        }
        for (name, v) in [
            ("gpu.bf16_tflops", file.gpu.bf16_tflops),
            ("gpu.hbm_gbs", file.gpu.hbm_gbs),
        ] {
            if v <= 0.0 {
                return Err(err(format!("{name} is {v:?}; it must be positive")));
            }
        }
        check_storage(&file.storage, src)?;
        if file.mode == Mode::Analytic && !file.estimated {
            return Err(err(
                "estimated is false but mode is \"analytic\"; analytic compute times are estimates: set \"estimated\": true".into(),
            ));
        }
        if !is_date(&file.provenance.date) {
            return Err(err(format!(
                "provenance.date is {:?}; write it as YYYY-MM-DD",
                crate::json::excerpt(&file.provenance.date, 40)
            )));
        }
        if file.provenance.command.trim().is_empty() {
            return Err(err(
                "provenance.command is empty; record the kvtier-profile command line that made the table".into(),
            ));
        }
        check_grid(&file.input_lengths, "input_lengths", 1, src)?;
        check_grid(&file.prefix_lengths, "prefix_lengths", 0, src)?;

        // Entries: each on the grid, once, all of them. The grid's size
        // comes from two short lists and can be huge (60000 x 60000) while
        // the entries are few, so nothing is allocated per grid point before
        // the entries are known to cover it: a sparse map of the points seen,
        // and a dense table only when there are as many entries as points.
        let np = file.prefix_lengths.len();
        let ni = file.input_lengths.len();
        let points = ni.checked_mul(np);
        let mut seen: std::collections::HashMap<usize, usize> =
            std::collections::HashMap::with_capacity(file.entries.len());
        for (k, e) in file.entries.iter().enumerate() {
            let i = file.input_lengths.binary_search(&e.input).map_err(|_| {
                err(format!(
                    "entries[{k}].input is {}, which is not in input_lengths {}; every entry must be a grid point",
                    e.input,
                    crate::json::list_excerpt(&file.input_lengths)
                ))
            })?;
            let p = file.prefix_lengths.binary_search(&e.prefix).map_err(|_| {
                err(format!(
                    "entries[{k}].prefix is {}, which is not in prefix_lengths {}; every entry must be a grid point",
                    e.prefix,
                    crate::json::list_excerpt(&file.prefix_lengths)
                ))
            })?;
            if let Some(first) = seen.insert(i * np + p, k) {
                return Err(err(format!(
                    "entries[{k}] repeats grid point (input {}, prefix {}) of entries[{first}]; keep one entry per grid point",
                    e.input, e.prefix
                )));
            }
            if e.layers.len() != geometry.layers as usize {
                return Err(err(format!(
                    "entries[{k}].layers has {} rows but model.layers is {}; a table has one row per layer (was it made for another model?)",
                    e.layers.len(),
                    geometry.layers
                )));
            }
            for (l, row) in e.layers.iter().enumerate() {
                let path = format!("entries[{k}].layers[{l}]");
                check_layer(&geometry, &file, e.input, e.prefix, row, &path, src)?;
            }
        }
        if points != Some(seen.len()) {
            // Every entry is a distinct grid point, so there are fewer
            // entries than points and one of the first `entries + 1` points
            // (in row-major order) is missing: the search is bounded.
            let missing = (0..)
                .find(|c| !seen.contains_key(c))
                .expect("fewer entries than grid points");
            return Err(err(format!(
                "entries has no entry for grid point (input {}, prefix {}); a table needs one entry per pair of input_lengths x prefix_lengths ({} x {} = {}, found {})",
                file.input_lengths[missing / np],
                file.prefix_lengths[missing % np],
                ni,
                np,
                points.map_or_else(|| "too many".to_string(), |n| n.to_string()),
                file.entries.len()
            )));
        }
        let mut cells = vec![usize::MAX; seen.len()];
        for (cell, k) in seen {
            cells[cell] = k;
        }

        // Decode profile.
        if file.decode.is_empty() {
            return Err(err(
                "decode is empty; a table needs at least one decode row (context, step_us, ...)"
                    .into(),
            ));
        }
        for (k, row) in file.decode.iter().enumerate() {
            if k > 0 && row.context <= file.decode[k - 1].context {
                return Err(err(format!(
                    "decode[{k}].context is {}, not greater than decode[{}].context ({}); decode rows must be in strictly increasing context order",
                    row.context,
                    k - 1,
                    file.decode[k - 1].context
                )));
            }
            check_decode(&geometry, &file, row, &format!("decode[{k}]"), src)?;
        }
        Ok(SlackTable {
            file,
            source: src.to_string(),
            geometry,
            cells,
        })
    }

    /// The table as JSON: pretty at the top, one line per layer row and decode row.
    pub fn to_json_string(&self) -> String {
        fn j<T: Serialize + ?Sized>(v: &T) -> String {
            serde_json::to_string(v).expect("slack table values serialize")
        }
        let f = &self.file;
        let mut s = String::new();
        s.push_str(&format!("{{\n  \"schema\": {},\n", j(&f.schema)));
        s.push_str(&format!("  \"model\": {},\n", j(&f.model)));
        s.push_str(&format!("  \"gpu\": {},\n", j(&f.gpu)));
        s.push_str(&format!("  \"storage\": {},\n", j(&f.storage)));
        s.push_str(&format!("  \"mode\": {},\n", j(&f.mode)));
        s.push_str(&format!("  \"estimated\": {},\n", j(&f.estimated)));
        let prov = serde_json::to_string_pretty(&f.provenance)
            .expect("provenance serializes")
            .replace('\n', "\n  ");
        s.push_str(&format!("  \"provenance\": {prov},\n"));
        s.push_str(&format!("  \"input_lengths\": {},\n", j(&f.input_lengths)));
        s.push_str(&format!(
            "  \"prefix_lengths\": {},\n",
            j(&f.prefix_lengths)
        ));
        s.push_str("  \"entries\": [\n");
        for (k, e) in f.entries.iter().enumerate() {
            s.push_str(&format!(
                "    {{\"input\": {}, \"prefix\": {}, \"layers\": [\n",
                e.input, e.prefix
            ));
            for (l, row) in e.layers.iter().enumerate() {
                let sep = if l + 1 < e.layers.len() { "," } else { "" };
                s.push_str(&format!("      {}{sep}\n", j(row)));
            }
            let sep = if k + 1 < f.entries.len() { "," } else { "" };
            s.push_str(&format!("    ]}}{sep}\n"));
        }
        s.push_str("  ],\n  \"decode\": [\n");
        for (k, row) in f.decode.iter().enumerate() {
            let sep = if k + 1 < f.decode.len() { "," } else { "" };
            s.push_str(&format!("    {}{sep}\n", j(row)));
        }
        s.push_str("  ]\n}\n");
        s
    }

    /// The file or name the table was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Everything in the file.
    pub fn file(&self) -> &TableFile {
        &self.file
    }

    /// The KV geometry the table was made for.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    pub fn model(&self) -> &ModelInfo {
        &self.file.model
    }

    pub fn gpu(&self) -> &GpuInfo {
        &self.file.gpu
    }

    pub fn storage(&self) -> &StorageInfo {
        &self.file.storage
    }

    pub fn mode(&self) -> Mode {
        self.file.mode
    }

    pub fn estimated(&self) -> bool {
        self.file.estimated
    }

    pub fn provenance(&self) -> &Provenance {
        &self.file.provenance
    }

    pub fn layers(&self) -> u32 {
        self.geometry.layers
    }

    pub fn input_lengths(&self) -> &[u64] {
        &self.file.input_lengths
    }

    pub fn prefix_lengths(&self) -> &[u64] {
        &self.file.prefix_lengths
    }

    /// The entry of grid point (`input_lengths[i]`, `prefix_lengths[p]`).
    pub fn entry(&self, i: usize, p: usize) -> &Entry {
        &self.file.entries[self.cells[i * self.file.prefix_lengths.len() + p]]
    }

    /// Whether (input, prefix) lies inside the grid (lookups outside are clamped).
    pub fn covers(&self, input: u64, prefix: u64) -> bool {
        let within = |g: &[u64], x: u64| g[0] <= x && x <= g[g.len() - 1];
        within(&self.file.input_lengths, input) && within(&self.file.prefix_lengths, prefix)
    }

    /// Layer `layer` of a prefill of `input` new tokens over `prefix` cached
    /// ones (clamped and interpolated as the module docs say). Errors when the
    /// layer is not one of the model's.
    pub fn layer(&self, input: u64, prefix: u64, layer: u32) -> Result<LayerSlack> {
        if layer >= self.geometry.layers {
            return Err(Error::invalid(format!(
                "slack table {}: layer {layer} asked, but the model has {} layers (0..{})",
                self.source, self.geometry.layers, self.geometry.layers
            )));
        }
        Ok(self.layer_at(input, prefix, layer as usize))
    }

    /// Every layer of a prefill, in order (see [`layer`](Self::layer)).
    pub fn prefill(&self, input: u64, prefix: u64) -> Vec<LayerSlack> {
        (0..self.geometry.layers as usize)
            .map(|l| self.layer_at(input, prefix, l))
            .collect()
    }

    /// Total compute time of a prefill (all layers), µs.
    pub fn prefill_compute_us(&self, input: u64, prefix: u64) -> f64 {
        self.prefill(input, prefix)
            .iter()
            .map(|l| l.compute_us)
            .sum()
    }

    fn layer_at(&self, input: u64, prefix: u64, layer: usize) -> LayerSlack {
        let f = &self.file;
        let (i0, i1, t) = locate(&f.input_lengths, input);
        let (p0, p1, u) = locate(&f.prefix_lengths, prefix);
        let row = |i: usize, p: usize| &self.entry(i, p).layers[layer];
        let (r00, r01, r10, r11) = (row(i0, p0), row(i0, p1), row(i1, p0), row(i1, p1));
        let mix = |get: fn(&LayerRow) -> f64| {
            get(r00) * (1.0 - t) * (1.0 - u)
                + get(r10) * t * (1.0 - u)
                + get(r01) * (1.0 - t) * u
                + get(r11) * t * u
        };
        let input = clamp_to(&f.input_lengths, input);
        let prefix = clamp_to(&f.prefix_lengths, prefix);
        let row = complete_layer(
            &self.geometry,
            &f.gpu,
            &f.storage,
            input,
            prefix,
            mix(|r| r.compute_us),
            mix(|r| r.read_us),
            mix(|r| r.slack_us),
        );
        LayerSlack {
            compute_us: row.compute_us,
            read_us: row.read_us,
            slack_us: row.slack_us,
            sm_budget: row.sm_budget,
            read_iocbs: row.read_iocbs,
            write_iocbs: row.write_iocbs,
            write_budget_bytes: write_budget_bytes(row.slack_us, f.storage.write_gbs),
        }
    }

    /// A decode step at `context` tokens: clamped to the profiled contexts,
    /// linear between them; `write_iocbs` floored from the interpolated slack.
    pub fn decode(&self, context: u64) -> DecodeSlack {
        let f = &self.file;
        let contexts: Vec<u64> = f.decode.iter().map(|d| d.context).collect();
        let (k0, k1, t) = locate(&contexts, context);
        let (a, b) = (&f.decode[k0], &f.decode[k1]);
        let step = a.step_us * (1.0 - t) + b.step_us * t;
        let slack = a.slack_us * (1.0 - t) + b.slack_us * t;
        let context = clamp_to(&contexts, context);
        let row = complete_decode(&self.geometry, &f.gpu, &f.storage, context, step, slack);
        DecodeSlack {
            context,
            step_us: row.step_us,
            slack_us: row.slack_us,
            sm_budget: row.sm_budget,
            write_iocbs: row.write_iocbs,
            write_budget_bytes: write_budget_bytes(row.slack_us, f.storage.write_gbs),
        }
    }

    /// Time to write one full IOCB ([`IOCB_OBJECTS`] objects) on this table's storage, µs.
    pub fn full_iocb_write_us(&self) -> f64 {
        full_iocb_write_us(&self.geometry, self.file.storage.write_gbs)
    }

    /// Errors unless `geometry` is the one the table was made for (its read
    /// times and IOCB counts depend on the object size).
    pub fn check_geometry(&self, geometry: &KvGeometry) -> Result<()> {
        let t = &self.geometry;
        let mut diffs = Vec::new();
        let mut diff = |name: &str, table: String, given: String| {
            if table != given {
                diffs.push(format!("{name} {table} (table) vs {given}"));
            }
        };
        diff("layers", t.layers.to_string(), geometry.layers.to_string());
        diff(
            "kv_heads",
            t.kv_heads.to_string(),
            geometry.kv_heads.to_string(),
        );
        diff(
            "head_dim",
            t.head_dim.to_string(),
            geometry.head_dim.to_string(),
        );
        diff("dtype", t.dtype.to_string(), geometry.dtype.to_string());
        diff(
            "block_size",
            t.block_size.to_string(),
            geometry.block_size.to_string(),
        );
        if diffs.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "slack table {} is for {} ({}), not for this geometry: {}; use the table made for this model, or make one with kvtier-profile --model ... --block-size {}",
            self.source,
            self.file.model.name,
            t.describe(),
            diffs.join(", "),
            geometry.block_size
        )))
    }
}

// ---------------------------------------------------------------------------
// Validation helpers.

fn model_geometry(m: &ModelInfo, src: &str) -> Result<KvGeometry> {
    let dtype = DType::parse(&m.dtype).ok_or_else(|| {
        Error::invalid(format!(
            "{src}: model.dtype is {:?}, not a known KV dtype; use one of {}",
            crate::json::excerpt(&m.dtype, 40),
            DType::ALL.map(DType::name).join(", ")
        ))
    })?;
    let geometry = KvGeometry {
        layers: m.layers,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
        dtype,
        block_size: m.block_size,
    };
    geometry.validate().map_err(|e| {
        let reason = match e {
            Error::ModelConfig { reason, .. } => reason,
            other => other.to_string(),
        };
        // The geometry's field names are those of `model`.
        Error::invalid(format!("{src}: model: {reason}"))
    })?;
    Ok(geometry)
}

fn check_storage(s: &StorageInfo, src: &str) -> Result<()> {
    for (name, v) in [
        ("storage.read_gbs", s.read_gbs),
        ("storage.write_gbs", s.write_gbs),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            return Err(Error::invalid(format!(
                "{src}: {name} is {v:?}; it must be a positive bandwidth in GB/s"
            )));
        }
    }
    if !(s.iocb_service_us >= 0.0 && s.iocb_service_us.is_finite()) {
        return Err(Error::invalid(format!(
            "{src}: storage.iocb_service_us is {:?}; it must be ≥ 0 µs",
            s.iocb_service_us
        )));
    }
    if !(s.source.starts_with("measured on ") || s.source.starts_with("assumed")) {
        return Err(Error::invalid(format!(
            "{src}: storage.source is {:?}; it must say how the numbers were obtained: \"measured on <pool dir> ...\" or \"assumed: ...\"",
            crate::json::excerpt(&s.source, 60)
        )));
    }
    Ok(())
}

fn check_grid(grid: &[u64], name: &str, min: u64, src: &str) -> Result<()> {
    if grid.is_empty() {
        return Err(Error::invalid(format!(
            "{src}: {name} is empty; a grid needs at least one value"
        )));
    }
    if grid[0] < min {
        return Err(Error::invalid(format!(
            "{src}: {name}[0] is {}; values must be at least {min}",
            grid[0]
        )));
    }
    for k in 1..grid.len() {
        if grid[k] <= grid[k - 1] {
            return Err(Error::invalid(format!(
                "{src}: {name} is not strictly increasing: {name}[{k}] is {} after {name}[{}] = {}; list each value once, ascending",
                grid[k],
                k - 1,
                grid[k - 1]
            )));
        }
    }
    Ok(())
}

/// The longest time a table may hold, µs (a day): past it a value is a
/// mistake, and it would overflow the durations a replay sleeps for.
const MAX_TIME_US: f64 = 86_400e6;

fn check_time(v: f64, path: &str, src: &str) -> Result<()> {
    if v < 0.0 {
        return Err(Error::invalid(format!(
            "{src}: {path} is negative ({v:?}); times are ≥ 0 µs"
        )));
    }
    if v.is_nan() || v > MAX_TIME_US {
        return Err(Error::invalid(format!(
            "{src}: {path} is {v:?}; times are at most {MAX_TIME_US:e} µs (a day)"
        )));
    }
    Ok(())
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= TIME_TOLERANCE_US
}

const REGENERATE: &str =
    "derived columns follow from the times and the storage numbers: regenerate the table with kvtier-profile instead of editing it";

fn check_layer(
    geometry: &KvGeometry,
    file: &TableFile,
    input: u64,
    prefix: u64,
    row: &LayerRow,
    path: &str,
    src: &str,
) -> Result<()> {
    let err = |what: String| Error::invalid(format!("{src}: {path}.{what}; {REGENERATE}"));
    check_time(row.compute_us, &format!("{path}.compute_us"), src)?;
    check_time(row.read_us, &format!("{path}.read_us"), src)?;
    let want_read = read_us(geometry, file.storage.read_gbs, prefix);
    if !near(row.read_us, want_read) {
        return Err(err(format!(
            "read_us is {:?} but reading {} prefix tokens ({} blocks x 2 objects of {} B) at storage.read_gbs {} takes {want_read:?}",
            row.read_us,
            prefix,
            geometry.tokens_to_blocks(prefix),
            geometry.object_bytes(),
            file.storage.read_gbs
        )));
    }
    if !near(row.slack_us, row.compute_us - row.read_us) {
        return Err(err(format!(
            "slack_us is {:?} but compute_us - read_us is {:?}",
            row.slack_us,
            row.compute_us - row.read_us
        )));
    }
    let want = complete_layer(
        geometry,
        &file.gpu,
        &file.storage,
        input,
        prefix,
        row.compute_us,
        row.read_us,
        row.slack_us,
    );
    if row.read_iocbs != want.read_iocbs {
        return Err(err(format!(
            "read_iocbs is {} but {} prefix tokens need {} (ceil(2 x {} blocks / {IOCB_OBJECTS}))",
            row.read_iocbs,
            prefix,
            want.read_iocbs,
            geometry.tokens_to_blocks(prefix)
        )));
    }
    if row.write_iocbs != want.write_iocbs {
        return Err(err(format!(
            "write_iocbs is {} but {} of the layer's new-KV IOCBs ({} input tokens) fit in slack_us {:?} at storage.write_gbs {}",
            row.write_iocbs, want.write_iocbs, input, row.slack_us, file.storage.write_gbs
        )));
    }
    if row.sm_budget != want.sm_budget {
        return Err(err(format!(
            "sm_budget is {} but the rule gives {} (between {SM_BUDGET_MIN} and {} of gpu.sms {}, by the I/O fraction of compute_us)",
            row.sm_budget,
            want.sm_budget,
            sm_budget_max(file.gpu.sms),
            file.gpu.sms
        )));
    }
    Ok(())
}

fn check_decode(
    geometry: &KvGeometry,
    file: &TableFile,
    row: &DecodeRow,
    path: &str,
    src: &str,
) -> Result<()> {
    let err = |what: String| Error::invalid(format!("{src}: {path}.{what}; {REGENERATE}"));
    check_time(row.step_us, &format!("{path}.step_us"), src)?;
    let own = decode_own_write_us(geometry, file.storage.write_gbs);
    if !near(row.slack_us, row.step_us - own) {
        return Err(err(format!(
            "slack_us is {:?} but step_us minus the step's own KV write ({own:.3} µs) is {:?}",
            row.slack_us,
            row.step_us - own
        )));
    }
    let want = complete_decode(
        geometry,
        &file.gpu,
        &file.storage,
        row.context,
        row.step_us,
        row.slack_us,
    );
    if row.write_iocbs != want.write_iocbs {
        return Err(err(format!(
            "write_iocbs is {} but {} full IOCBs ({:.3} µs each at storage.write_gbs {}) fit in slack_us {:?}",
            row.write_iocbs,
            want.write_iocbs,
            full_iocb_write_us(geometry, file.storage.write_gbs),
            file.storage.write_gbs,
            row.slack_us
        )));
    }
    if row.sm_budget != want.sm_budget {
        return Err(err(format!(
            "sm_budget is {} but the rule gives {}",
            row.sm_budget, want.sm_budget
        )));
    }
    Ok(())
}

fn is_date(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    if !(digits(0..4) && digits(5..7) && digits(8..10)) {
        return false;
    }
    let month: u32 = s[5..7].parse().unwrap_or(0);
    let day: u32 = s[8..10].parse().unwrap_or(0);
    (1..=12).contains(&month) && (1..=31).contains(&day)
}

/// The grid cell holding `x`: (lower index, upper index, weight of the upper).
/// Outside the grid both indices are the nearest edge and the weight is 0.
fn locate(grid: &[u64], x: u64) -> (usize, usize, f64) {
    let n = grid.len();
    if x <= grid[0] {
        return (0, 0, 0.0);
    }
    if x >= grid[n - 1] {
        return (n - 1, n - 1, 0.0);
    }
    let hi = grid.partition_point(|&g| g <= x);
    let lo = hi - 1;
    if grid[lo] == x {
        return (lo, lo, 0.0);
    }
    (lo, hi, (x - grid[lo]) as f64 / (grid[hi] - grid[lo]) as f64)
}

fn clamp_to(grid: &[u64], x: u64) -> u64 {
    x.clamp(grid[0], grid[grid.len() - 1])
}

// ---------------------------------------------------------------------------
// The shape check: the schema as data, walked with the path of every value,
// so a wrong or missing field is named (`entries[3].layers[7].compute_us`)
// before serde builds the typed table.

#[derive(Clone, Copy)]
enum Ty {
    Str,
    Num,
    U32,
    U64,
    Bool,
    OneOf(&'static [&'static str]),
    Obj(&'static [Field]),
    Arr(&'static Ty),
}

struct Field {
    name: &'static str,
    ty: Ty,
    about: &'static str,
}

const fn field(name: &'static str, ty: Ty, about: &'static str) -> Field {
    Field { name, ty, about }
}

const MODEL_FIELDS: &[Field] = &[
    field("name", Ty::Str, "a string: the model's name"),
    field("layers", Ty::U32, "an integer: transformer layers"),
    field("kv_heads", Ty::U32, "an integer: KV heads per layer"),
    field("head_dim", Ty::U32, "an integer: elements per head"),
    field(
        "dtype",
        Ty::Str,
        "a string: the KV dtype, e.g. \"bfloat16\"",
    ),
    field("block_size", Ty::U32, "an integer: tokens per KV block"),
    field(
        "hidden_size",
        Ty::U32,
        "an integer: the model's hidden size",
    ),
    field(
        "intermediate_size",
        Ty::U32,
        "an integer: the MLP's intermediate size",
    ),
    field(
        "attention_heads",
        Ty::U32,
        "an integer: query heads per layer",
    ),
];
const GPU_FIELDS: &[Field] = &[
    field("name", Ty::Str, "a string: the GPU's name"),
    field("sms", Ty::U32, "an integer: streaming multiprocessors"),
    field("bf16_tflops", Ty::Num, "a number: dense bf16 peak TFLOPS"),
    field("hbm_gbs", Ty::Num, "a number: HBM bandwidth in GB/s"),
];
const STORAGE_FIELDS: &[Field] = &[
    field("read_gbs", Ty::Num, "a number: read bandwidth in GB/s"),
    field("write_gbs", Ty::Num, "a number: write bandwidth in GB/s"),
    field(
        "iocb_service_us",
        Ty::Num,
        "a number: one IOCB's service time in µs",
    ),
    field(
        "source",
        Ty::Str,
        "a string: \"measured on <dir> ...\" or \"assumed: ...\"",
    ),
];
const PROVENANCE_FIELDS: &[Field] = &[
    field("machine", Ty::Str, "a string: the profiling machine"),
    field("kernel", Ty::Str, "a string: its kernel release"),
    field("kvtier_version", Ty::Str, "a string: the kvtier version"),
    field("date", Ty::Str, "a string: YYYY-MM-DD"),
    field("command", Ty::Str, "a string: the profiler command line"),
    field("method", Ty::Str, "a string: how the times were obtained"),
];
const LAYER_FIELDS: &[Field] = &[
    field(
        "compute_us",
        Ty::Num,
        "a number: the layer's compute window in µs",
    ),
    field(
        "read_us",
        Ty::Num,
        "a number: the layer's prefix read time in µs",
    ),
    field("slack_us", Ty::Num, "a number: compute_us - read_us"),
    field(
        "sm_budget",
        Ty::U32,
        "an integer: SMs the I/O kernel may use",
    ),
    field(
        "read_iocbs",
        Ty::U32,
        "an integer: IOCBs the layer's reads need",
    ),
    field(
        "write_iocbs",
        Ty::U32,
        "an integer: new-KV write IOCBs that fit in the slack",
    ),
];
const LAYER_TY: Ty = Ty::Obj(LAYER_FIELDS);
const ENTRY_FIELDS: &[Field] = &[
    field(
        "input",
        Ty::U64,
        "an integer: the grid point's input length",
    ),
    field(
        "prefix",
        Ty::U64,
        "an integer: the grid point's prefix length",
    ),
    field("layers", Ty::Arr(&LAYER_TY), "an array: one row per layer"),
];
const ENTRY_TY: Ty = Ty::Obj(ENTRY_FIELDS);
const DECODE_FIELDS: &[Field] = &[
    field("context", Ty::U64, "an integer: tokens in context"),
    field("step_us", Ty::Num, "a number: one decode step in µs"),
    field(
        "slack_us",
        Ty::Num,
        "a number: the step's write window in µs",
    ),
    field(
        "sm_budget",
        Ty::U32,
        "an integer: SMs the I/O kernel may use",
    ),
    field(
        "write_iocbs",
        Ty::U32,
        "an integer: full write IOCBs that fit",
    ),
];
const DECODE_TY: Ty = Ty::Obj(DECODE_FIELDS);
const U64_TY: Ty = Ty::U64;
const TABLE_FIELDS: &[Field] = &[
    field("schema", Ty::Str, "the string \"kvtier-slack/1\""),
    field("model", Ty::Obj(MODEL_FIELDS), "an object: the model"),
    field("gpu", Ty::Obj(GPU_FIELDS), "an object: the GPU"),
    field("storage", Ty::Obj(STORAGE_FIELDS), "an object: the SSDs"),
    field(
        "mode",
        Ty::OneOf(&["analytic", "trace", "torch"]),
        "one of \"analytic\", \"trace\", \"torch\"",
    ),
    field(
        "estimated",
        Ty::Bool,
        "true or false: are the compute times estimates",
    ),
    field(
        "provenance",
        Ty::Obj(PROVENANCE_FIELDS),
        "an object: machine, kernel, kvtier_version, date, command, method",
    ),
    field(
        "input_lengths",
        Ty::Arr(&U64_TY),
        "an array of integers: the grid's input lengths",
    ),
    field(
        "prefix_lengths",
        Ty::Arr(&U64_TY),
        "an array of integers: the grid's prefix lengths",
    ),
    field(
        "entries",
        Ty::Arr(&ENTRY_TY),
        "an array: one entry per grid point",
    ),
    field(
        "decode",
        Ty::Arr(&DECODE_TY),
        "an array: one row per decode context",
    ),
];
const TABLE_TY: Ty = Ty::Obj(TABLE_FIELDS);

/// `v` shortened for an error message.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

fn check_shape(v: &Value, ty: Ty, path: &str, src: &str) -> Result<()> {
    let wrong = |expected: &str| {
        Error::invalid(format!(
            "{src}: {} is {} ({}); it must be {expected}",
            if path.is_empty() {
                "the top level"
            } else {
                path
            },
            shown(v),
            json_kind(v)
        ))
    };
    match ty {
        Ty::Str => v.is_string().then_some(()).ok_or_else(|| wrong("a string")),
        Ty::Num => v.is_number().then_some(()).ok_or_else(|| wrong("a number")),
        Ty::Bool => v
            .is_boolean()
            .then_some(())
            .ok_or_else(|| wrong("true or false")),
        Ty::U32 | Ty::U64 => {
            let max = if matches!(ty, Ty::U32) {
                u64::from(u32::MAX)
            } else {
                u64::MAX
            };
            match v.as_u64() {
                Some(n) if n <= max => Ok(()),
                Some(_) => Err(wrong(&format!("an integer of at most {max}"))),
                None if v.as_i64().is_some() => Err(Error::invalid(format!(
                    "{src}: {path} is negative ({v}); it must be an integer ≥ 0"
                ))),
                None => Err(wrong("a non-negative integer")),
            }
        }
        Ty::OneOf(choices) => match v.as_str() {
            Some(s) if choices.contains(&s) => Ok(()),
            _ => Err(wrong(&format!(
                "one of {}",
                choices
                    .iter()
                    .map(|c| format!("\"{c}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        },
        Ty::Arr(inner) => {
            let Value::Array(items) = v else {
                return Err(wrong("an array"));
            };
            for (k, item) in items.iter().enumerate() {
                check_shape(item, *inner, &format!("{path}[{k}]"), src)?;
            }
            Ok(())
        }
        Ty::Obj(fields) => {
            let Value::Object(map) = v else {
                return Err(wrong("an object"));
            };
            let join = |key: &str| {
                if path.is_empty() {
                    key.to_string()
                } else {
                    format!("{path}.{key}")
                }
            };
            for key in map.keys() {
                if !fields.iter().any(|f| f.name == key) {
                    return Err(Error::invalid(format!(
                        "{src}: {} is not a field of a {SCHEMA} table; remove it or correct its name (the fields here are {})",
                        crate::json::excerpt(&join(key), 80),
                        fields.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
                    )));
                }
            }
            for f in fields {
                match map.get(f.name) {
                    None => {
                        return Err(Error::invalid(format!(
                            "{src}: {} is missing ({}); add it",
                            join(f.name),
                            f.about
                        )))
                    }
                    Some(x) => check_shape(x, f.ty, &join(f.name), src)?,
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2-layer llama-shaped model: objects of 32 KiB.
    fn header() -> TableHeader {
        TableHeader {
            model: ModelInfo {
                name: "tiny".into(),
                layers: 2,
                kv_heads: 8,
                head_dim: 128,
                dtype: "bfloat16".into(),
                block_size: 16,
                hidden_size: 4096,
                intermediate_size: 14336,
                attention_heads: 32,
            },
            gpu: GpuInfo {
                name: "H100-SXM".into(),
                sms: 132,
                bf16_tflops: 989.0,
                hbm_gbs: 3350.0,
            },
            storage: StorageInfo {
                read_gbs: 8.0,
                write_gbs: 4.0,
                iocb_service_us: 80.0,
                source: "assumed: test".into(),
            },
            mode: Mode::Analytic,
            estimated: true,
            provenance: Provenance {
                machine: "test".into(),
                kernel: "6.1".into(),
                kvtier_version: "0.1.0".into(),
                date: "2025-01-31".into(),
                command: "kvtier-profile --model tiny".into(),
                method: "test".into(),
            },
        }
    }

    /// Grid inputs [1024, 4096], prefixes [0, 2048, 8192]; compute of layer l at
    /// (input, prefix) = input/10 + prefix/100 + l (µs).
    fn tiny() -> SlackTable {
        let inputs = vec![1024, 4096];
        let prefixes = vec![0, 2048, 8192];
        let mut compute = Vec::new();
        for &i in &inputs {
            for &p in &prefixes {
                compute.push(
                    (0..2)
                        .map(|l| i as f64 / 10.0 + p as f64 / 100.0 + l as f64)
                        .collect(),
                );
            }
        }
        SlackTable::build(
            header(),
            inputs,
            prefixes,
            &compute,
            &[(1024, 3000.0), (4096, 5000.0)],
            "tiny.json",
        )
        .unwrap()
    }

    fn edit(f: impl FnOnce(&mut Value)) -> String {
        let mut v: Value = serde_json::from_str(&tiny().to_json_string()).unwrap();
        f(&mut v);
        v.to_string()
    }

    fn rejected(text: &str) -> String {
        match SlackTable::from_json_str(text, "tables/x.json") {
            Ok(_) => panic!("expected an error"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("tables/x.json: "), "{msg}");
                msg
            }
        }
    }

    #[test]
    fn round_trip_and_serde_agree() {
        let t = tiny();
        let text = t.to_json_string();
        let back = SlackTable::from_json_str(&text, "t").unwrap();
        assert_eq!(back.file(), t.file());
        // The shape check and serde's derive describe the same fields.
        let direct: TableFile = serde_json::from_str(&text).unwrap();
        assert_eq!(&direct, t.file());
        let v: Value = serde_json::from_str(&text).unwrap();
        check_shape(&v, TABLE_TY, "", "t").unwrap();
    }

    #[test]
    fn derived_columns() {
        let t = tiny();
        let g = t.geometry();
        assert_eq!(g.object_bytes(), 32768);
        // prefix 2048 tokens = 128 blocks = 256 objects x 32 KiB = 8 MiB at 8 GB/s.
        let r = t.entry(0, 1).layers[0];
        assert_eq!(r.read_us, round_us(8_388_608.0 / 8e3));
        assert_eq!(r.compute_us, round_us(102.4 + 20.48));
        assert_eq!(r.slack_us, round_us(r.compute_us - r.read_us));
        assert_eq!(r.read_iocbs, 1);
        assert_eq!(r.write_iocbs, 0);
        assert_eq!(r.sm_budget, 8);
        // No prefix: nothing to read, all compute is slack; input 1024 =
        // 64 blocks = 128 objects = 4 MiB at 4 GB/s = 1048.576 µs > 102.4 µs.
        let r = t.entry(0, 0).layers[0];
        assert_eq!((r.read_us, r.read_iocbs, r.write_iocbs), (0.0, 0, 0));
        assert_eq!(r.sm_budget, SM_BUDGET_MIN);
        // 8192-token prefix: 1024 objects, still one IOCB.
        assert_eq!(read_iocbs(&g, 8192), 1);
        assert_eq!(read_iocbs(&g, 16384), 1);
        assert_eq!(read_iocbs(&g, 16385), 2);
        assert_eq!(read_iocbs(&g, 131072), 8);
    }

    #[test]
    fn write_fit_and_sm_rules() {
        let g = tiny().geometry();
        // 4096 input tokens = 512 objects = 16 MiB: 4194.304 µs at 4 GB/s.
        assert_eq!(write_iocbs_fit(&g, 4.0, 4096, 4194.0), (0, 0.0));
        assert_eq!(write_iocbs_fit(&g, 4.0, 4096, 4194.4).0, 1);
        assert_eq!(write_iocbs_fit(&g, 4.0, 4096, -5.0).0, 0);
        // 65536 tokens = 8192 objects = 4 full IOCBs of 64 MiB, 16777.216 µs each.
        let full = full_iocb_write_us(&g, 4.0);
        assert!((full - 16777.216).abs() < 1e-6);
        assert_eq!(write_iocbs_fit(&g, 4.0, 65536, full * 2.5).0, 2);
        assert_eq!(write_iocbs_fit(&g, 4.0, 65536, full * 10.0).0, 4);
        assert_eq!(full_write_iocbs_fit(&g, 4.0, full * 3.99), 3);
        assert_eq!(full_write_iocbs_fit(&g, 4.0, -1.0), 0);
        assert_eq!(sm_budget_max(132), 8);
        assert_eq!(sm_budget_max(16), 2);
        assert_eq!(sm_budget(132, 100.0, 0.0), 2);
        assert_eq!(sm_budget(132, 100.0, 30.0), 3);
        assert_eq!(sm_budget(132, 100.0, 500.0), 8);
        assert_eq!(sm_budget(132, 0.0, 1.0), 8);
        assert_eq!(sm_budget(132, 0.0, 0.0), 2);
    }

    #[test]
    fn lookup_at_grid_points_is_the_row() {
        let t = tiny();
        for (i, &input) in t.input_lengths().iter().enumerate() {
            for (p, &prefix) in t.prefix_lengths().iter().enumerate() {
                for l in 0..2 {
                    let row = t.entry(i, p).layers[l as usize];
                    let s = t.layer(input, prefix, l).unwrap();
                    assert_eq!(
                        (
                            s.compute_us,
                            s.read_us,
                            s.slack_us,
                            s.sm_budget,
                            s.read_iocbs,
                            s.write_iocbs
                        ),
                        (
                            row.compute_us,
                            row.read_us,
                            row.slack_us,
                            row.sm_budget,
                            row.read_iocbs,
                            row.write_iocbs
                        )
                    );
                }
            }
        }
        let d = t.decode(4096);
        assert_eq!(
            (d.step_us, d.slack_us, d.write_iocbs, d.sm_budget),
            (
                t.file().decode[1].step_us,
                t.file().decode[1].slack_us,
                t.file().decode[1].write_iocbs,
                t.file().decode[1].sm_budget
            )
        );
    }

    #[test]
    fn bilinear_inside_clamped_outside() {
        let t = tiny();
        // Compute is linear in input and prefix here, so bilinear is exact.
        let s = t.layer(2560, 5120, 1).unwrap();
        assert!((s.compute_us - (256.0 + 51.2 + 1.0)).abs() < 1e-9, "{s:?}");
        // Read: halfway between 2048 (8 MiB) and 8192 (32 MiB) prefix tokens.
        let want_read =
            (read_us(&t.geometry(), 8.0, 2048) + read_us(&t.geometry(), 8.0, 8192)) / 2.0;
        assert!((s.read_us - want_read).abs() < 1e-9);
        assert!((s.slack_us - (s.compute_us - s.read_us)).abs() < 0.01);
        assert_eq!(s.read_iocbs, 1);
        // Outside: clamped to the nearest edge.
        let lo = t.layer(1, 0, 0).unwrap();
        assert_eq!(lo.compute_us, t.entry(0, 0).layers[0].compute_us);
        let hi = t.layer(1 << 20, 1 << 30, 0).unwrap();
        assert_eq!(hi.compute_us, t.entry(1, 2).layers[0].compute_us);
        assert_eq!(hi.read_iocbs, t.entry(1, 2).layers[0].read_iocbs);
        assert!(!t.covers(1, 0) && t.covers(1024, 0) && !t.covers(4096, 8193));
        // Half-way in input only.
        let m = t.layer(2560, 0, 0).unwrap();
        assert!((m.compute_us - 256.0).abs() < 1e-9);
        assert!(t.layer(1024, 0, 2).is_err());
        assert_eq!(t.prefill(2560, 5120).len(), 2);
        let total = t.prefill_compute_us(1024, 0);
        assert!((total - (102.4 + 103.4)).abs() < 1e-9);
    }

    #[test]
    fn write_iocbs_floor_from_interpolated_slack() {
        // One layer of 4096-token input needs 4194.304 µs of writing (4 GB/s);
        // make the slack cross it between two grid points.
        let mut h = header();
        h.model.layers = 1;
        let t = SlackTable::build(
            h,
            vec![4096],
            vec![0, 1024],
            &[vec![4000.0], vec![6000.0]],
            &[(1, 10.0)],
            "x",
        )
        .unwrap();
        assert_eq!(t.entry(0, 0).layers[0].write_iocbs, 0);
        // prefix 1024: read 2 MiB at 8 GB/s = 262.144 µs; slack 5737.856: fits.
        assert_eq!(t.entry(0, 1).layers[0].write_iocbs, 1);
        // At prefix 128: compute 4250, read 65.536, slack 4184.464: below 4194.304, none fits.
        let s = t.layer(4096, 128, 0).unwrap();
        assert!(s.slack_us < 4194.304, "{s:?}");
        assert_eq!(s.write_iocbs, 0);
        // At prefix 256: compute 4500, read 131.072, slack 4368.928: one fits.
        let s = t.layer(4096, 256, 0).unwrap();
        assert!(s.slack_us > 4194.304, "{s:?}");
        assert_eq!(s.write_iocbs, 1);
    }

    #[test]
    fn decode_interpolates_and_clamps() {
        let t = tiny();
        let own = decode_own_write_us(&t.geometry(), 4.0);
        // 2 layers x 2 x 8 heads x 128 x 2 B = 8 KiB per token at 4 GB/s.
        assert!((own - 2.048).abs() < 1e-9);
        let d = t.decode(2560);
        assert!((d.step_us - 4000.0).abs() < 1e-9);
        assert!((d.slack_us - (4000.0 - own)).abs() < 0.002);
        assert_eq!(d.context, 2560);
        let lo = t.decode(1);
        assert_eq!((lo.context, lo.step_us), (1024, 3000.0));
        let hi = t.decode(1 << 40);
        assert_eq!((hi.context, hi.step_us), (4096, 5000.0));
        // Full IOCB: 2048 x 32 KiB = 64 MiB at 4 GB/s = 16.8 ms: none fits in 5 ms.
        assert_eq!(hi.write_iocbs, 0);
        // ...but 5 ms of slack at 4 GB/s is ~20 MB of writes.
        assert_eq!(hi.write_budget_bytes, ((5000.0 - own) * 4e3).floor() as u64);
        let s = t.layer(1024, 0, 0).unwrap();
        assert_eq!(s.write_budget_bytes, (s.slack_us * 4e3).floor() as u64);
        let s = t.layer(1024, 8192, 0).unwrap();
        assert!(s.slack_us < 0.0);
        assert_eq!((s.write_budget_bytes, s.write_window_us()), (0, 0.0));
        assert_eq!(s.bubble_us(), -s.slack_us);
    }

    #[test]
    fn check_geometry_names_the_difference() {
        let t = tiny();
        let mut g = t.geometry();
        t.check_geometry(&g).unwrap();
        g.block_size = 32;
        let msg = t.check_geometry(&g).unwrap_err().to_string();
        assert!(msg.contains("block_size 16 (table) vs 32"), "{msg}");
        assert!(msg.contains("tiny.json"), "{msg}");
        let g = crate::model::preset("llama3-8b", 16).unwrap();
        let msg = t.check_geometry(&g).unwrap_err().to_string();
        assert!(msg.contains("layers 2 (table) vs 32"), "{msg}");
    }

    #[test]
    fn negative_time_is_named() {
        let text = edit(|v| v["entries"][3]["layers"][1]["compute_us"] = (-1.0).into());
        let msg = rejected(&text);
        assert!(
            msg.contains("tables/x.json: entries[3].layers[1].compute_us is negative (-1.0)"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_or_missing_schema() {
        let msg = rejected(&edit(|v| v["schema"] = "kvtier-slack/9".into()));
        assert!(
            msg.contains("schema is \"kvtier-slack/9\", not \"kvtier-slack/1\""),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v.as_object_mut().unwrap().remove("schema");
        }));
        assert!(msg.contains("schema is missing"), "{msg}");
        let msg = rejected("[1, 2]");
        assert!(msg.contains("the top level is an array"), "{msg}");
        let msg = rejected("{\"schema\": ");
        assert!(msg.contains("not valid JSON at line 1"), "{msg}");
    }

    #[test]
    fn layer_count_must_match_model() {
        let msg = rejected(&edit(|v| {
            v["entries"][2]["layers"].as_array_mut().unwrap().pop();
        }));
        assert!(
            msg.contains("entries[2].layers has 1 rows but model.layers is 2"),
            "{msg}"
        );
    }

    #[test]
    fn grid_must_increase() {
        let msg = rejected(&edit(|v| {
            v["prefix_lengths"] = serde_json::json!([0, 2048, 2048])
        }));
        assert!(
            msg.contains("prefix_lengths is not strictly increasing: prefix_lengths[2] is 2048 after prefix_lengths[1] = 2048"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["input_lengths"] = serde_json::json!([4096, 1024])
        }));
        assert!(
            msg.contains("input_lengths is not strictly increasing"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["input_lengths"] = serde_json::json!([])));
        assert!(msg.contains("input_lengths is empty"), "{msg}");
        let msg = rejected(&edit(|v| v["decode"][1]["context"] = 10.into()));
        assert!(msg.contains("decode[1].context is 10"), "{msg}");
    }

    #[test]
    fn missing_duplicate_and_stray_entries() {
        let msg = rejected(&edit(|v| {
            v["entries"].as_array_mut().unwrap().remove(4);
        }));
        assert!(
            msg.contains("entries has no entry for grid point (input 4096, prefix 2048)"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            let e = v["entries"][0].clone();
            v["entries"][4] = e;
        }));
        assert!(
            msg.contains("entries[4] repeats grid point (input 1024, prefix 0) of entries[0]"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["entries"][1]["input"] = 1000.into()));
        assert!(
            msg.contains("entries[1].input is 1000, which is not in input_lengths"),
            "{msg}"
        );
    }

    #[test]
    fn fields_named_when_missing_mistyped_or_unknown() {
        let msg = rejected(&edit(|v| {
            v["entries"][5]["layers"][0]
                .as_object_mut()
                .unwrap()
                .remove("slack_us");
        }));
        assert!(
            msg.contains("entries[5].layers[0].slack_us is missing"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][0]["layers"][1]["read_us"] = "fast".into()
        }));
        assert!(
            msg.contains(
                "entries[0].layers[1].read_us is \"fast\" (a string); it must be a number"
            ),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][0]["layers"][1]["compute_ms"] = 1.into()
        }));
        assert!(
            msg.contains("entries[0].layers[1].compute_ms is not a field"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["gpu"]["sms"] = (-4).into()));
        assert!(msg.contains("gpu.sms is negative (-4)"), "{msg}");
        let msg = rejected(&edit(|v| v["mode"] = "guess".into()));
        assert!(msg.contains("mode is \"guess\""), "{msg}");
        let msg = rejected(&edit(|v| v["storage"]["read_gbs"] = 0.into()));
        assert!(
            msg.contains("storage.read_gbs is 0.0; it must be a positive"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["provenance"]["date"] = "31/01/2025".into()));
        assert!(msg.contains("provenance.date is \"31/01/2025\""), "{msg}");
        let msg = rejected(&edit(|v| v["estimated"] = false.into()));
        assert!(
            msg.contains("estimated is false but mode is \"analytic\""),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["model"]["dtype"] = "int3".into()));
        assert!(msg.contains("model.dtype is \"int3\""), "{msg}");
        let msg = rejected(&edit(|v| v["model"]["block_size"] = 1.into()));
        assert!(msg.contains("model: object size 2048 B"), "{msg}");
        let msg = rejected(&edit(|v| v["storage"]["source"] = "guessed".into()));
        assert!(msg.contains("storage.source is \"guessed\""), "{msg}");
    }

    #[test]
    fn derived_columns_are_checked() {
        let msg = rejected(&edit(|v| {
            v["entries"][1]["layers"][0]["slack_us"] = 5.0.into()
        }));
        assert!(
            msg.contains("entries[1].layers[0].slack_us is 5.0 but compute_us - read_us"),
            "{msg}"
        );
        assert!(
            msg.contains("regenerate the table with kvtier-profile"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][1]["layers"][0]["write_iocbs"] = 7.into()
        }));
        assert!(
            msg.contains("entries[1].layers[0].write_iocbs is 7 but 0"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][1]["layers"][0]["read_iocbs"] = 3.into()
        }));
        assert!(
            msg.contains("entries[1].layers[0].read_iocbs is 3 but"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][1]["layers"][0]["sm_budget"] = 1.into()
        }));
        assert!(
            msg.contains("entries[1].layers[0].sm_budget is 1 but the rule gives 8"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| {
            v["entries"][1]["layers"][0]["read_us"] = 1.0.into()
        }));
        assert!(
            msg.contains("entries[1].layers[0].read_us is 1.0 but reading 2048 prefix tokens"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["decode"][0]["write_iocbs"] = 2.into()));
        assert!(
            msg.contains("decode[0].write_iocbs is 2 but 0 full IOCBs"),
            "{msg}"
        );
        let msg = rejected(&edit(|v| v["decode"][0]["step_us"] = (-3.0).into()));
        assert!(
            msg.contains("decode[0].step_us is negative (-3.0)"),
            "{msg}"
        );
    }

    #[test]
    fn locate_cells() {
        let g = [0, 10, 30];
        assert_eq!(locate(&g, 0), (0, 0, 0.0));
        assert_eq!(locate(&g, 5), (0, 1, 0.5));
        assert_eq!(locate(&g, 10), (1, 1, 0.0));
        assert_eq!(locate(&g, 20), (1, 2, 0.5));
        assert_eq!(locate(&g, 99), (2, 2, 0.0));
        assert_eq!(locate(&[7], 3), (0, 0, 0.0));
        assert_eq!(locate(&[7], 9), (0, 0, 0.0));
        assert!(is_date("2025-01-31") && !is_date("2025-13-01") && !is_date("2025-1-31"));
    }
}
