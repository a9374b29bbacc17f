//! The P2P table: for every (memory block slot, layer, K|V) of registered KV
//! memory, a 16-byte SGL data-block descriptor {address, length}.
//!
//! Built once when the engine registers its KV memory, so that at I/O time a
//! layer's restore looks up descriptors by index and never computes an address
//! or walks a page list (the whole point of Tutti's SGL design: for a 60 GB
//! pool of 64 KiB objects this is 15 MB where PRP lists would be 3.75 GB).
//! Entries past the KV objects are "extra" regions the tier registers for its
//! own buffers (the staging area for block headers), so every IOCTX names its
//! memory the same way.

use crate::error::{Error, Result};
use crate::memory::{KvMemory, MemoryKind};
use crate::model::KvGeometry;
use crate::nvme::spec::SglDescriptor;

/// A contiguous memory range engines may register (io_uring fixed buffers,
/// IOMMU mappings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The P2P table: one SGL data-block descriptor per (memory block, layer, K/V) of the
/// registered KV memory (or per buffer), built once at registration; IOCTX segments index it.
pub struct P2pTable {
    /// Geometry of the KV memory; `None` for a table of plain buffers.
    geometry: Option<KvGeometry>,
    layers: u32,
    num_blocks: u32,
    kind: MemoryKind,
    entries: Vec<SglDescriptor>,
    kv_entries: usize,
    regions: Vec<MemRegion>,
}

impl P2pTable {
    /// Build the table for registered memory. Fails with a message naming the
    /// misaligned tensor and the required alignment.
    pub fn build(mem: &KvMemory) -> Result<Self> {
        mem.validate()?;
        let g = mem.geometry;
        let obj = g.object_bytes();
        if obj > u32::MAX as u64 {
            return Err(Error::Registration(format!(
                "object size {obj} B exceeds an SGL descriptor's 32-bit length; use a smaller block_size"
            )));
        }
        let n = mem.num_blocks as usize * g.objects_per_block() as usize;
        let mut entries = Vec::with_capacity(n);
        for block in 0..mem.num_blocks {
            for layer in 0..g.layers {
                for kv in 0..2 {
                    entries.push(SglDescriptor::data_block(
                        mem.object_addr(block, layer, kv),
                        obj as u32,
                    ));
                }
            }
        }
        let regions = mem
            .regions()
            .into_iter()
            .map(|(addr, len)| MemRegion { addr, len })
            .collect();
        Ok(P2pTable {
            geometry: Some(g),
            layers: g.layers,
            num_blocks: mem.num_blocks,
            kind: mem.kind,
            entries,
            kv_entries: n,
            regions,
        })
    }

    /// A table for memory whose objects are not at the places a
    /// [`KvMemory`] layout computes: `addr(block, layer, kv)` gives each
    /// object's address, and every object must lie inside one of `regions`
    /// (the ranges engines register). Objects of different (block, layer)
    /// may share memory: the staged HBM path reuses one host buffer for
    /// several layers, in turn (`crate::staged`).
    pub fn from_objects(
        geometry: KvGeometry,
        num_blocks: u32,
        kind: MemoryKind,
        regions: Vec<MemRegion>,
        addr: impl Fn(u32, u32, u32) -> u64,
    ) -> Result<Self> {
        geometry.validate()?;
        let obj = geometry.object_bytes();
        if obj > u32::MAX as u64 {
            return Err(Error::Registration(format!(
                "object size {obj} B exceeds an SGL descriptor's 32-bit length; use a smaller block_size"
            )));
        }
        let n = num_blocks as u64 * geometry.objects_per_block() as u64;
        if num_blocks == 0 || n > u32::MAX as u64 / 2 {
            return Err(Error::Registration(format!(
                "{num_blocks} blocks: a P2P table indexes 1 to 2^31 objects"
            )));
        }
        let mut entries = Vec::with_capacity(n as usize);
        for block in 0..num_blocks {
            for layer in 0..geometry.layers {
                for kv in 0..2 {
                    let a = addr(block, layer, kv);
                    if a % KvGeometry::DIRECT_IO_ALIGN != 0
                        || !regions
                            .iter()
                            .any(|r| r.addr <= a && a + obj <= r.addr + r.len)
                    {
                        return Err(Error::Registration(format!(
                            "object (block {block}, layer {layer}, kv {kv}) at {a:#x} is not {}-byte aligned inside a registered region",
                            KvGeometry::DIRECT_IO_ALIGN
                        )));
                    }
                    entries.push(SglDescriptor::data_block(a, obj as u32));
                }
            }
        }
        Ok(P2pTable {
            geometry: Some(geometry),
            layers: geometry.layers,
            num_blocks,
            kind,
            entries,
            kv_entries: n as usize,
            regions,
        })
    }

    /// A table of plain buffers and no KV memory (raw-device benchmarks):
    /// `count` entries of `entry_len` bytes from `addr`, indices 0..count.
    pub fn for_buffers(addr: u64, entry_len: u32, count: u32) -> Result<Self> {
        let mut t = P2pTable {
            geometry: None,
            layers: 0,
            num_blocks: 0,
            kind: MemoryKind::Host,
            entries: Vec::new(),
            kv_entries: 0,
            regions: Vec::new(),
        };
        t.add_extra_region(addr, entry_len, count)?;
        Ok(t)
    }

    /// Index of the descriptor for (block slot, layer, K=0|V=1).
    #[inline]
    pub fn index(&self, block: u32, layer: u32, kv: u32) -> u32 {
        (block * self.layers + layer) * 2 + kv
    }

    /// Append `count` descriptors of `entry_len` bytes each covering the
    /// region at `addr`; returns the first new index.
    pub fn add_extra_region(&mut self, addr: u64, entry_len: u32, count: u32) -> Result<u32> {
        if addr % KvGeometry::DIRECT_IO_ALIGN != 0
            || entry_len as u64 % KvGeometry::DIRECT_IO_ALIGN != 0
        {
            return Err(Error::Registration(format!(
                "extra region at {addr:#x} with {entry_len}-byte entries is not {}-byte aligned",
                KvGeometry::DIRECT_IO_ALIGN
            )));
        }
        let first = self.entries.len();
        if first + count as usize > u32::MAX as usize {
            return Err(Error::Registration("P2P table full".into()));
        }
        for i in 0..count as u64 {
            self.entries.push(SglDescriptor::data_block(
                addr + i * entry_len as u64,
                entry_len,
            ));
        }
        self.regions.push(MemRegion {
            addr,
            len: entry_len as u64 * count as u64,
        });
        Ok(first as u32)
    }

    /// The descriptor at `index`, if there is one.
    pub fn entry(&self, index: u32) -> Option<&SglDescriptor> {
        self.entries.get(index as usize)
    }

    /// Every descriptor, in index order.
    pub fn entries(&self) -> &[SglDescriptor] {
        &self.entries
    }

    /// Descriptors that describe KV objects (the rest are extra regions).
    pub fn kv_entries(&self) -> usize {
        self.kv_entries
    }

    /// KV blocks the table covers (0 for a table of plain buffers).
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// The KV geometry, for a table of KV memory.
    pub fn geometry(&self) -> Option<&KvGeometry> {
        self.geometry.as_ref()
    }

    /// Where the memory lives (host or GPU).
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The contiguous memory ranges behind the descriptors, for engines to register.
    pub fn regions(&self) -> &[MemRegion] {
        &self.regions
    }

    /// Bytes of descriptors.
    pub fn table_bytes(&self) -> u64 {
        (self.entries.len() * std::mem::size_of::<SglDescriptor>()) as u64
    }
}

/// Bytes of NVMe PRP lists needed to describe `memory_bytes` of 4 KiB pages
/// as Tutti counts them (one 8-byte entry per page, in 64 KiB list pages of
/// which only 16 entries are used per I/O-sized chunk): the reference for the
/// P2P table's size. `object_bytes` sets how many pages one I/O names.
pub fn prp_list_bytes(memory_bytes: u64, object_bytes: u64) -> u64 {
    const PAGE: u64 = 4096;
    let pages = memory_bytes.div_ceil(PAGE);
    let pages_per_object = object_bytes.div_ceil(PAGE).max(1);
    // Each object's I/O needs a PRP list page of its own (lists cannot be
    // shared between commands that start on different pages), and a list page
    // is a full 4 KiB page of up to 512 entries, plus a chained page per 511.
    let objects = pages.div_ceil(pages_per_object);
    let list_pages_per_object = if pages_per_object <= 2 {
        0
    } else {
        (pages_per_object - 1).div_ceil(511)
    };
    objects * list_pages_per_object * PAGE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{HostKvCache, HostLayout, KvLayout};
    use crate::model::{preset, DType};

    fn tiny() -> KvGeometry {
        KvGeometry {
            layers: 3,
            kv_heads: 2,
            head_dim: 64,
            dtype: DType::BF16,
            block_size: 16,
        }
    }

    #[test]
    fn per_layer_layout_addresses() {
        let g = tiny();
        let obj = g.object_bytes();
        let mem = KvMemory {
            geometry: g,
            num_blocks: 10,
            layout: KvLayout::PerLayer {
                layer_bases: vec![0x10_0000, 0x20_0000, 0x30_0000],
            },
            kind: MemoryKind::Host,
        };
        let t = P2pTable::build(&mem).unwrap();
        assert_eq!(t.entries().len(), 10 * 3 * 2);
        let e = t.entry(t.index(4, 1, 1)).unwrap();
        assert_eq!(e.addr, 0x20_0000 + (10 + 4) * obj);
        assert_eq!(e.len as u64, obj);
        assert_eq!(e.sgl_id, 0);
        let e = t.entry(t.index(0, 2, 0)).unwrap();
        assert_eq!(e.addr, 0x30_0000);
        assert_eq!(t.table_bytes(), 60 * 16);
    }

    #[test]
    fn block_major_layout_addresses() {
        let g = tiny();
        let obj = g.object_bytes();
        let mem = KvMemory {
            geometry: g,
            num_blocks: 10,
            layout: KvLayout::BlockMajor {
                layer_bases: vec![0x10_0000, 0x20_0000, 0x30_0000],
            },
            kind: MemoryKind::Host,
        };
        let t = P2pTable::build(&mem).unwrap();
        assert_eq!(t.entries().len(), 10 * 3 * 2);
        // K and V of a block are adjacent within the layer's tensor.
        let k = t.entry(t.index(4, 1, 0)).unwrap();
        let v = t.entry(t.index(4, 1, 1)).unwrap();
        assert_eq!(k.addr, 0x20_0000 + 8 * obj);
        assert_eq!(v.addr, 0x20_0000 + 9 * obj);
        assert_eq!(
            t.entry(t.index(9, 2, 1)).unwrap().addr,
            0x30_0000 + 19 * obj
        );
        assert_eq!(mem.regions()[2], (0x30_0000, 20 * obj));
        let bad = KvMemory {
            layout: KvLayout::BlockMajor {
                layer_bases: vec![0x10_0000, 0x20_0010, 0x30_0000],
            },
            ..mem
        };
        let msg = P2pTable::build(&bad).err().unwrap().to_string();
        assert!(msg.contains("layer 1") && msg.contains("4096"), "{msg}");
    }

    #[test]
    fn cross_layer_layout_addresses() {
        let g = tiny();
        let obj = g.object_bytes();
        let mem = KvMemory {
            geometry: g,
            num_blocks: 4,
            layout: KvLayout::CrossLayer { base: 0x4000_0000 },
            kind: MemoryKind::Host,
        };
        let t = P2pTable::build(&mem).unwrap();
        // Block 2's objects are contiguous, in (layer, K|V) order.
        for layer in 0..3 {
            for kv in 0..2 {
                let e = t.entry(t.index(2, layer, kv)).unwrap();
                assert_eq!(
                    e.addr,
                    0x4000_0000 + (2 * 6 + layer as u64 * 2 + kv as u64) * obj
                );
            }
        }
    }

    #[test]
    fn unaligned_registration_names_the_alignment() {
        let mem = KvMemory {
            geometry: tiny(),
            num_blocks: 4,
            layout: KvLayout::PerLayer {
                layer_bases: vec![0x10_0000, 0x20_0010, 0x30_0000],
            },
            kind: MemoryKind::Host,
        };
        let msg = P2pTable::build(&mem).err().unwrap().to_string();
        assert!(msg.contains("layer 1") && msg.contains("4096"), "{msg}");
        let mem = KvMemory {
            layout: KvLayout::CrossLayer { base: 0x200 },
            ..mem
        };
        let msg = P2pTable::build(&mem).err().unwrap().to_string();
        assert!(msg.contains("aligned to 4096"), "{msg}");
    }

    #[test]
    fn wrong_layer_count_and_overlap_are_errors() {
        let g = tiny();
        let mem = KvMemory {
            geometry: g,
            num_blocks: 4,
            layout: KvLayout::PerLayer {
                layer_bases: vec![0x10_0000, 0x20_0000],
            },
            kind: MemoryKind::Host,
        };
        let msg = P2pTable::build(&mem).err().unwrap().to_string();
        assert!(
            msg.contains("2 layer tensors") && msg.contains("3 layers"),
            "{msg}"
        );
        let mem = KvMemory {
            layout: KvLayout::PerLayer {
                layer_bases: vec![0x10_0000, 0x10_1000, 0x30_0000],
            },
            ..mem
        };
        assert!(P2pTable::build(&mem)
            .err()
            .unwrap()
            .to_string()
            .contains("overlap"));
    }

    #[test]
    fn host_cache_table_points_into_its_memory() {
        let g = tiny();
        for layout in [HostLayout::PerLayer, HostLayout::CrossLayer] {
            let cache = HostKvCache::new(g, 5, layout).unwrap();
            let t = P2pTable::build(cache.memory()).unwrap();
            cache.fill_block(3, 42);
            let e = t.entry(t.index(3, 2, 1)).unwrap();
            let mut via_cache = vec![0u8; g.object_bytes() as usize];
            cache.read_object(3, 2, 1, &mut via_cache);
            // SAFETY: the descriptor addresses live memory of `cache`.
            let via_table =
                unsafe { std::slice::from_raw_parts(e.addr as *const u8, e.len as usize) };
            assert_eq!(via_cache, via_table);
            assert!(cache.block_matches(3, 42, 0..3));
            assert!(!cache.block_matches(3, 43, 0..3));
        }
    }

    #[test]
    fn sixty_gb_pool_table_vs_prp_lists() {
        // Tutti's example: 60 GB of KV memory in 64 KiB objects.
        let g = preset("llama3-8b", 32).unwrap(); // 64 KiB objects
        assert_eq!(g.object_bytes(), 65536);
        let bytes = 60u64 << 30;
        let objects = bytes / g.object_bytes();
        let sgl = objects * 16;
        assert_eq!(sgl, 15 << 20, "15 MiB of SGL descriptors");
        let prp = prp_list_bytes(bytes, g.object_bytes());
        assert!(prp > 100 * sgl, "PRP lists {prp} vs SGL {sgl}");
    }
}
