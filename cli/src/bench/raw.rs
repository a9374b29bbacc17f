//! `kvtier bench --pattern ...`: kvtier's own I/O path (gio_uring IOCBs
//! executed by the io_uring engine) on a plain file, driven like fio drives
//! its io_uring engine, so the two can be run on the same file in the same
//! run and compared as a ratio.
//!
//! Like fio: `iodepth` I/Os in flight; as completions arrive the freed slots
//! are refilled and the whole refill is submitted with one io_uring_enter;
//! random offsets are uniform and `bs`-aligned; time-based when a runtime is
//! given. Unlike fio: every I/O is an IOCTX in an IOCB, so what is measured
//! is the path the tier uses.

use super::cpu_times;
use super::fio::{IoResult, Pattern, Workload};
use kvtier::engine::uring::{UringConfig, UringDevice, UringEngine};
use kvtier::engine::IoEngine;
use kvtier::error::{Error, Result};
use kvtier::p2p::P2pTable;
use kvtier::ring::abi::*;
use kvtier::ring::IocbId;
use kvtier::submitter::Submitter;
use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One stream of I/O: reads or writes over a region of the file.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    pub pattern: Pattern,
    /// Slots of in-flight I/O this stream owns.
    pub iodepth: u32,
    pub region: (u64, u64),
}

/// splitmix64: cheap, good enough for offsets.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

struct Slot {
    stream: usize,
    op: u8,
    started: Instant,
}

/// What the engine did during a raw run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EngineReport {
    pub describe: String,
    pub stats: kvtier::engine::EngineStats,
    /// Share of the I/O buffers backed by huge pages: with 4 KiB pages an
    /// 80 KiB I/O is 20 DMA segments instead of one or two, which a VM's
    /// virtio disk pays for (fio's buffers are 4 KiB pages).
    pub huge_page_share: Option<f64>,
}

/// Run one workload (fio's vocabulary) through kvtier's engine; the I/Os
/// take their buffers in turn from `buffer_bytes` of memory (at least
/// iodepth x bs, which is fio's buffer).
pub fn run(
    w: &Workload,
    buffer_bytes: u64,
    engine_cfg: &UringConfig,
) -> Result<(IoResult, EngineReport)> {
    run_whole(None, w, buffer_bytes, engine_cfg)
}

/// [`run`] on `file`, a descriptor the caller holds (a scratch pool file in
/// direct-I/O mode), never reopening `w.file` by name.
pub fn run_on(
    file: &std::fs::File,
    w: &Workload,
    buffer_bytes: u64,
    engine_cfg: &UringConfig,
) -> Result<(IoResult, EngineReport)> {
    run_whole(Some(file), w, buffer_bytes, engine_cfg)
}

/// One stream over the whole workload region, on `file` or `w.file` by name.
fn run_whole(
    file: Option<&std::fs::File>,
    w: &Workload,
    buffer_bytes: u64,
    engine_cfg: &UringConfig,
) -> Result<(IoResult, EngineReport)> {
    let streams = vec![Stream {
        pattern: w.pattern,
        iodepth: w.iodepth,
        region: (w.offset, w.offset.saturating_add(w.size)),
    }];
    run_streams_with(file, w, &streams, buffer_bytes, engine_cfg)
}

/// The most memory `--buffers` may spread I/Os over.
pub const MAX_BUFFER_BYTES: u64 = 64 << 30;

/// Run several streams at once on one file (the contention benchmark).
pub fn run_streams(
    w: &Workload,
    streams: &[Stream],
    buffer_bytes: u64,
    engine_cfg: &UringConfig,
) -> Result<(IoResult, EngineReport)> {
    run_streams_with(None, w, streams, buffer_bytes, engine_cfg)
}

/// Check a raw workload's numbers, before anything is laid out or allocated
/// (a 4 GiB --size took 18 s to lay out before a bad --bs was refused):
/// the block size, the streams' regions, the depth, and the buffer memory.
/// Returns the buffer slots the run takes.
pub fn check_workload(w: &Workload, streams: &[Stream], buffer_bytes: u64) -> Result<u32> {
    if w.bs == 0 || w.bs % 4096 != 0 || w.bs > u32::MAX as u64 {
        return Err(Error::invalid(format!(
            "--bs {} must be a non-zero multiple of 4096 (direct I/O)",
            w.bs
        )));
    }
    for s in streams {
        if s.region.1 < s.region.0 + w.bs {
            return Err(Error::invalid(format!(
                "--size {} is smaller than one --bs {} block",
                w.size, w.bs
            )));
        }
    }
    let total_depth: u32 = streams.iter().map(|s| s.iodepth).sum();
    if total_depth == 0 || total_depth > 4096 {
        return Err(Error::invalid(format!(
            "--iodepth {total_depth} must be between 1 and 4096"
        )));
    }
    if buffer_bytes > MAX_BUFFER_BYTES {
        return Err(Error::invalid(format!(
            "--buffers {buffer_bytes} bytes is more than the {} GiB a raw run may use; give less",
            MAX_BUFFER_BYTES >> 30
        )));
    }
    // Each stream owns buffer slots in proportion to its depth; a freed
    // slot goes to the back of its stream's queue, so with more slots than
    // the depth the I/Os walk all of that memory (a KV store's source or
    // target is gigabytes, fio's iodepth x bs buffer is reused).
    let slots_total = ((buffer_bytes / w.bs).min(u32::MAX as u64) as u32).max(total_depth);
    crate::cli::check_host_memory(
        slots_total as u64 * w.bs,
        "the raw run's buffers",
        "give smaller --buffers",
    )?;
    Ok(slots_total)
}

fn run_streams_with(
    target: Option<&std::fs::File>,
    w: &Workload,
    streams: &[Stream],
    buffer_bytes: u64,
    engine_cfg: &UringConfig,
) -> Result<(IoResult, EngineReport)> {
    let slots_total = check_workload(w, streams, buffer_bytes)?;
    let total_depth: u32 = streams.iter().map(|s| s.iodepth).sum();
    let file = match target {
        Some(f) => f.try_clone().map_err(|e| {
            Error::io(
                format!("duplicating the descriptor of {}", w.file.display()),
                e,
            )
        })?,
        None => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&w.file)
            .map_err(|e| Error::io(format!("opening {} with O_DIRECT", w.file.display()), e))?,
    };
    let buffers = kvtier::memory::DmaBuffer::new((w.bs * slots_total as u64) as usize)?;
    let table = Arc::new(P2pTable::for_buffers(
        buffers.addr(),
        w.bs as u32,
        slots_total,
    )?);
    let mut engine = UringEngine::new(
        &[UringDevice {
            fd: file.as_fd().try_clone_to_owned().map_err(|e| {
                Error::io(
                    format!("duplicating the descriptor of {}", w.file.display()),
                    e,
                )
            })?,
            name: w.file.display().to_string(),
        }],
        engine_cfg.clone().with_queue_depth(total_depth),
    )?;
    engine.register_memory(table)?;
    let mut io = Submitter::new(total_depth.next_power_of_two(), Box::new(engine))?;

    let mut rng = Rng(0x5EED ^ w.size);
    let mut seq_next: Vec<u64> = streams.iter().map(|s| s.region.0).collect();
    let mut in_flight: HashMap<IocbId, (u32, Slot)> = HashMap::new();
    // Per stream: its free buffer slots (oldest first) and I/Os in flight.
    let mut free_slots: Vec<std::collections::VecDeque<u32>> = Vec::new();
    let mut stream_out: Vec<u32> = vec![0; streams.len()];
    let mut next_slot = 0u32;
    for (si, s) in streams.iter().enumerate() {
        let n = if si + 1 == streams.len() {
            slots_total - next_slot
        } else {
            (slots_total as u64 * s.iodepth as u64 / total_depth as u64) as u32
        }
        .max(s.iodepth);
        free_slots.push((next_slot..next_slot + n).collect());
        next_slot += n;
    }
    let mut res = IoResult::default();
    let mut lat_r: Vec<u32> = Vec::new();
    let mut lat_w: Vec<u32> = Vec::new();
    let deadline = (w.runtime_secs > 0.0).then(|| Duration::from_secs_f64(w.runtime_secs));
    let byte_budget = w.size;
    let (u0, s0) = cpu_times();
    let t0 = Instant::now();
    let mut issued_bytes = 0u64;
    loop {
        let time_up = deadline.is_some_and(|d| t0.elapsed() >= d);
        let budget_up = deadline.is_none() && issued_bytes >= byte_budget;
        if !(time_up || budget_up) {
            // Refill every stream to its depth, then one kick submits them all.
            'refill: for si in 0..streams.len() {
                while stream_out[si] < streams[si].iodepth {
                    // One pass moves exactly `size` bytes (fio's `size`), not
                    // up to a refill more.
                    if deadline.is_none() && issued_bytes >= byte_budget {
                        break 'refill;
                    }
                    let Some(buf) = free_slots[si].pop_front() else {
                        break;
                    };
                    stream_out[si] += 1;
                    let s = &streams[si];
                    let blocks = (s.region.1 - s.region.0) / w.bs;
                    let op = match s.pattern {
                        Pattern::Read | Pattern::RandRead => IOCTX_OP_READ,
                        Pattern::Write | Pattern::RandWrite => IOCTX_OP_WRITE,
                        Pattern::RandRw => {
                            if rng.next() % 100 < w.rwmix_read as u64 {
                                IOCTX_OP_READ
                            } else {
                                IOCTX_OP_WRITE
                            }
                        }
                    };
                    let offset = if s.pattern.is_random() {
                        s.region.0 + (rng.next() % blocks) * w.bs
                    } else {
                        let o = seq_next[si];
                        seq_next[si] = if o + 2 * w.bs > s.region.1 {
                            s.region.0
                        } else {
                            o + w.bs
                        };
                        o
                    };
                    let id = io
                        .get_iocb()
                        .ok_or_else(|| Error::Ring("no free IOCB".into()))?;
                    let ctx = IoCtx {
                        dev_offset: offset,
                        len: w.bs as u32,
                        op,
                        ..IoCtx::default()
                    };
                    io.ring_mut().push_ctx(id, ctx, &[buf]);
                    io.submit(id)?;
                    in_flight.insert(
                        id,
                        (
                            buf,
                            Slot {
                                stream: si,
                                op,
                                started: Instant::now(),
                            },
                        ),
                    );
                    issued_bytes += w.bs;
                }
            }
            // No kick: wait_cqe submits the refill in its own io_uring_enter.
        } else if in_flight.is_empty() {
            break;
        }
        let first = io.wait_cqe()?;
        let mut done = vec![first];
        while let Some(id) = io.ring_mut().pop_cq() {
            done.push(id);
        }
        for id in done {
            let (buf, slot) = in_flight.remove(&id).expect("our IOCB");
            let c = io.ring().iocb(id).ctx[0];
            io.release(id);
            if c.status != IOCTX_STATUS_OK {
                return Err(Error::Device {
                    device: w.file.display().to_string(),
                    offset: c.dev_offset,
                    len: c.len as u64,
                    reason: format!("status {:#x} result {}", c.status, c.result),
                });
            }
            let us = slot.started.elapsed().as_micros().min(u32::MAX as u128) as u32;
            if slot.op == IOCTX_OP_READ {
                res.read_bytes += c.len as u64;
                res.read_ios += 1;
                lat_r.push(us);
            } else {
                res.write_bytes += c.len as u64;
                res.write_ios += 1;
                lat_w.push(us);
            }
            free_slots[slot.stream].push_back(buf);
            stream_out[slot.stream] -= 1;
        }
    }
    if w.end_fsync && res.write_bytes > 0 {
        // One flush after the last write completed: the bytes are durable
        // when it completes (fio's --end_fsync=1), and the run's time
        // includes it.
        let f0 = Instant::now();
        let c = flush_and_wait(&mut io)?;
        if c.status != IOCTX_STATUS_OK {
            return Err(Error::Device {
                device: w.file.display().to_string(),
                offset: 0,
                len: 0,
                reason: format!(
                    "the end flush failed: status {:#x} result {}",
                    c.status, c.result
                ),
            });
        }
        res.end_flush_secs = f0.elapsed().as_secs_f64();
    }
    res.secs = t0.elapsed().as_secs_f64();
    let (u1, s1) = cpu_times();
    res.cpu_usr_secs = u1 - u0;
    res.cpu_sys_secs = s1 - s0;
    res.read_bw = res.read_bytes as f64 / res.secs;
    res.write_bw = res.write_bytes as f64 / res.secs;
    (res.lat_mean_us_read, res.lat_p99_us_read) = mean_p99(&mut lat_r);
    (res.lat_mean_us_write, res.lat_p99_us_write) = mean_p99(&mut lat_w);
    let report = EngineReport {
        describe: io.engine().describe(),
        stats: io.engine().stats(),
        huge_page_share: super::huge_page_share(&[(buffers.addr(), w.bs * slots_total as u64)]),
    };
    Ok((res, report))
}

fn mean_p99(v: &mut [u32]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    v.sort_unstable();
    let p99 = v[((v.len() as f64 * 0.99) as usize).min(v.len() - 1)] as f64;
    (mean, p99)
}

/// One flush of the device's write cache through `io`, waited for: the
/// completed IOCTX (its status says whether the flush succeeded). The
/// durable references of the bench (fio's `--end_fsync=1`, the engine alone
/// + one flush) end with it.
pub(super) fn flush_and_wait(io: &mut Submitter) -> Result<IoCtx> {
    let id = io
        .get_iocb()
        .ok_or_else(|| Error::Ring("no free IOCB".into()))?;
    let ctx = IoCtx {
        op: IOCTX_OP_FLUSH,
        ..IoCtx::default()
    };
    io.ring_mut().push_ctx(id, ctx, &[]);
    io.submit(id)?;
    let done = io.wait_cqe()?;
    let c = io.ring().iocb(done).ctx[0];
    io.release(done);
    Ok(c)
}
