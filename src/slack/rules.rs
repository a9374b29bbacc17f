//! The rules the derived columns follow: transfer times, IOCB counts and SM budgets,
//! used alike by the profiler that writes a table and the loader that checks one.

use super::*;

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
pub(super) fn complete_layer(
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

pub(super) fn complete_decode(
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
