//! The engine's paged KV memory, as kvtier sees it: where every object lives.
//!
//! A serving engine owns its KV cache (vLLM allocates it with torch); kvtier
//! only needs to know the layout to compute each object's address once, when
//! the P2P table is built. [`KvMemory`] is that description. [`HostKvCache`]
//! is a KV cache kvtier allocates itself (tests, `kvtier bench`, engines that
//! let us own the staging memory), page-aligned for direct I/O.

use crate::error::{Error, Result};
use crate::model::KvGeometry;
use memmap2::{MmapOptions, MmapRaw};

/// K is object 0 of a (block, layer) pair, V is object 1.
pub const K: u32 = 0;
/// V is object 1 of a (block, layer) pair.
pub const V: u32 = 1;

/// How the engine lays out its paged KV memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// vLLM's per-layer tensors: layer `l` is one tensor shaped
    /// `(2, num_blocks, block_size, kv_heads, head_dim)` at `layer_bases[l]`,
    /// so K of block b is at `base + b*obj` and V at `base + (num_blocks + b)*obj`.
    PerLayer {
        /// Address of each layer's tensor.
        layer_bases: Vec<u64>,
    },
    /// One cross-layer tensor shaped
    /// `(num_blocks, layers, 2, block_size, kv_heads, head_dim)`: a block's 2L
    /// objects are contiguous (vLLM's cross-layer offloading layout, LMCache chunks).
    CrossLayer {
        /// Address of the tensor.
        base: u64,
    },
    /// Per-layer tensors, block outermost: layer `l` is one tensor shaped
    /// `(num_blocks, 2, block_size, kv_heads, head_dim)` at `layer_bases[l]`
    /// (vLLM's CPU backend; 0.33 standardises this view), so K of block b is
    /// at `base + 2b*obj` and V right after it.
    BlockMajor {
        /// Address of each layer's tensor.
        layer_bases: Vec<u64>,
    },
}

/// Where the memory is: the engines that can reach it differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory: every engine reaches it.
    Host,
    /// Device memory of CUDA device `ordinal` (GPU engine only).
    Gpu {
        /// The CUDA device ordinal.
        ordinal: u32,
    },
}

/// A description of registered KV memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvMemory {
    /// The geometry of every block.
    pub geometry: KvGeometry,
    /// Paged blocks in the engine's KV cache (vLLM's num_gpu_blocks).
    pub num_blocks: u32,
    /// Where each block's objects are.
    pub layout: KvLayout,
    /// Host or GPU memory.
    pub kind: MemoryKind,
}

impl KvMemory {
    /// Address of the K (`kv = 0`) or V (`kv = 1`) object of `block` for `layer`.
    pub fn object_addr(&self, block: u32, layer: u32, kv: u32) -> u64 {
        let obj = self.geometry.object_bytes();
        match &self.layout {
            KvLayout::PerLayer { layer_bases } => {
                layer_bases[layer as usize]
                    + (kv as u64 * self.num_blocks as u64 + block as u64) * obj
            }
            KvLayout::CrossLayer { base } => {
                let l = self.geometry.layers as u64;
                base + ((block as u64 * l + layer as u64) * 2 + kv as u64) * obj
            }
            KvLayout::BlockMajor { layer_bases } => {
                layer_bases[layer as usize] + (block as u64 * 2 + kv as u64) * obj
            }
        }
    }

    /// The contiguous address ranges the memory occupies, `(addr, len)`.
    pub fn regions(&self) -> Vec<(u64, u64)> {
        let obj = self.geometry.object_bytes();
        let per_layer = 2 * self.num_blocks as u64 * obj;
        match &self.layout {
            KvLayout::PerLayer { layer_bases } | KvLayout::BlockMajor { layer_bases } => {
                layer_bases.iter().map(|&b| (b, per_layer)).collect()
            }
            KvLayout::CrossLayer { base } => {
                vec![(*base, per_layer * self.geometry.layers as u64)]
            }
        }
    }

    /// Checks the description against the geometry and the direct-I/O
    /// alignment every object address must have.
    pub fn validate(&self) -> Result<()> {
        self.validate_aligned(
            KvGeometry::DIRECT_IO_ALIGN,
            "the alignment direct I/O (O_DIRECT, NVMe DMA) requires",
        )
    }

    /// As [`Self::validate`] for memory only copy kernels touch (GPU memory
    /// on the staged path, where no device DMAs into it): 16-byte alignment,
    /// the copy kernels' vector width, is enough; a torch allocation has it.
    pub fn validate_for_copies(&self) -> Result<()> {
        self.validate_aligned(16, "the alignment the staging copy kernels need")
    }

    fn validate_aligned(&self, align: u64, why: &str) -> Result<()> {
        self.geometry.validate()?;
        if self.num_blocks == 0 {
            return Err(Error::Registration(
                "num_blocks is 0: register the KV cache after it is allocated".into(),
            ));
        }
        let entries = self.num_blocks as u64 * self.geometry.objects_per_block() as u64;
        if entries > u32::MAX as u64 / 2 {
            return Err(Error::Registration(format!(
                "{} blocks x {} objects is more objects than a P2P table indexes (2^31); register fewer blocks",
                self.num_blocks,
                self.geometry.objects_per_block()
            )));
        }
        match &self.layout {
            KvLayout::PerLayer { layer_bases } | KvLayout::BlockMajor { layer_bases } => {
                if layer_bases.len() != self.geometry.layers as usize {
                    return Err(Error::Registration(format!(
                        "per-layer layout has {} layer tensors but the model has {} layers; pass one base address per layer",
                        layer_bases.len(),
                        self.geometry.layers
                    )));
                }
                for (l, &b) in layer_bases.iter().enumerate() {
                    if b % align != 0 {
                        return Err(Error::Registration(format!(
                            "layer {l} KV tensor at {b:#x} is not aligned to {align} bytes, {why}; allocate the KV cache {align}-byte aligned"
                        )));
                    }
                }
            }
            KvLayout::CrossLayer { base } => {
                if base % align != 0 {
                    return Err(Error::Registration(format!(
                        "cross-layer KV tensor at {base:#x} is not aligned to {align} bytes, {why}; allocate the KV cache {align}-byte aligned"
                    )));
                }
            }
        }
        let mut regions = self.regions();
        // An address from a caller (Python passes integers) whose tensor
        // would end past the address space: the sums below overflowed.
        if let Some(&(a, len)) = regions
            .iter()
            .find(|(a, len)| a.checked_add(*len).is_none())
        {
            return Err(Error::Registration(format!(
                "KV tensor at {a:#x} of {len} bytes ends past the address space; pass the tensors' real addresses"
            )));
        }
        regions.sort();
        for w in regions.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(Error::Registration(format!(
                    "KV tensors overlap: [{:#x}, +{}) and [{:#x}, +{}); each layer needs its own memory",
                    w[0].0, w[0].1, w[1].0, w[1].1
                )));
            }
        }
        Ok(())
    }

    /// Bytes of all regions together.
    pub fn total_bytes(&self) -> u64 {
        self.regions().iter().map(|r| r.1).sum()
    }
}

/// Anonymous memory for direct I/O, backed by transparent huge pages where
/// the kernel allows (MADV_HUGEPAGE), and faulted in before use.
///
/// Why huge pages: a 4 KiB-page buffer is one DMA segment per page, and block
/// devices cap segments per request (virtio-blk here: 254; NVMe: PRP lists
/// and MDTS), so a 1 MiB read into 4 KiB pages can be split into several
/// device requests, where a 2 MiB page is one segment.
pub struct DmaBuffer {
    map: MmapRaw,
    skip: usize,
    len: usize,
}

// SAFETY: plain memory, accessed only through raw pointers.
unsafe impl Send for DmaBuffer {}
unsafe impl Sync for DmaBuffer {}

impl DmaBuffer {
    const HUGE: usize = 2 << 20;

    /// `len` usable bytes, 2 MiB aligned, faulted in (hugetlbfs pages when enough are free, else transparent huge pages).
    pub fn new(len: usize) -> Result<DmaBuffer> {
        // Whole huge pages, plus one so the usable part can start 2 MiB
        // aligned: THP backs only aligned 2 MiB ranges of a mapping, and
        // io_uring coalesces a fixed buffer into huge-page segments only
        // when every page of it is huge.
        let rounded = len.div_ceil(Self::HUGE) * Self::HUGE;
        // Reserved (hugetlbfs) pages when the system has enough free: always
        // huge, no compaction needed. Otherwise transparent huge pages.
        if hugetlb_free_bytes() >= rounded as u64 {
            if let Ok(m) = MmapOptions::new().len(rounded).huge(Some(21)).map_anon() {
                not_inherited(&m);
                let buf = DmaBuffer {
                    map: MmapRaw::from(m),
                    skip: 0,
                    len,
                };
                for off in (0..rounded).step_by(Self::HUGE) {
                    // SAFETY: off < rounded, inside the mapping.
                    unsafe { buf.as_mut_ptr().add(off).write_volatile(0) };
                }
                return Ok(buf);
            }
        }
        let m = MmapOptions::new()
            .len(rounded + Self::HUGE)
            .map_anon()
            .map_err(|e| Error::io(format!("allocating {len} bytes of DMA memory"), e))?;
        // Best effort: without THP the memory still works, in 4 KiB pages.
        let _ = m.advise(memmap2::Advice::HugePage);
        not_inherited(&m);
        let map = MmapRaw::from(m);
        let base = map.as_mut_ptr() as usize;
        let skip = (Self::HUGE - base % Self::HUGE) % Self::HUGE;
        let buf = DmaBuffer { map, skip, len };
        // Fault every page in now rather than during I/O.
        for off in (0..rounded).step_by(4096) {
            // SAFETY: off < rounded, inside the mapping past `skip`.
            unsafe { buf.as_mut_ptr().add(off).write_volatile(0) };
        }
        buf.collapse_into_huge_pages(rounded);
        Ok(buf)
    }

    /// Ask the kernel to move the first `len` usable bytes into transparent
    /// huge pages now (MADV_COLLAPSE, Linux 6.1+). A fault takes a huge page
    /// only when one is free at that moment, so on a machine whose memory is
    /// fragmented (this VM's kernel counted 16297 THP fault fallbacks over a
    /// day of benchmarks) some 2 MiB ranges come back in 4 KiB pages: 512
    /// DMA segments per I/O instead of one. Best effort: an older kernel, THP
    /// off, or no huge page to be had leaves the memory as it is, still
    /// correct; ranges already huge cost only the scan.
    fn collapse_into_huge_pages(&self, len: usize) {
        // SAFETY: the range is inside this mapping; MADV_COLLAPSE keeps the
        // contents (it copies them into the new pages) and changes nothing
        // else about the mapping.
        unsafe {
            libc::madvise(self.as_mut_ptr().cast(), len, libc::MADV_COLLAPSE);
        }
    }

    /// Start of the usable bytes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        // SAFETY: skip < HUGE, inside the mapping.
        unsafe { self.map.as_mut_ptr().add(self.skip) }
    }

    /// Start of the usable bytes, as an address for DMA tables.
    pub fn addr(&self) -> u64 {
        self.as_mut_ptr() as u64
    }

    /// Usable bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No usable bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// DMA memory stays out of fork()ed children (MADV_DONTFORK), as RDMA
/// libraries do with registered memory: the kernel copies pages pinned for
/// I/O at fork rather than sharing them, which for hugetlbfs pages needs
/// free huge pages and otherwise fails the parent's fork with ENOMEM. A
/// child has no use for it: the tier's I/O thread stays in the parent.
fn not_inherited(m: &memmap2::MmapMut) {
    // Best effort: without it fork still works wherever the copy fits.
    let _ = m.advise(memmap2::Advice::DontFork);
}

/// Free bytes of reserved huge pages (HugePages_Free x Hugepagesize).
pub fn hugetlb_free_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    field("HugePages_Free:") * field("Hugepagesize:") * 1024
}

/// Which layout a [`HostKvCache`] allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLayout {
    /// One mapping per layer (vLLM's per-layer tensors).
    PerLayer,
    /// One mapping for all layers (cross-layer, a block's objects contiguous).
    CrossLayer,
}

/// A page-aligned host KV cache owned by kvtier: anonymous mappings, one per
/// layer (per-layer layout, like vLLM's tensors) or one in all (cross-layer).
///
/// Object contents are copied in and out through raw pointers and never
/// borrowed as slices: the kernel DMAs into this memory while I/O is in
/// flight, so Rust references to it would alias a writer we do not control.
pub struct HostKvCache {
    maps: Vec<DmaBuffer>,
    memory: KvMemory,
}

// SAFETY: the mappings are plain memory reached only through raw-pointer
// copies, never references. Copying an object while a device DMAs into it
// is a data race the caller must avoid (the tier refuses to load into a
// block a store is reading, and vice versa); kvtier itself never does it.
unsafe impl Send for HostKvCache {}
unsafe impl Sync for HostKvCache {}

impl HostKvCache {
    /// `num_blocks` blocks of `geometry` in `layout`, zeroed.
    pub fn new(geometry: KvGeometry, num_blocks: u32, layout: HostLayout) -> Result<Self> {
        geometry.validate()?;
        let obj = geometry.object_bytes();
        let per_layer = 2 * num_blocks as u64 * obj;
        // Pinned memory beyond the machine's can never be had: say so
        // rather than fail an mmap of terabytes with ENOMEM.
        let total = per_layer.saturating_mul(geometry.layers as u64);
        if let Some(have) = crate::host::mem_total() {
            if total > have {
                return Err(Error::invalid(format!(
                    "a host KV cache of {num_blocks} blocks needs {} but this machine has {} of memory; give fewer blocks",
                    crate::host::size::human_bytes(total),
                    crate::host::size::human_bytes(have)
                )));
            }
        }
        let map = |len: u64| DmaBuffer::new(len as usize);
        let (maps, layout) = match layout {
            HostLayout::PerLayer => {
                let maps = (0..geometry.layers)
                    .map(|_| map(per_layer))
                    .collect::<Result<Vec<_>>>()?;
                let layer_bases = maps.iter().map(|m| m.addr()).collect();
                (maps, KvLayout::PerLayer { layer_bases })
            }
            HostLayout::CrossLayer => {
                let m = map(per_layer * geometry.layers as u64)?;
                let base = m.addr();
                (vec![m], KvLayout::CrossLayer { base })
            }
        };
        let memory = KvMemory {
            geometry,
            num_blocks,
            layout,
            kind: MemoryKind::Host,
        };
        memory.validate()?;
        Ok(HostKvCache { maps, memory })
    }

    /// The memory as the tier registers it.
    pub fn memory(&self) -> &KvMemory {
        &self.memory
    }

    /// Blocks it holds.
    pub fn num_blocks(&self) -> u32 {
        self.memory.num_blocks
    }

    fn check(&self, block: u32, layer: u32, kv: u32) {
        assert!(
            block < self.memory.num_blocks && layer < self.memory.geometry.layers && kv < 2,
            "object (block {block}, layer {layer}, kv {kv}) outside a cache of {} blocks x {} layers",
            self.memory.num_blocks,
            self.memory.geometry.layers
        );
    }

    /// Copy an object out.
    pub fn read_object(&self, block: u32, layer: u32, kv: u32, out: &mut [u8]) {
        self.check(block, layer, kv);
        let n = self.memory.geometry.object_bytes() as usize;
        assert_eq!(out.len(), n, "object buffer size");
        let src = self.memory.object_addr(block, layer, kv) as *const u8;
        // SAFETY: check() bounds the object inside one of our live mappings.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), n) }
    }

    /// Copy an object in.
    pub fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) {
        self.check(block, layer, kv);
        let n = self.memory.geometry.object_bytes() as usize;
        assert_eq!(data.len(), n, "object buffer size");
        let dst = self.memory.object_addr(block, layer, kv) as *mut u8;
        // SAFETY: as in read_object; the mapping is writable.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, n) }
    }

    /// Zero every byte (tests clear memory between store and load).
    pub fn clear(&self) {
        for m in &self.maps {
            // SAFETY: writes within the mapping's own length.
            unsafe { std::ptr::write_bytes(m.as_mut_ptr(), 0, m.len()) }
        }
    }

    /// Fill a block's 2L objects with bytes derived from `seed` (deterministic;
    /// every object distinct), as test and benchmark data.
    pub fn fill_block(&self, block: u32, seed: u64) {
        let g = self.memory.geometry;
        let mut buf = vec![0u8; g.object_bytes() as usize];
        for layer in 0..g.layers {
            for kv in 0..2 {
                pattern_fill(&mut buf, seed, layer, kv);
                self.write_object(block, layer, kv, &buf);
            }
        }
    }

    /// True when the block holds exactly what `fill_block(block, seed)` wrote,
    /// for layers in `layers`.
    pub fn block_matches(&self, block: u32, seed: u64, layers: std::ops::Range<u32>) -> bool {
        let g = self.memory.geometry;
        let mut want = vec![0u8; g.object_bytes() as usize];
        let mut got = vec![0u8; g.object_bytes() as usize];
        for layer in layers {
            for kv in 0..2 {
                pattern_fill(&mut want, seed, layer, kv);
                self.read_object(block, layer, kv, &mut got);
                if want != got {
                    return false;
                }
            }
        }
        true
    }
}

/// Deterministic pseudo-random bytes for (seed, layer, kv): splitmix64 words.
pub fn pattern_fill(buf: &mut [u8], seed: u64, layer: u32, kv: u32) {
    let mut x = seed ^ ((layer as u64) << 32 | (kv as u64) << 31) ^ 0x9E37_79B9_7F4A_7C15;
    for chunk in buf.chunks_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_like(base: u64) -> KvMemory {
        let geometry = KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            dtype: crate::model::DType::BF16,
            block_size: 16,
        };
        let per_layer = 2 * 8 * geometry.object_bytes();
        KvMemory {
            geometry,
            num_blocks: 8,
            layout: KvLayout::PerLayer {
                layer_bases: vec![base, base + per_layer + 512],
            },
            kind: MemoryKind::Gpu { ordinal: 0 },
        }
    }

    /// A tensor address whose region would end past the address space is
    /// refused (the overlap check's sums overflowed into a panic).
    #[test]
    fn a_region_past_the_address_space_is_refused() {
        let mut m = gpu_like(0);
        m.layout = KvLayout::CrossLayer { base: !4095 };
        for v in [m.validate(), m.validate_for_copies()] {
            let e = v.unwrap_err().to_string();
            assert!(e.contains("past the address space"), "{e}");
        }
    }

    /// A torch allocation's 512-byte alignment is enough for the copy
    /// kernels of the staged path, not for direct I/O; 8 bytes is neither.
    #[test]
    fn copy_alignment_is_looser_than_direct_io() {
        let m = gpu_like(0x7f00_0000_0200);
        assert!(m.validate_for_copies().is_ok());
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("direct I/O") && e.contains("4096"), "{e}");
        let e = gpu_like(0x7f00_0000_0208)
            .validate_for_copies()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("staging copy kernels") && e.contains("16 bytes"),
            "{e}"
        );
    }
}
