//! The store's durable reference, measured right after the store in the
//! same round: kvtier's engine alone writing the bytes the store just wrote,
//! from the same memory (the tier's registered KV cache), to the same
//! offsets, in I/Os of the same size and shape (the objects coalesced as
//! the store plans its data: up to `max_io_bytes`, one I/O per IOCB, queue
//! depth as the tier's), then one flush. No checksums, headers or extra
//! flushes: what the store adds on top of the disk. The bytes are the ones
//! already stored, so the pool stays as it was.

use super::GIB;
use kvtier::engine::uring::{UringConfig, UringDevice, UringEngine};
use kvtier::engine::IoEngine;
use kvtier::error::{Error, Result};
use kvtier::pool::Key;
use kvtier::ring::abi::*;
use kvtier::submitter::Submitter;
use kvtier::Tier;
use std::os::fd::AsFd;
use std::time::Instant;

/// One planned write: device offset, bytes, P2P segments.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Write {
    pub offset: u64,
    pub len: u32,
    pub segs: Vec<u32>,
}

/// Objects `(offset, segment, job)` of `object_bytes` each, sorted by
/// offset and merged where adjacent and of one store job into writes of at
/// most `max_io_bytes` and `max_segs` segments (as the store's plan
/// coalesces its data: each job on its own).
pub(crate) fn coalesce(
    mut objects: Vec<(u64, u32, usize)>,
    object_bytes: u64,
    max_io_bytes: u64,
    max_segs: usize,
) -> Vec<Write> {
    objects.sort_unstable();
    let mut out: Vec<Write> = Vec::new();
    let mut last_job = usize::MAX;
    for (off, seg, job) in objects {
        if let Some(w) = out.last_mut() {
            if job == last_job
                && w.offset + w.len as u64 == off
                && w.len as u64 + object_bytes <= max_io_bytes
                && w.segs.len() < max_segs
            {
                w.len += object_bytes as u32;
                w.segs.push(seg);
                continue;
            }
        }
        out.push(Write {
            offset: off,
            len: object_bytes as u32,
            segs: vec![seg],
        });
        last_job = job;
    }
    out
}

/// How the store being held to the rewrite wrote: jobs of `job_blocks`
/// keys (a staged store's chunks, a host store's jobs), each coalesced on
/// its own into I/Os of at most `max_io_bytes`, at the engine's depth.
pub(crate) struct StoreShape<'a> {
    pub job_blocks: usize,
    pub max_io_bytes: u64,
    pub uring: &'a UringConfig,
}

/// GiB/s of the rewrite without its flush and with it.
pub(crate) struct Rewrite {
    pub unflushed_gib_s: f64,
    pub durable_gib_s: f64,
}

/// Rewrite the stored `keys` (from `mem`) through a fresh engine on `file`
/// (the single pool file, by its descriptor), then flush it.
pub(crate) fn rewrite_stored(
    tier: &Tier,
    file: &std::fs::File,
    name: &str,
    keys: &[Key],
    mem: &[u32],
    shape: &StoreShape,
) -> Result<Rewrite> {
    let slots = {
        let ix = tier.pool().index();
        keys.iter()
            .map(|k| {
                ix.get(k)
                    .map(|e| e.slot)
                    .ok_or_else(|| Error::invalid(format!("key {k} was not stored")))
            })
            .collect::<Result<Vec<u64>>>()?
    };
    rewrite_slots(tier, file, name, &slots, mem, shape)
}

/// The writes of the data of `slots` (`slots[i]` from memory block
/// `mem[i]` of `table`), stored as jobs of `job_blocks` keys in order: each
/// object at its offset, merged where adjacent and of one job into writes
/// of at most `max_io_bytes` and the store plan's segment cap, as the
/// store plans its data step. One-file pools only.
pub(crate) fn plan_writes(
    tier: &Tier,
    table: &kvtier::p2p::P2pTable,
    slots: &[u64],
    mem: &[u32],
    job_blocks: usize,
    max_io_bytes: u64,
) -> Result<Vec<Write>> {
    let pool = tier.pool();
    let layout = pool.layout();
    let geo = *pool.geometry();
    let mut objects = Vec::with_capacity(slots.len() * geo.objects_per_block() as usize);
    for (i, (&slot, &m)) in slots.iter().zip(mem).enumerate() {
        for layer in 0..geo.layers {
            for kv in 0..2 {
                let (dev, off) = layout.object_offset(slot, layer, kv);
                if dev != 0 {
                    return Err(Error::invalid(
                        "the rewrite reference needs a one-file pool",
                    ));
                }
                objects.push((off, table.index(m, layer, kv), i / job_blocks.max(1)));
            }
        }
    }
    Ok(coalesce(
        objects,
        geo.object_bytes(),
        max_io_bytes,
        IOCB_MAX_SEGS.min(1024),
    ))
}

/// [`rewrite_stored`] to the data of `slots` (`slots[i]` from `mem[i]`).
pub(crate) fn rewrite_slots(
    tier: &Tier,
    file: &std::fs::File,
    name: &str,
    slots: &[u64],
    mem: &[u32],
    shape: &StoreShape,
) -> Result<Rewrite> {
    let table = tier
        .p2p_table()
        .ok_or_else(|| Error::invalid("the tier has no registered memory to rewrite from"))?
        .clone();
    let writes = plan_writes(
        tier,
        &table,
        slots,
        mem,
        shape.job_blocks,
        shape.max_io_bytes,
    )?;
    let uring = shape.uring;
    let fd = file
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io(format!("duplicating the descriptor of {name}"), e))?;
    let depth = uring.queue_depth;
    let mut engine = UringEngine::new(
        &[UringDevice {
            fd,
            name: name.to_string(),
        }],
        uring.clone(),
    )?;
    engine.register_memory(table)?;
    let mut io = Submitter::new(depth.next_power_of_two(), Box::new(engine))?;
    let check = |c: &IoCtx| -> Result<()> {
        if c.status != IOCTX_STATUS_OK {
            return Err(Error::Device {
                device: name.to_string(),
                offset: c.dev_offset,
                len: c.len as u64,
                reason: format!("status {:#x} result {}", c.status, c.result),
            });
        }
        Ok(())
    };
    let bytes: u64 = writes.iter().map(|w| w.len as u64).sum();
    let t0 = Instant::now();
    let mut next = 0;
    let mut out = 0u32;
    while next < writes.len() || out > 0 {
        while next < writes.len() && out < depth {
            let w = &writes[next];
            let id = io
                .get_iocb()
                .ok_or_else(|| Error::Ring("no free IOCB".into()))?;
            let ctx = IoCtx {
                dev_offset: w.offset,
                len: w.len,
                op: IOCTX_OP_WRITE,
                ..IoCtx::default()
            };
            io.ring_mut()
                .push_ctx(id, ctx, &w.segs)
                .ok_or_else(|| Error::Ring("a write's segments do not fit an IOCB".into()))?;
            io.submit(id)?;
            next += 1;
            out += 1;
        }
        let first = io.wait_cqe()?;
        let mut done = vec![first];
        while let Some(id) = io.ring_mut().pop_cq() {
            done.push(id);
        }
        for id in done {
            let c = io.ring().iocb(id).ctx[0];
            io.release(id);
            check(&c)?;
            out -= 1;
        }
    }
    let unflushed = t0.elapsed().as_secs_f64();
    let c = super::raw::flush_and_wait(&mut io)?;
    check(&c)?;
    let durable = t0.elapsed().as_secs_f64();
    let gib = bytes as f64 / GIB;
    Ok(Rewrite {
        unflushed_gib_s: gib / unflushed.max(1e-9),
        durable_gib_s: gib / durable.max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adjacent objects merge up to the byte and segment caps, in offset
    /// order whatever order they came in; a gap starts a new write.
    #[test]
    fn objects_merge_like_the_store_plans_them() {
        let objs = vec![
            (8192, 3, 0),
            (0, 1, 0),
            (4096, 2, 0),
            (12288, 4, 0),
            (20480, 5, 0),
        ];
        let w = coalesce(objs, 4096, 8192, 1024);
        let got: Vec<(u64, u32, Vec<u32>)> =
            w.into_iter().map(|w| (w.offset, w.len, w.segs)).collect();
        assert_eq!(
            got,
            vec![
                (0, 8192, vec![1, 2]),
                (8192, 8192, vec![3, 4]),
                (20480, 4096, vec![5])
            ]
        );
        let w = coalesce(
            vec![(0, 1, 0), (4096, 2, 0), (8192, 3, 0)],
            4096,
            1 << 20,
            2,
        );
        assert_eq!(w.len(), 2, "at most 2 segments per write");
        let w = coalesce(
            vec![(0, 1, 0), (4096, 2, 1), (8192, 3, 1)],
            4096,
            1 << 20,
            8,
        );
        assert_eq!(w.len(), 2, "objects of two store jobs never merge");
    }
}
