//! One entry point per decoder of untrusted bytes, for fuzzing: the pool
//! superblock, the block headers, a model's config.json, a slack table.
//! The cargo-fuzz targets under `fuzz/` and the bounded randomized test
//! `tests/fuzz_decoders.rs` (what the test command runs, on stable Rust)
//! call the same functions, so both exercise the same paths.
//!
//! Each returns the error message when the input is refused (callers check
//! it stays short) and `None` when it was accepted (after exercising what a
//! user would do next with it). None of them may panic, hang or allocate
//! more than the input justifies.

use crate::error::{Error, Result};
use crate::host::dio::AlignedBuf;
use crate::host::signature::POOL_MAGIC;
use crate::model::{DType, KvGeometry};
use crate::pool::layout::{
    BlockHeader, Superblock, BLOCK_HEADER_MAGIC, BLOCK_STATE_LIVE, DATA_OFFSET, FORMAT_VERSION,
    SLOT_HEADER_BYTES,
};
use crate::pool::{namespace_hash, OpenExpect, Pool, PoolConfig, Storage};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const PAGE: u64 = 4096;

/// A sparse in-memory device: pages never written read as zeros.
#[derive(Clone)]
pub struct MemStorage {
    path: PathBuf,
    size: u64,
    pages: Arc<Mutex<BTreeMap<u64, Vec<u8>>>>,
}

impl MemStorage {
    pub fn new(name: &str, size: u64) -> MemStorage {
        MemStorage {
            path: PathBuf::from(name),
            size,
            pages: Arc::default(),
        }
    }

    /// An independent copy (the pages, not the handle).
    pub fn snapshot(&self) -> MemStorage {
        let pages = self.pages.lock().expect("unpoisoned").clone();
        MemStorage {
            path: self.path.clone(),
            size: self.size,
            pages: Arc::new(Mutex::new(pages)),
        }
    }

    /// Writes `bytes` at `offset` (any alignment).
    pub fn poke(&self, offset: u64, bytes: &[u8]) {
        let mut pages = self.pages.lock().expect("unpoisoned");
        for (i, b) in bytes.iter().enumerate() {
            let at = offset + i as u64;
            if at >= self.size {
                break;
            }
            let page = pages
                .entry(at / PAGE)
                .or_insert_with(|| vec![0; PAGE as usize]);
            page[(at % PAGE) as usize] = *b;
        }
    }

    fn range_ok(&self, offset: u64, len: usize) -> Result<()> {
        if offset % PAGE != 0
            || len as u64 % PAGE != 0
            || offset
                .checked_add(len as u64)
                .is_none_or(|end| end > self.size)
        {
            return Err(Error::Device {
                device: self.path.display().to_string(),
                offset,
                len: len as u64,
                reason: format!("outside the {} bytes of the device", self.size),
            });
        }
        Ok(())
    }
}

impl Storage for MemStorage {
    fn path(&self) -> &Path {
        &self.path
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<()> {
        self.range_ok(offset, buf.len())?;
        let pages = self.pages.lock().expect("unpoisoned");
        let out = buf.as_mut_slice();
        out.fill(0);
        let first = offset / PAGE;
        let last = first + out.len() as u64 / PAGE;
        for (&p, page) in pages.range(first..last) {
            let at = ((p - first) * PAGE) as usize;
            out[at..at + PAGE as usize].copy_from_slice(page);
        }
        Ok(())
    }
    fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        self.range_ok(offset, buf.len())?;
        let mut pages = self.pages.lock().expect("unpoisoned");
        for (i, chunk) in buf.as_slice().chunks(PAGE as usize).enumerate() {
            let p = offset / PAGE + i as u64;
            if chunk.iter().all(|&b| b == 0) {
                pages.remove(&p);
            } else {
                pages.insert(p, chunk.to_vec());
            }
        }
        Ok(())
    }
    fn sync_data(&self) -> Result<()> {
        Ok(())
    }
}

/// Open the pool on `dev` and, if it opens, do what `pool info` and
/// `pool check` do. The error message when it does not.
fn open_and_check(dev: MemStorage) -> Option<String> {
    match Pool::open_on(vec![Box::new(dev)], &OpenExpect::default()) {
        Ok(pool) => {
            let _ = pool.info();
            pool.check(|_, _| {}).err().map(|e| e.to_string())
        }
        Err(e) => Some(e.to_string()),
    }
}

/// Bytes of the sparse device a fuzzed superblock describes.
pub const SUPERBLOCK_DEVICE_BYTES: u64 = 256 << 20;

/// The superblock decoder: `data[0]` is a set of repairs, the rest the
/// superblock's bytes (zero-padded to 512). Repairs let inputs reach the
/// checks behind the magic and the checksum: bit 0 writes the magic, bit 1
/// the format version, bit 2 the fixed layout fields, bit 3 (the one that
/// matters) seals the checksum, as a forger would.
pub fn superblock(data: &[u8]) -> Option<String> {
    let (&flags, rest) = data.split_first()?;
    let mut bytes = [0u8; 512];
    let n = rest.len().min(512);
    bytes[..n].copy_from_slice(&rest[..n]);
    let mut sb: Superblock = bytemuck::pod_read_unaligned(&bytes);
    if flags & 1 != 0 {
        sb.magic = POOL_MAGIC;
    }
    if flags & 2 != 0 {
        sb.version = FORMAT_VERSION;
    }
    if flags & 4 != 0 {
        sb.sb_bytes = 512;
        sb.data_offset = DATA_OFFSET;
        sb.slot_header_bytes = SLOT_HEADER_BYTES as u32;
        sb.device_index = 0;
        sb.device_count = 1;
    }
    if flags & 8 != 0 {
        sb.seal();
    }
    superblock_bytes(bytemuck::bytes_of(&sb))
}

/// Whether [`superblock`] would present `data` with a valid checksum.
pub fn superblock_is_sealed(data: &[u8]) -> bool {
    data.first().is_some_and(|f| f & 8 != 0)
}

/// A device whose first 512 bytes are `sb` (as given), opened and checked.
pub fn superblock_bytes(sb: &[u8]) -> Option<String> {
    let dev = MemStorage::new("fuzz-superblock", SUPERBLOCK_DEVICE_BYTES);
    dev.poke(0, &sb[..sb.len().min(512)]);
    open_and_check(dev)
}

/// A valid superblock (sealed) of a small pool on a device of
/// [`SUPERBLOCK_DEVICE_BYTES`]: the seed forgeries start from.
pub fn valid_superblock() -> [u8; 512] {
    let pool = tiny_pool();
    let dev = pool.0.snapshot();
    let mut buf = AlignedBuf::zeroed(PAGE as usize);
    dev.read_exact_at(&mut buf, 0).expect("in range");
    let mut sb = [0u8; 512];
    sb.copy_from_slice(&buf.as_slice()[..512]);
    sb
}

/// 1 layer x 1 KV head x 128 x bf16, 16-token blocks: 4 KiB objects.
fn tiny_geometry() -> KvGeometry {
    KvGeometry {
        layers: 1,
        kv_heads: 1,
        head_dim: 128,
        dtype: DType::BF16,
        block_size: 16,
    }
}

const TINY_GROUP: u32 = 4;
const TINY_GROUPS: u64 = 4;

/// A freshly formatted tiny pool (4 groups of 4 blocks) and its uuid.
fn tiny_pool() -> (MemStorage, [u8; 16]) {
    let g = tiny_geometry();
    let size = DATA_OFFSET
        + TINY_GROUPS * crate::pool::layout::PoolLayout::group_bytes_for(&g, TINY_GROUP);
    let dev = MemStorage::new("fuzz-headers", size);
    let cfg = PoolConfig::new(g, "fuzz", "fuzz/ns").with_group_blocks(TINY_GROUP);
    let pool = Pool::create_on(&cfg, vec![Box::new(dev.clone())]).expect("a tiny pool formats");
    drop(pool);
    let mut buf = AlignedBuf::zeroed(PAGE as usize);
    dev.read_exact_at(&mut buf, 0).expect("in range");
    let sb: Superblock = bytemuck::pod_read_unaligned(&buf.as_slice()[..512]);
    (dev, sb.pool_uuid)
}

/// The block-header decoder: a valid tiny pool whose header sectors are
/// overwritten from `data`, then opened (the index rebuilt from headers)
/// and checked. `data` is cut into 129-byte records, one per slot in
/// order: a repair byte, then the 128-byte header. Repairs (bit 0: magic,
/// 1: this pool's uuid, 2: the right slot, 3: live state, data length and
/// namespace, 4: seal the checksum) let records reach the checks a header
/// from this pool meets.
pub fn block_headers(data: &[u8]) -> Option<String> {
    thread_local! {
        static POOL: (MemStorage, [u8; 16]) = tiny_pool();
    }
    let (dev, uuid) = POOL.with(|(d, u)| (d.snapshot(), *u));
    let g = tiny_geometry();
    let group_bytes = crate::pool::layout::PoolLayout::group_bytes_for(&g, TINY_GROUP);
    let slots = TINY_GROUPS * TINY_GROUP as u64;
    for (slot, rec) in data.chunks(129).take(slots as usize).enumerate() {
        let slot = slot as u64;
        let (&flags, rest) = match rec.split_first() {
            Some(x) => x,
            None => break,
        };
        let mut bytes = [0u8; 128];
        bytes[..rest.len()].copy_from_slice(rest);
        let mut h: BlockHeader = bytemuck::pod_read_unaligned(&bytes);
        if flags & 1 != 0 {
            h.magic = BLOCK_HEADER_MAGIC;
        }
        if flags & 2 != 0 {
            h.pool_uuid = uuid;
        }
        if flags & 4 != 0 {
            h.slot = slot;
        }
        if flags & 8 != 0 {
            h.state = BLOCK_STATE_LIVE;
            h.data_len = g.block_bytes();
            h.namespace_hash = namespace_hash("fuzz/ns");
        }
        if flags & 16 != 0 {
            h.seal();
        }
        let group = slot / TINY_GROUP as u64;
        let at = DATA_OFFSET + group * group_bytes + (slot % TINY_GROUP as u64) * SLOT_HEADER_BYTES;
        dev.poke(at, bytemuck::bytes_of(&h));
    }
    open_and_check(dev)
}

/// The config.json decoder, and the name a pool would get from it.
pub fn config_json(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    match KvGeometry::from_hf_config_str(&text, "fuzz/config.json", 16, None) {
        Ok(g) => {
            let root: serde_json::Value = serde_json::from_str(&text).expect("it parsed");
            let name = crate::model::config_identity(&root, &g);
            assert!(name.len() <= 64, "a model name of {} bytes", name.len());
            None
        }
        Err(e) => Some(e.to_string()),
    }
}

/// The slack-table loader; an accepted table is looked up at and past its
/// grid's edges and must survive a round trip through its own writer.
pub fn slack_table(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    match crate::slack::SlackTable::from_json_str(&text, "fuzz/table.json") {
        Ok(t) => {
            for (input, prefix) in [(0, 0), (1, 1), (4097, 3000), (u64::MAX, u64::MAX)] {
                let _ = t.prefill(input, prefix);
                let _ = t.decode(input);
                let _ = t.layer(input, prefix, t.layers());
            }
            crate::slack::SlackTable::from_json_str(&t.to_json_string(), "fuzz/round-trip.json")
                .expect("a loaded table reloads from what it writes");
            None
        }
        Err(e) => Some(e.to_string()),
    }
}
