//! The store protocol as a plan: a pure function from what a store writes
//! (new blocks in their slots, reused slots whose old headers must go) to the
//! ordered steps of device I/O that make it crash-consistent:
//!
//! 1. zero the headers of reused slots that still describe an evicted block,
//!    then flush (so no old header can be read over new data);
//! 2. write the data, then flush;
//! 3. write the headers, then flush (only then is a block durable).
//!
//! Each step's I/Os may run in any order and in parallel; a step starts only
//! after every step before it completed (the job runs its items
//! sequentially). Nothing here touches a device or memory: the tier turns the
//! plan into IOCBs, and the unit tests below check the plan itself. A flush
//! step names the devices to flush; the tier serves it with a flush shared by
//! the stores in flight (group commit: `jobs::FlushGroup`), issued after the
//! step before it completed, as the step's own flush would have been.

use super::headers::NewBlock;
use super::jobs::{FlushAfter, Step};
use crate::plan::{self, PlannedIo};
use crate::pool::layout::{PoolLayout, SLOT_HEADER_BYTES};
use crate::ring::abi::{IOCTX_OP_FLUSH, IOCTX_OP_WRITE};

pub(super) struct StoreInputs<'a> {
    pub layout: &'a PoolLayout,
    pub max_io_bytes: u64,
    /// Key positions in the job (new blocks and the rest).
    pub keys: usize,
    /// New blocks, each at its own position.
    pub blocks: &'a [NewBlock],
    /// Reused slots whose headers still describe an evicted block.
    pub invalidate: &'a [u64],
    /// P2P index of an all-zero header sector (the source of invalidations).
    pub zero_seg: u32,
}

#[derive(Debug)]
pub(super) struct StorePlan {
    /// Runs of key positions whose slots are consecutive in one extent group;
    /// a planned I/O's `run` names the run it serves. The last run is every
    /// new block: flushes and invalidations serve the whole job.
    pub runs: Vec<Vec<u32>>,
    /// The protocol's steps in order, each a set of I/Os. Steps with no I/O
    /// are left out (a store of keys the pool holds plans nothing).
    pub steps: Vec<(Step, Vec<PlannedIo>)>,
}

/// Plan a store. `data_seg(mem_block, layer, kv)` is the P2P index of an
/// object of the job's memory.
pub(super) fn plan_store(inp: &StoreInputs, data_seg: impl Fn(u32, u32, u32) -> u32) -> StorePlan {
    let layout = inp.layout;
    let layers = layout.geometry.layers;
    let mut slot_by_pos = vec![u64::MAX; inp.keys];
    let mut block_at = vec![None; inp.keys];
    for (j, b) in inp.blocks.iter().enumerate() {
        slot_by_pos[b.pos as usize] = b.slot;
        block_at[b.pos as usize] = Some(j);
    }
    let positions: Vec<u32> = inp.blocks.iter().map(|b| b.pos).collect();
    let mut runs = plan::group_runs(layout.group_blocks as u64, &slot_by_pos, &positions);
    let all_run = runs.len() as u32;
    runs.push(positions);
    let block = |p: u32| &inp.blocks[block_at[p as usize].expect("a new block")];
    let mut steps = Vec::new();

    // (1) Invalidate stale headers in reused slots. Adjacent header sectors
    // go out as one vectored write (each segment the same zero sector).
    let mut zeros: Vec<(u16, u64, u32, u32)> = inp
        .invalidate
        .iter()
        .map(|&s| {
            let (dev, off) = layout.header_offset(s);
            (dev, off, inp.zero_seg, all_run)
        })
        .collect();
    zeros.sort_unstable_by_key(|&(dev, off, _, _)| (dev, off));
    let ios = plan::coalesce(IOCTX_OP_WRITE, SLOT_HEADER_BYTES, inp.max_io_bytes, &zeros);
    then_flush(
        &mut steps,
        Step::Invalidate,
        ios,
        all_run,
        FlushAfter::Invalidate,
    );

    // (2) Data, in device order per run: (layer, K|V, slot).
    let mut objects = Vec::new();
    for (r, run) in runs[..all_run as usize].iter().enumerate() {
        for layer in 0..layers {
            for kv in 0..2 {
                for &p in run {
                    let b = block(p);
                    let (dev, off) = layout.object_offset(b.slot, layer, kv);
                    objects.push((dev, off, data_seg(b.mem_block, layer, kv), r as u32));
                }
            }
        }
    }
    let ios = plan::coalesce(
        IOCTX_OP_WRITE,
        layout.geometry.object_bytes(),
        inp.max_io_bytes,
        &objects,
    );
    then_flush(&mut steps, Step::Data, ios, all_run, FlushAfter::Data);

    // (3) Headers, one sector per block. The header sectors of a run's
    // consecutive slots are adjacent on the device: one vectored write per
    // run, not one write per block (a 64K-token llama3-8b store has 4096).
    let mut headers: Vec<(u16, u64, u32, u32)> = Vec::with_capacity(inp.blocks.len());
    for (r, run) in runs[..all_run as usize].iter().enumerate() {
        for &p in run {
            let b = block(p);
            let (dev, off) = layout.header_offset(b.slot);
            headers.push((dev, off, b.header_seg, r as u32));
        }
    }
    headers.sort_unstable_by_key(|&(dev, off, _, _)| (dev, off));
    let ios = plan::coalesce(
        IOCTX_OP_WRITE,
        SLOT_HEADER_BYTES,
        inp.max_io_bytes,
        &headers,
    );
    then_flush(&mut steps, Step::Headers, ios, all_run, FlushAfter::Headers);
    StorePlan { runs, steps }
}

/// `step`'s I/Os followed by one flush per device they touched (nothing
/// when the step has no I/O).
fn then_flush(
    steps: &mut Vec<(Step, Vec<PlannedIo>)>,
    step: Step,
    ios: Vec<PlannedIo>,
    all_run: u32,
    what: FlushAfter,
) {
    if ios.is_empty() {
        return;
    }
    let mut devs: Vec<u16> = ios.iter().map(|io| io.dev).collect();
    devs.sort_unstable();
    devs.dedup();
    let flushes = devs
        .into_iter()
        .map(|dev| PlannedIo {
            op: IOCTX_OP_FLUSH,
            dev,
            offset: 0,
            len: 0,
            segs: Vec::new(),
            run: all_run,
        })
        .collect();
    steps.push((step, ios));
    steps.push((Step::Flush(what), flushes));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, KvGeometry};

    /// 2 layers, 4 KiB objects (1 KV head x 128 dims x 16 tokens x 2 B),
    /// groups of 4 slots dealt over `devices` devices.
    fn layout(devices: usize) -> PoolLayout {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 1,
            head_dim: 128,
            dtype: DType::F16,
            block_size: 16,
        };
        assert_eq!(g.object_bytes(), 4096);
        PoolLayout::new(g, 4, vec![4; devices])
    }

    /// Data segments: mem_block * 100 + layer * 10 + kv.
    fn seg(b: u32, l: u32, kv: u32) -> u32 {
        b * 100 + l * 10 + kv
    }

    fn blocks(slots: &[u64]) -> Vec<NewBlock> {
        slots
            .iter()
            .enumerate()
            .map(|(i, &slot)| NewBlock {
                pos: i as u32,
                slot,
                mem_block: i as u32,
                header_seg: 1000 + i as u32,
            })
            .collect()
    }

    fn plan(l: &PoolLayout, keys: usize, b: &[NewBlock], inv: &[u64], max: u64) -> StorePlan {
        plan_store(
            &StoreInputs {
                layout: l,
                max_io_bytes: max,
                keys,
                blocks: b,
                invalidate: inv,
                zero_seg: 7,
            },
            seg,
        )
    }

    fn order(p: &StorePlan) -> Vec<Step> {
        p.steps.iter().map(|(s, _)| *s).collect()
    }

    #[test]
    fn steps_run_invalidate_flush_data_flush_headers_flush() {
        let l = layout(1);
        let b = blocks(&[0, 1]);
        let p = plan(&l, 2, &b, &[2], 1 << 20);
        assert_eq!(
            order(&p),
            vec![
                Step::Invalidate,
                Step::Flush(FlushAfter::Invalidate),
                Step::Data,
                Step::Flush(FlushAfter::Data),
                Step::Headers,
                Step::Flush(FlushAfter::Headers),
            ]
        );
        for (step, ios) in &p.steps {
            let want = match step {
                Step::Flush(_) => IOCTX_OP_FLUSH,
                _ => IOCTX_OP_WRITE,
            };
            assert!(
                !ios.is_empty() && ios.iter().all(|io| io.op == want),
                "{step:?}"
            );
        }
        // The invalidation zeroes slot 2's header from the zero sector.
        let inv = &p.steps[0].1;
        assert_eq!(inv.len(), 1);
        assert_eq!(
            (inv[0].offset, inv[0].segs.clone()),
            (l.header_offset(2).1, vec![7])
        );
    }

    #[test]
    fn no_reused_slots_means_no_invalidation_step() {
        let l = layout(1);
        let p = plan(&l, 1, &blocks(&[3]), &[], 1 << 20);
        assert_eq!(
            order(&p),
            vec![
                Step::Data,
                Step::Flush(FlushAfter::Data),
                Step::Headers,
                Step::Flush(FlushAfter::Headers),
            ]
        );
    }

    #[test]
    fn nothing_new_plans_nothing() {
        let l = layout(1);
        let p = plan(&l, 3, &[], &[], 1 << 20);
        assert!(p.steps.is_empty());
        assert_eq!(p.runs, vec![Vec::<u32>::new()]);
    }

    #[test]
    fn headers_of_consecutive_slots_are_one_vectored_write_per_run() {
        let l = layout(1);
        // Slots 0..3 are one run in group 0; 5 and 6 a second run in group
        // 1, given out of order; positions 1 and 4 are keys with no new block.
        let b = vec![
            NewBlock {
                pos: 0,
                slot: 2,
                mem_block: 9,
                header_seg: 1002,
            },
            NewBlock {
                pos: 2,
                slot: 0,
                mem_block: 8,
                header_seg: 1000,
            },
            NewBlock {
                pos: 3,
                slot: 6,
                mem_block: 7,
                header_seg: 1006,
            },
            NewBlock {
                pos: 5,
                slot: 1,
                mem_block: 6,
                header_seg: 1001,
            },
            NewBlock {
                pos: 6,
                slot: 5,
                mem_block: 5,
                header_seg: 1005,
            },
        ];
        let p = plan(&l, 7, &b, &[], 1 << 20);
        assert_eq!(p.runs, vec![vec![2, 5, 0], vec![6, 3], vec![0, 2, 3, 5, 6]]);
        let (step, headers) = &p.steps[2];
        assert_eq!(*step, Step::Headers);
        assert_eq!(headers.len(), 2, "{headers:?}");
        assert_eq!(headers[0].segs, vec![1000, 1001, 1002]);
        assert_eq!(headers[0].offset, l.header_offset(0).1);
        assert_eq!(headers[0].len as u64, 3 * SLOT_HEADER_BYTES);
        assert_eq!(headers[0].run, 0);
        assert_eq!(headers[1].segs, vec![1005, 1006]);
        assert_eq!(headers[1].run, 1);
        // Data of run 0: per layer, K of slots 0..3 then V, contiguous in the
        // group: one I/O per layer-and-group is at most the group's extent.
        let data = &p.steps[0].1;
        assert_eq!(p.steps[0].0, Step::Data);
        let run0: Vec<u32> = data
            .iter()
            .filter(|io| io.run == 0)
            .flat_map(|io| io.segs.clone())
            .collect();
        assert_eq!(
            run0,
            vec![800, 600, 900, 801, 601, 901, 810, 610, 910, 811, 611, 911]
        );
        // The data of every new block is written exactly once.
        let mut all: Vec<u32> = data.iter().flat_map(|io| io.segs.clone()).collect();
        all.sort_unstable();
        let mut want: Vec<u32> = b
            .iter()
            .flat_map(|b| (0..2).flat_map(move |l| (0..2).map(move |kv| seg(b.mem_block, l, kv))))
            .collect();
        want.sort_unstable();
        assert_eq!(all, want);
    }

    #[test]
    fn adjacent_invalidations_coalesce_and_respect_the_io_cap() {
        let l = layout(1);
        // Slots 0..4 are adjacent header sectors of group 0; 9 is in group 2.
        let p = plan(
            &l,
            1,
            &blocks(&[12]),
            &[3, 0, 2, 1, 9],
            2 * SLOT_HEADER_BYTES,
        );
        let inv = &p.steps[0].1;
        assert_eq!(p.steps[0].0, Step::Invalidate);
        let got: Vec<(u64, u32, usize)> = inv
            .iter()
            .map(|io| (io.offset, io.len, io.segs.len()))
            .collect();
        let h = |s| l.header_offset(s).1;
        assert_eq!(
            got,
            vec![(h(0), 8192, 2), (h(2), 8192, 2), (h(9), 4096, 1)],
            "capped at two sectors per write"
        );
        assert!(inv.iter().all(|io| io.segs.iter().all(|&s| s == 7)));
    }

    #[test]
    fn each_barrier_flushes_every_device_its_step_wrote_and_only_those() {
        let l = layout(3);
        // Groups deal round-robin: group 0 on device 0, group 1 on device 1.
        let b = blocks(&[0, 4]);
        let p = plan(&l, 2, &b, &[1], 1 << 20);
        let devs = |i: usize| -> Vec<u16> { p.steps[i].1.iter().map(|io| io.dev).collect() };
        assert_eq!(order(&p)[1], Step::Flush(FlushAfter::Invalidate));
        assert_eq!(devs(1), vec![0], "the invalidation touched device 0 only");
        assert_eq!(devs(3), vec![0, 1]);
        assert_eq!(devs(5), vec![0, 1]);
        let all_run = (p.runs.len() - 1) as u32;
        for i in [1, 3, 5] {
            assert!(p.steps[i]
                .1
                .iter()
                .all(|io| io.run == all_run && io.segs.is_empty()));
        }
    }
}
