//! The staging memory and where each staged object lives in it: the layer
//! buffers loads are read into (round-robin, one layer of one chunk each) and
//! the store area stores are gathered into.

use super::{Error, Result};
use crate::gpu::{Context, HostRegistration, RegisterFlags};
use crate::memory::DmaBuffer;
use crate::model::KvGeometry;
use crate::p2p::MemRegion;

/// How much pinned staging the staged path holds: [`StagingConfig::for_blocks`]
/// and the `with_*` setters.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StagingConfig {
    /// Layers of loads in flight at once (each its own buffer, reused
    /// round-robin). At least 2, so the reads of one layer overlap the copy
    /// of the one before.
    pub layer_buffers: u32,
    /// Blocks of one layer a layer buffer holds; a larger load goes through
    /// in chunks of this many per layer (each a buffer's turn).
    pub load_blocks: u32,
    /// Blocks the stores in flight may hold in staging (all layers each).
    pub store_blocks: u32,
    /// Blocks of one store chunk (one gather, one tier store); 0: the
    /// whole store area. A store goes out in chunks of this many, as many
    /// at once as the store area holds, so the gather of one chunk runs
    /// while the chunks before it are written (one chunk of the whole area
    /// serializes them: gather, write, gather, write).
    #[serde(default)]
    pub store_chunk_blocks: u32,
}

impl StagingConfig {
    /// `layer_buffers` layer buffers of `load_blocks` blocks each (larger
    /// loads go in chunks), stores in chunks of `store_blocks`, one at a
    /// time (see [`Self::with_store_chunk_blocks`]; checked when the staged
    /// path opens).
    pub fn new(layer_buffers: u32, load_blocks: u32, store_blocks: u32) -> StagingConfig {
        StagingConfig {
            layer_buffers,
            load_blocks,
            store_blocks,
            store_chunk_blocks: 0,
        }
    }

    /// Defaults for KV memory of `num_blocks` blocks: 4 layer buffers of
    /// 1024 blocks (larger loads go in chunks), a store area of 64 blocks
    /// holding 4 chunks of 16 (so gathers overlap writes).
    pub fn for_blocks(num_blocks: u32) -> StagingConfig {
        let store_blocks = num_blocks.clamp(1, 64);
        StagingConfig {
            layer_buffers: 4,
            load_blocks: num_blocks.clamp(1, 1024),
            store_blocks,
            store_chunk_blocks: store_blocks.div_ceil(4),
        }
    }

    /// With `layer_buffers` layer buffers.
    #[must_use]
    pub fn with_layer_buffers(mut self, layer_buffers: u32) -> Self {
        self.layer_buffers = layer_buffers;
        self
    }

    /// With loads of up to `load_blocks` blocks.
    #[must_use]
    pub fn with_load_blocks(mut self, load_blocks: u32) -> Self {
        self.load_blocks = load_blocks;
        self
    }

    /// With up to `store_blocks` blocks of stores in staging.
    #[must_use]
    pub fn with_store_blocks(mut self, store_blocks: u32) -> Self {
        self.store_blocks = store_blocks;
        self
    }

    /// With stores in chunks of `blocks` (at most `store_blocks`; 0: the
    /// whole store area, one chunk at a time).
    #[must_use]
    pub fn with_store_chunk_blocks(mut self, blocks: u32) -> Self {
        self.store_chunk_blocks = blocks;
        self
    }

    /// Blocks of one store chunk.
    pub fn store_chunk(&self) -> u32 {
        match self.store_chunk_blocks {
            0 => self.store_blocks,
            n => n.min(self.store_blocks),
        }
    }

    /// Bytes of pinned host memory this staging takes for `g` (`u64::MAX`
    /// when that overflows: such a staging is refused).
    pub fn bytes(&self, g: &KvGeometry) -> u64 {
        self.checked_bytes(g).unwrap_or(u64::MAX)
    }

    // Checked: the sizes come from callers (Python, a CLI flag) and their
    // product overflowed into a panic (debug) or a wrapped, too-small
    // staging (release) before it was refused.
    pub(super) fn checked_bytes(&self, g: &KvGeometry) -> Option<u64> {
        let obj = g.object_bytes();
        let load = (self.layer_buffers as u64)
            .checked_mul(2 * self.load_blocks as u64)?
            .checked_mul(obj)?;
        let store = (self.store_blocks as u64)
            .checked_mul(g.objects_per_block() as u64)?
            .checked_mul(obj)?;
        load.checked_add(store)
    }

    pub(super) fn validate(&self, g: &KvGeometry) -> Result<()> {
        if self.layer_buffers < 2 || self.load_blocks == 0 || self.store_blocks == 0 {
            return Err(Error::invalid(format!(
                "staging of {} layer buffers, {} load blocks, {} store blocks: need at least 2 layer buffers and 1 block each",
                self.layer_buffers, self.load_blocks, self.store_blocks
            )));
        }
        if self.store_chunk_blocks > self.store_blocks {
            return Err(Error::invalid(format!(
                "staging store chunks of {} blocks in a store area of {}: a chunk must fit the area; lower StagingConfig::store_chunk_blocks or raise store_blocks",
                self.store_chunk_blocks, self.store_blocks
            )));
        }
        // Saturating: each factor is a u32, the sum of products fits a u64
        // but not its product with a model's objects per block.
        let objects = (self.layer_buffers as u64 * self.load_blocks as u64
            + self.store_blocks as u64)
            .saturating_mul(g.objects_per_block() as u64);
        if objects > u32::MAX as u64 / 2 {
            return Err(Error::invalid(format!(
                "staging of {} layer buffers of {} load blocks and {} store blocks is {objects} objects, more than a P2P table indexes (2^31); lower StagingConfig::layer_buffers, load_blocks or store_blocks",
                self.layer_buffers, self.load_blocks, self.store_blocks
            )));
        }
        match self.checked_bytes(g) {
            Some(b) if b <= isize::MAX as u64 => Ok(()),
            _ => Err(Error::invalid(format!(
                "staging of {} layer buffers of {} load blocks and {} store blocks is more bytes than memory can map; lower StagingConfig's sizes",
                self.layer_buffers, self.load_blocks, self.store_blocks
            ))),
        }
    }
}

/// Where each staged object lives. The tier's staging blocks
/// `0..layer_buffers * load_blocks` are the layer buffers' places: place
/// `t` is place `t % load_blocks` of buffer `t / load_blocks`, whatever the
/// layer (a buffer holds one layer of one chunk of a load at a time: K
/// objects of all its places then V objects), so a load's chunk is read
/// into whichever buffer is its turn; the blocks after are the store area,
/// layer-major ((layer, K|V, place)): a chunk takes neighbouring places, so
/// a write of one layer's K (or V) objects of its consecutive slots reads
/// one span of staging. With a block's 2L objects together each object was
/// a DMA segment of its own, and writes from staging ran at 0.4x the same
/// writes from per-layer host memory (CPU double, a virtio disk).
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    pub(super) obj: u64,
    pub(super) layers: u32,
    pub(super) buffers: u32,
    pub(super) load_blocks: u32,
    pub(super) store_blocks: u32,
    pub(super) load_base: u64,
    pub(super) store_base: u64,
}

impl Layout {
    pub(super) fn new(g: &KvGeometry, cfg: &StagingConfig, base: u64) -> Layout {
        let obj = g.object_bytes();
        Layout {
            obj,
            layers: g.layers,
            buffers: cfg.layer_buffers,
            load_blocks: cfg.load_blocks,
            store_blocks: cfg.store_blocks,
            load_base: base,
            store_base: base + cfg.layer_buffers as u64 * 2 * cfg.load_blocks as u64 * obj,
        }
    }

    pub(super) fn buffer_bytes(&self) -> u64 {
        2 * self.load_blocks as u64 * self.obj
    }

    pub(super) fn load_obj(&self, buffer: u32, sblock: u32, kv: u32) -> u64 {
        self.load_base
            + buffer as u64 * self.buffer_bytes()
            + (kv as u64 * self.load_blocks as u64 + sblock as u64) * self.obj
    }

    pub(super) fn store_obj(&self, s: u32, layer: u32, kv: u32) -> u64 {
        self.store_base
            + ((layer as u64 * 2 + kv as u64) * self.store_blocks as u64 + s as u64) * self.obj
    }

    /// Tier blocks that are load places (the store places follow).
    pub(super) fn load_places(&self) -> u32 {
        self.buffers * self.load_blocks
    }

    /// The tier's block of place `sblock` of buffer `buffer`.
    pub(super) fn load_place(&self, buffer: u32, sblock: u32) -> u32 {
        buffer * self.load_blocks + sblock
    }

    /// The tier's memory block `block` (load places first, then store places).
    pub(super) fn addr(&self, block: u32, layer: u32, kv: u32) -> u64 {
        if block < self.load_places() {
            self.load_obj(block / self.load_blocks, block % self.load_blocks, kv)
        } else {
            self.store_obj(block - self.load_places(), layer, kv)
        }
    }

    pub(super) fn regions(&self) -> Vec<MemRegion> {
        vec![
            MemRegion {
                addr: self.load_base,
                len: self.buffers as u64 * self.buffer_bytes(),
            },
            MemRegion {
                addr: self.store_base,
                len: self.store_blocks as u64 * 2 * self.layers as u64 * self.obj,
            },
        ]
    }
}

/// The staging memory: page-aligned host memory (huge pages where the
/// kernel gives them) for direct I/O, registered with CUDA as PORTABLE |
/// DEVICEMAP on a GPU so copies on any context's stream run at pinned speed;
/// or memory another party shares with this process (the node service's
/// slice of a client, a sealed memfd mapped here), kept alive by `keep`.
pub(super) struct StagingMemory {
    // Unregistered before the memory goes.
    pub(super) reg: Option<HostRegistration>,
    addr: u64,
    _own: Option<DmaBuffer>,
    _keep: Option<std::sync::Arc<dyn Send + Sync>>,
}

impl StagingMemory {
    pub(super) fn host(len: u64) -> Result<StagingMemory> {
        let buf = DmaBuffer::new(len as usize)?;
        Ok(StagingMemory {
            reg: None,
            addr: buf.addr(),
            _own: Some(buf),
            _keep: None,
        })
    }

    pub(super) fn pinned(ctx: &Context, len: u64) -> Result<StagingMemory> {
        let buf = DmaBuffer::new(len as usize)?;
        // SAFETY: `buf` is our mapping and outlives the registration (field order).
        let reg = unsafe {
            HostRegistration::register(ctx, buf.as_mut_ptr(), buf.len(), RegisterFlags::DeviceMap)?
        };
        Ok(StagingMemory {
            reg: Some(reg),
            addr: buf.addr(),
            _own: Some(buf),
            _keep: None,
        })
    }

    /// `len` bytes at `addr`, mapped for as long as `keep` lives; on a GPU
    /// (`ctx`) registered as pinned (`cuMemHostRegister`) in this process.
    ///
    /// # Safety
    /// `addr..addr + len` is mapped host memory while `keep` lives.
    pub(super) unsafe fn shared(
        ctx: Option<&Context>,
        addr: u64,
        len: u64,
        keep: std::sync::Arc<dyn Send + Sync>,
    ) -> Result<StagingMemory> {
        let reg = match ctx {
            // SAFETY: the caller's contract; `keep` outlives the
            // registration (field order).
            Some(ctx) => Some(unsafe {
                HostRegistration::register(
                    ctx,
                    addr as *mut u8,
                    len as usize,
                    RegisterFlags::DeviceMap,
                )?
            }),
            None => None,
        };
        Ok(StagingMemory {
            reg,
            addr,
            _own: None,
            _keep: Some(keep),
        })
    }

    /// The host address of the staging.
    pub(super) fn addr(&self) -> u64 {
        self.addr
    }

    /// The copier's address of host address `a` of the staging.
    pub(super) fn dev(&self, a: u64) -> u64 {
        match &self.reg {
            Some(r) => r.device_ptr() + (a - self.addr),
            None => a,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Load places are a buffer's whatever the layer: place `t` is place
    /// `t % load_blocks` of buffer `t / load_blocks`, K objects of a buffer
    /// then V objects; the store area follows the buffers, layer-major (a
    /// layer's K objects of neighbouring places side by side); nothing of
    /// one overlaps the other.
    #[test]
    fn staging_layout_places_chunks_in_buffers() {
        let g = KvGeometry {
            layers: 6,
            kv_heads: 2,
            head_dim: 64,
            dtype: crate::model::DType::BF16,
            block_size: 16,
        };
        let cfg = StagingConfig {
            layer_buffers: 2,
            load_blocks: 3,
            store_blocks: 2,
            store_chunk_blocks: 0,
        };
        let obj = g.object_bytes();
        let l = Layout::new(&g, &cfg, 1 << 30);
        assert_eq!(l.load_places(), 6);
        assert_eq!(l.addr(0, 0, 0), 1 << 30);
        assert_eq!(l.addr(2, 0, 0), (1 << 30) + 2 * obj);
        assert_eq!(l.addr(0, 0, 1), (1 << 30) + 3 * obj);
        assert_eq!(l.addr(l.load_place(1, 1), 1, 0), (1 << 30) + 6 * obj + obj);
        for t in 0..6 {
            for kv in 0..2 {
                assert_eq!(l.addr(t, 4, kv), l.addr(t, 0, kv), "any layer");
                assert_eq!(
                    l.addr(t, 1, kv),
                    l.load_obj(t / 3, t % 3, kv),
                    "place {t} is buffer {}'s",
                    t / 3
                );
            }
        }
        // The store area is layer-major: (layer, K|V, place), so one
        // layer's K objects of neighbouring places are neighbours.
        let store0 = (1 << 30) + 2 * 6 * obj;
        assert_eq!(l.addr(6, 0, 0), store0);
        assert_eq!(l.addr(7, 0, 0), store0 + obj);
        assert_eq!(l.addr(6, 0, 1), store0 + 2 * obj);
        assert_eq!(l.addr(6, 1, 0), store0 + 4 * obj);
        assert_eq!(l.addr(6, 5, 1), store0 + 22 * obj);
        let r = l.regions();
        assert_eq!(r[0].addr + r[0].len, r[1].addr);
        assert_eq!(r[0].len + r[1].len, cfg.bytes(&g));
        assert_eq!(l.addr(7, 5, 1) + obj, r[1].addr + r[1].len);
        let mut seen = std::collections::HashSet::new();
        for s in 6..8 {
            for layer in 0..6 {
                for kv in 0..2 {
                    let a = l.addr(s, layer, kv);
                    assert!(a >= r[1].addr && a + obj <= r[1].addr + r[1].len);
                    assert!(seen.insert(a), "store objects never overlap");
                }
            }
        }
    }
}
