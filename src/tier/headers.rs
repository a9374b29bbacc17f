//! A store's header sectors from its allocation until they are staged just
//! before the header writes: the new blocks, each header's state, and the
//! worker hashing the blocks whose checksums were not given. The job table
//! holds them and the store path builds and stages them, each importing
//! this one way.

/// One block a store writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NewBlock {
    /// Its key's position in the job.
    pub pos: u32,
    pub slot: u64,
    pub mem_block: u32,
    /// P2P index of the staged 4 KiB header sector written for it.
    pub header_seg: u32,
}

/// A thread taking checksums and building the header sectors of the blocks
/// it hashed: (block, its header's state) when joined.
pub(super) type HashWorker = std::thread::JoinHandle<Vec<(usize, HeaderState)>>;

/// Where one new block's header sector stands.
pub(super) enum HeaderState {
    /// Still to be built, from these per-layer checksums (None: memory the
    /// host cannot read, stored without them).
    Todo(Option<Vec<u32>>),
    /// Built in its staging entry by the checksum worker; the pool still
    /// has to record what loads verify against.
    Built { layer_crcs: Vec<u32>, data_crc: u32 },
}

/// A store's headers until they are staged.
pub(super) struct PendingHeaders {
    /// The new blocks, in the order their staging entries were taken.
    pub(super) blocks: Vec<NewBlock>,
    /// Per new block: its header's state (the worker's blocks are `Todo(None)`
    /// until it is joined).
    pub(super) states: Vec<HeaderState>,
    /// The worker hashing the blocks without given checksums.
    pub(super) worker: Option<HashWorker>,
}

impl PendingHeaders {
    /// Every block with its header's state (waiting for the worker if it
    /// still runs).
    pub(super) fn join(mut self) -> Vec<(NewBlock, HeaderState)> {
        if let Some(w) = self.worker.take() {
            // A worker that panicked left its blocks `Todo(None)`: they are
            // then stored without checksums (verified by nothing, which
            // `pool check` reports), never with wrong ones.
            if let Ok(got) = w.join() {
                for (j, state) in got {
                    self.states[j] = state;
                }
            }
        }
        self.blocks.into_iter().zip(self.states).collect()
    }
}
