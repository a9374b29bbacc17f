//! Planning device I/O: cut a job's blocks into runs of consecutive slots,
//! and merge objects that are contiguous on the device into one I/O.
//!
//! This is the host's per-job work, done once at submit time; its output is
//! IOCTXs whose segments are P2P-table indices. It is O(objects) in time but
//! yields O(groups) I/Os per layer for blocks stored together.

/// One planned device I/O, before it is placed in an IOCB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedIo {
    /// `IOCTX_OP_READ` or `IOCTX_OP_WRITE`.
    pub op: u8,
    /// The pool device.
    pub dev: u16,
    /// Byte offset on the device.
    pub offset: u64,
    /// Bytes.
    pub len: u32,
    /// P2P-table indices, in device order.
    pub segs: Vec<u32>,
    /// Index of the run (set of job keys) this I/O serves.
    pub run: u32,
}

/// Most segments one I/O may carry: the kernel's IOV_MAX for readv/writev.
pub(crate) const MAX_SEGS_PER_IO: usize = 1024;

/// Cut key positions into runs of consecutive slots within one extent group
/// of `group_blocks`, in slot order. `slots[p]` is position p's slot.
pub fn group_runs(group_blocks: u64, slots: &[u64], positions: &[u32]) -> Vec<Vec<u32>> {
    let mut order: Vec<(u64, u32)> = positions.iter().map(|&p| (slots[p as usize], p)).collect();
    order.sort_unstable();
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut prev: Option<u64> = None;
    for (slot, p) in order {
        match (prev, runs.last_mut()) {
            (Some(ps), Some(run)) if slot == ps + 1 && slot / group_blocks == ps / group_blocks => {
                run.push(p)
            }
            _ => runs.push(vec![p]),
        }
        prev = Some(slot);
    }
    runs
}

/// Merge `(device, offset, P2P index, run)` objects of `object_bytes` each,
/// given in device order, into I/Os over contiguous extents of one run,
/// capped at `max_io_bytes` and `MAX_SEGS_PER_IO` segments.
pub fn coalesce(
    op: u8,
    object_bytes: u64,
    max_io_bytes: u64,
    objects: &[(u16, u64, u32, u32)],
) -> Vec<PlannedIo> {
    let max = max_io_bytes.min(u32::MAX as u64 & !4095);
    let mut ios: Vec<PlannedIo> = Vec::new();
    for &(dev, off, seg, run) in objects {
        if let Some(io) = ios.last_mut() {
            if io.dev == dev
                && io.run == run
                && io.offset + io.len as u64 == off
                && io.len as u64 + object_bytes <= max
                && io.segs.len() < MAX_SEGS_PER_IO
            {
                io.len += object_bytes as u32;
                io.segs.push(seg);
                continue;
            }
        }
        ios.push(PlannedIo {
            op,
            dev,
            offset: off,
            len: object_bytes as u32,
            segs: vec![seg],
            run,
        });
    }
    ios
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_break_at_gaps_and_group_edges() {
        let slots = [5, 6, 7, 8, 20, 3, 4];
        let runs = group_runs(8, &slots, &[0, 1, 2, 3, 4, 5, 6]);
        // 3,4,5,6,7 | 8 (next group) | 20
        assert_eq!(runs, vec![vec![5, 6, 0, 1, 2], vec![3], vec![4]]);
    }

    #[test]
    fn coalesce_merges_contiguous_and_caps() {
        let objs: Vec<(u16, u64, u32, u32)> = (0..10u32)
            .map(|i| (0, i as u64 * 4096, 100 + i, 0))
            .chain([(1, 40960, 7, 0), (1, 45056, 8, 1)])
            .collect();
        let ios = coalesce(2, 4096, 16384, &objs);
        let lens: Vec<u32> = ios.iter().map(|i| i.len).collect();
        assert_eq!(
            lens,
            vec![16384, 16384, 8192, 4096, 4096],
            "cap 4 objects; new device; new run"
        );
        assert_eq!(ios[1].segs, vec![104, 105, 106, 107]);
        assert_eq!((ios[3].dev, ios[4].run), (1, 1));
    }
}
