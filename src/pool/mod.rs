//! The pool: GPU files (blocks) on one or more SSDs, found by key.
//!
//! `create` formats devices (superblock per device); `open` reads every
//! superblock, checks they form one pool with the expected geometry, and
//! rebuilds the index from the block headers. The pool does no data I/O of
//! its own besides that and `check`: stores and loads go through the tier and
//! an engine, and the pool only hands out slots and makes keys visible.

pub mod backing;
pub mod index;
pub mod layout;
pub mod storage;

use crate::error::{Error, Result};
use crate::model::{DType, KvGeometry};
use backing::{AlignedBuf, BackingDevice, POOL_MAGIC};
use bytemuck::Zeroable;
use index::Index;
use layout::*;
use std::fmt;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
pub use storage::Storage;

/// A block's identity: its content hash (up to 32 bytes: vLLM BlockHash,
/// LMCache chunk hash) within the pool's namespace.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    bytes: [u8; 32],
    len: u8,
}

impl Key {
    pub fn new(hash: &[u8]) -> Result<Key> {
        if hash.is_empty() || hash.len() > 32 {
            return Err(Error::invalid(format!(
                "a key is 1 to 32 bytes of content hash; got {} bytes",
                hash.len()
            )));
        }
        let mut bytes = [0u8; 32];
        bytes[..hash.len()].copy_from_slice(hash);
        Ok(Key {
            bytes,
            len: hash.len() as u8,
        })
    }

    /// An 8-byte key (tests, benchmarks, integer block hashes).
    pub fn from_u64(x: u64) -> Key {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&x.to_le_bytes());
        Key { bytes, len: 8 }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

/// FNV-1a: the namespace's stable 64-bit id in block headers.
pub fn namespace_hash(ns: &str) -> u64 {
    ns.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// One backing device to format: a path and, for files, its size.
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    pub path: PathBuf,
    /// Bytes; required for files, optional for block devices (whole device).
    pub size: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub geometry: KvGeometry,
    /// Model name recorded for `pool info` (free text).
    pub model: String,
    /// Namespace of the keys: model, dtype, layout, TP rank. A pool serves
    /// one namespace; opening it for another is an error.
    pub namespace: String,
    /// Blocks per extent group (G).
    pub group_blocks: u32,
    pub devices: Vec<DeviceSpec>,
    /// Overwrite devices that hold a filesystem or other data.
    pub force: bool,
}

pub const DEFAULT_GROUP_BLOCKS: u32 = 64;

/// What the caller expects of a pool it opens.
#[derive(Clone, Debug, Default)]
pub struct OpenExpect {
    pub geometry: Option<KvGeometry>,
    pub namespace: Option<String>,
}

pub struct Pool {
    devices: Vec<Box<dyn Storage>>,
    layout: PoolLayout,
    uuid: [u8; 16],
    namespace: String,
    namespace_hash: u64,
    model: String,
    index: Index,
    next_generation: u64,
    /// Headers that had our magic and uuid but failed their checksum at open.
    damaged_headers: Vec<u64>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub path: PathBuf,
    pub size: u64,
    pub groups: u32,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct PoolInfo {
    pub uuid: String,
    pub model: String,
    pub namespace: String,
    pub geometry: KvGeometry,
    pub object_bytes: u64,
    pub block_bytes: u64,
    pub group_blocks: u32,
    pub group_bytes: u64,
    pub devices: Vec<DeviceInfo>,
    pub total_slots: u64,
    pub live_blocks: u64,
    pub free_slots: u64,
    pub pinned_blocks: u64,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub damaged_headers: u64,
}

/// What `check` found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CheckReport {
    pub blocks_checked: u64,
    pub blocks_ok: u64,
    /// Blocks stored from GPU memory, which carry no data checksum.
    pub blocks_unverifiable: u64,
    /// Slots whose header is ours but fails its checksum.
    pub damaged_headers: Vec<u64>,
    /// (slot, key) of live blocks whose data does not match the header's checksum.
    pub bad_data: Vec<(u64, String)>,
    pub bytes_read: u64,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.damaged_headers.is_empty() && self.bad_data.is_empty()
    }
}

fn random_uuid() -> Result<[u8; 16]> {
    let mut u = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut u))
        .map_err(|e| Error::io("reading /dev/urandom for the pool id", e))?;
    Ok(u)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Pool {
    /// Format a new pool over the given devices (files or block devices).
    pub fn create(cfg: &PoolConfig) -> Result<Pool> {
        Self::check_config(cfg, cfg.devices.len())?;
        let mut seen = std::collections::HashSet::new();
        for d in &cfg.devices {
            let canon = std::fs::canonicalize(&d.path).unwrap_or_else(|_| d.path.clone());
            if !seen.insert(canon) {
                return Err(Error::Backing {
                    path: d.path.clone(),
                    reason: "named twice; each backing device may appear once".into(),
                });
            }
        }
        let min_size = DATA_OFFSET + PoolLayout::group_bytes_for(&cfg.geometry, cfg.group_blocks);
        let mut devices: Vec<Box<dyn Storage>> = Vec::new();
        for d in &cfg.devices {
            devices.push(Box::new(BackingDevice::create(
                &d.path, d.size, min_size, cfg.force,
            )?));
        }
        Self::format(cfg, devices)
    }

    /// Format a new pool over storage the caller opened (an NVMe namespace
    /// driven from userspace); `cfg.devices` is not used.
    /// Like [`Pool::create`], it refuses storage that holds a filesystem,
    /// a partition table or data that is not a kvtier pool, unless
    /// `cfg.force`.
    pub fn create_on(cfg: &PoolConfig, devices: Vec<Box<dyn Storage>>) -> Result<Pool> {
        Self::check_config(cfg, devices.len())?;
        let min_size = DATA_OFFSET + PoolLayout::group_bytes_for(&cfg.geometry, cfg.group_blocks);
        for d in &devices {
            let probe = (backing::SIGNATURE_PROBE_BYTES as u64).min(d.size()) as usize & !4095;
            if probe > 0 {
                let mut head = AlignedBuf::zeroed(probe);
                d.read_exact_at(&mut head, 0)?;
                let sig = backing::probe_signature(head.as_slice());
                backing::check_signature(d.path(), &sig, cfg.force)?;
            }
            if d.size() < min_size {
                return Err(Error::Backing {
                    path: d.path().to_path_buf(),
                    reason: format!(
                        "holds {} bytes; this geometry and group size need at least {min_size}",
                        d.size()
                    ),
                });
            }
        }
        Self::format(cfg, devices)
    }

    fn check_config(cfg: &PoolConfig, devices: usize) -> Result<()> {
        cfg.geometry.validate()?;
        if devices == 0 {
            return Err(Error::invalid("a pool needs at least one backing device"));
        }
        if devices > u16::MAX as usize {
            return Err(Error::invalid("too many backing devices"));
        }
        if cfg.group_blocks == 0 || cfg.group_blocks > 4096 {
            return Err(Error::invalid(format!(
                "group size {} blocks must be between 1 and 4096",
                cfg.group_blocks
            )));
        }
        if cfg.namespace.len() > NAMESPACE_MAX {
            return Err(Error::invalid(format!(
                "namespace is {} bytes; at most {NAMESPACE_MAX}",
                cfg.namespace.len()
            )));
        }
        Ok(())
    }

    /// Write superblocks and empty header areas on `devices`.
    fn format(cfg: &PoolConfig, devices: Vec<Box<dyn Storage>>) -> Result<Pool> {
        let g = cfg.geometry;
        let groups: Vec<u32> = devices
            .iter()
            .map(|d| PoolLayout::groups_fitting(&g, cfg.group_blocks, d.size()))
            .collect();
        let layout = PoolLayout::new(g, cfg.group_blocks, groups.clone());
        let uuid = random_uuid()?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let model = truncate(&cfg.model, MODEL_NAME_MAX);
        for (i, dev) in devices.iter().enumerate() {
            // Zero every group's header area first: a device reused from an
            // earlier pool carries old headers, and a header the new pool
            // did not write must never be mistaken for one it did (the uuid
            // check would already refuse them; zeroing makes `check` quiet).
            let zero_headers =
                AlignedBuf::zeroed((cfg.group_blocks as u64 * SLOT_HEADER_BYTES) as usize);
            for local in 0..groups[i] {
                let off = DATA_OFFSET + local as u64 * layout.group_bytes();
                dev.write_all_at(&zero_headers, off)?;
            }
            let mut sb = Superblock::zeroed();
            sb.magic = POOL_MAGIC;
            sb.version = FORMAT_VERSION;
            sb.sb_bytes = std::mem::size_of::<Superblock>() as u32;
            sb.pool_uuid = uuid;
            sb.device_index = i as u32;
            sb.device_count = devices.len() as u32;
            sb.device_size = dev.size();
            sb.data_offset = DATA_OFFSET;
            sb.group_blocks = cfg.group_blocks;
            sb.groups_on_device = groups[i];
            sb.total_groups = layout.total_groups();
            sb.layers = g.layers;
            sb.kv_heads = g.kv_heads;
            sb.head_dim = g.head_dim;
            sb.dtype = g.dtype.code();
            sb.block_size = g.block_size;
            sb.object_bytes = g.object_bytes();
            sb.slot_header_bytes = SLOT_HEADER_BYTES as u32;
            sb.namespace_len = cfg.namespace.len() as u32;
            sb.namespace[..cfg.namespace.len()].copy_from_slice(cfg.namespace.as_bytes());
            sb.model_len = model.len() as u32;
            sb.model[..model.len()].copy_from_slice(model.as_bytes());
            sb.created_unix = now;
            sb.seal();
            let mut buf = AlignedBuf::zeroed(4096);
            buf.as_mut_slice()[..512].copy_from_slice(bytemuck::bytes_of(&sb));
            dev.write_all_at(&buf, 0)?;
            dev.sync_data()?;
        }
        Ok(Pool {
            index: Index::new(layout.total_slots()),
            devices,
            layout,
            uuid,
            namespace_hash: namespace_hash(&cfg.namespace),
            namespace: cfg.namespace.clone(),
            model,
            next_generation: 1,
            damaged_headers: Vec::new(),
        })
    }

    /// Open an existing pool: all of its devices, in any order.
    pub fn open(paths: &[PathBuf], expect: &OpenExpect) -> Result<Pool> {
        if paths.is_empty() {
            return Err(Error::invalid("name the pool's backing devices to open it"));
        }
        let mut devices: Vec<Box<dyn Storage>> = Vec::new();
        for p in paths {
            devices.push(Box::new(BackingDevice::open(p)?));
        }
        Self::open_on(devices, expect)
    }

    /// Open an existing pool on storage the caller opened, in any order.
    pub fn open_on(devices: Vec<Box<dyn Storage>>, expect: &OpenExpect) -> Result<Pool> {
        if devices.is_empty() {
            return Err(Error::invalid("name the pool's backing devices to open it"));
        }
        let path0 = devices[0].path().to_path_buf();
        let mut found: Vec<(Superblock, Box<dyn Storage>)> = Vec::new();
        for dev in devices {
            let mut buf = AlignedBuf::zeroed(4096);
            dev.read_exact_at(&mut buf, 0)?;
            let sb: Superblock = bytemuck::pod_read_unaligned(&buf.as_slice()[..512]);
            check_superblock(&sb, dev.path())?;
            found.push((sb, dev));
        }
        let first = found[0].0;
        for (sb, dev) in &found {
            if sb.pool_uuid != first.pool_uuid {
                return Err(Error::GeometryMismatch {
                    path: dev.path().to_path_buf(),
                    reason: format!(
                        "belongs to pool {} but {} belongs to pool {}; name the devices of one pool",
                        hex(&sb.pool_uuid),
                        path0.display(),
                        hex(&first.pool_uuid)
                    ),
                });
            }
        }
        let n = first.device_count as usize;
        if found.len() != n {
            return Err(Error::GeometryMismatch {
                path: path0,
                reason: format!(
                    "the pool has {n} device(s) but {} were named; name every device of the pool",
                    found.len()
                ),
            });
        }
        found.sort_by_key(|(sb, _)| sb.device_index);
        for (i, (sb, dev)) in found.iter().enumerate() {
            if sb.device_index as usize != i {
                return Err(Error::GeometryMismatch {
                    path: dev.path().to_path_buf(),
                    reason: format!(
                        "device index {} named twice or missing {i}",
                        sb.device_index
                    ),
                });
            }
            if dev.size() < sb.device_size {
                return Err(Error::Backing {
                    path: dev.path().to_path_buf(),
                    reason: format!(
                        "is {} bytes but the pool was formatted with {}; it was truncated",
                        dev.size(),
                        sb.device_size
                    ),
                });
            }
        }
        let dtype = DType::from_code(first.dtype).ok_or_else(|| Error::Corrupt {
            path: path0.clone(),
            what: "superblock".into(),
            reason: format!("unknown dtype code {}", first.dtype),
        })?;
        let geometry = KvGeometry {
            layers: first.layers,
            kv_heads: first.kv_heads,
            head_dim: first.head_dim,
            dtype,
            block_size: first.block_size,
        };
        let namespace = first.namespace();
        if let Some(want) = &expect.geometry {
            if *want != geometry {
                return Err(Error::GeometryMismatch {
                    path: path0,
                    reason: format!(
                        "was created for {} ({}) but is opened for {}; open it with the model it was created for, or create a new pool",
                        first.model(),
                        geometry.describe(),
                        want.describe()
                    ),
                });
            }
        }
        if let Some(want) = &expect.namespace {
            if *want != namespace {
                return Err(Error::GeometryMismatch {
                    path: path0,
                    reason: format!(
                        "serves namespace {namespace:?} but is opened for {want:?}; keys of another model, dtype, layout or TP rank must not mix"
                    ),
                });
            }
        }
        let groups = found.iter().map(|(sb, _)| sb.groups_on_device).collect();
        let layout = PoolLayout::new(geometry, first.group_blocks, groups);
        let devices: Vec<Box<dyn Storage>> = found.into_iter().map(|(_, d)| d).collect();
        let mut pool = Pool {
            index: Index::new(layout.total_slots()),
            devices,
            layout,
            uuid: first.pool_uuid,
            namespace_hash: namespace_hash(&namespace),
            namespace,
            model: first.model(),
            next_generation: 1,
            damaged_headers: Vec::new(),
        };
        pool.rebuild_index()?;
        Ok(pool)
    }

    /// Read every header and make each whole, newest block visible.
    fn rebuild_index(&mut self) -> Result<()> {
        let g = self.layout.group_blocks as u64;
        let mut max_gen = 0;
        for group in 0..self.layout.total_groups() {
            let (dev, off, len) = self.layout.group_headers(group);
            let mut buf = AlignedBuf::zeroed(len as usize);
            self.devices[dev as usize].read_exact_at(&mut buf, off)?;
            for i in 0..g {
                let slot = group as u64 * g + i;
                let at = (i * SLOT_HEADER_BYTES) as usize;
                let h: BlockHeader = bytemuck::pod_read_unaligned(
                    &buf.as_slice()[at..at + std::mem::size_of::<BlockHeader>()],
                );
                match self.classify(&h, slot) {
                    HeaderKind::Live(key) => {
                        max_gen = max_gen.max(h.generation);
                        self.index.load_header(key, slot, h.generation);
                    }
                    HeaderKind::Damaged => self.damaged_headers.push(slot),
                    HeaderKind::Empty => {}
                }
            }
        }
        self.index.order_lru_by_generation();
        self.next_generation = max_gen + 1;
        Ok(())
    }

    fn classify(&self, h: &BlockHeader, slot: u64) -> HeaderKind {
        if h.magic != BLOCK_HEADER_MAGIC || h.pool_uuid != self.uuid {
            return HeaderKind::Empty;
        }
        if !h.crc_ok()
            || h.slot != slot
            || h.state != BLOCK_STATE_LIVE
            || h.data_len != self.layout.geometry.block_bytes()
            || h.key_len == 0
            || h.key_len > 32
        {
            return HeaderKind::Damaged;
        }
        if h.namespace_hash != self.namespace_hash {
            return HeaderKind::Empty;
        }
        match Key::new(&h.key[..h.key_len as usize]) {
            Ok(k) => HeaderKind::Live(k),
            Err(_) => HeaderKind::Damaged,
        }
    }

    /// The header a committed store writes for `key` in `slot`.
    /// `data_crc` is `None` for data the host could not read (GPU memory).
    pub fn make_header(
        &self,
        key: &Key,
        slot: u64,
        generation: u64,
        data_crc: Option<u32>,
    ) -> BlockHeader {
        let mut h = BlockHeader::zeroed();
        h.magic = BLOCK_HEADER_MAGIC;
        h.version = FORMAT_VERSION as u16;
        h.pool_uuid = self.uuid;
        h.slot = slot;
        h.generation = generation;
        h.key[..key.as_bytes().len()].copy_from_slice(key.as_bytes());
        h.key_len = key.as_bytes().len() as u8;
        h.namespace_hash = self.namespace_hash;
        h.data_len = self.layout.geometry.block_bytes();
        h.data_crc = data_crc.unwrap_or(0);
        if data_crc.is_none() {
            h.flags |= BLOCK_FLAG_NO_DATA_CRC;
        }
        h.state = BLOCK_STATE_LIVE;
        h.seal();
        h
    }

    /// A fresh generation number for a store.
    pub fn next_generation(&mut self) -> u64 {
        let g = self.next_generation;
        self.next_generation += 1;
        g
    }

    pub fn geometry(&self) -> &KvGeometry {
        &self.layout.geometry
    }
    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }
    pub fn index(&self) -> &Index {
        &self.index
    }
    pub fn index_mut(&mut self) -> &mut Index {
        &mut self.index
    }
    pub fn devices(&self) -> &[Box<dyn Storage>] {
        &self.devices
    }

    /// The file descriptors of the pool's devices for the io_uring engine,
    /// or an error naming a device only another engine can drive.
    pub fn device_fds(&self) -> Result<Vec<(RawFd, String)>> {
        self.devices
            .iter()
            .map(|d| {
                let name = d.path().display().to_string();
                d.raw_fd().map(|fd| (fd, name.clone())).ok_or_else(|| {
                    Error::invalid(format!(
                        "{name} is not a file or block device; serve this pool with the nvme engine"
                    ))
                })
            })
            .collect()
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn damaged_headers(&self) -> &[u64] {
        &self.damaged_headers
    }

    pub fn info(&self) -> PoolInfo {
        let g = &self.layout.geometry;
        PoolInfo {
            uuid: hex(&self.uuid),
            model: self.model.clone(),
            namespace: self.namespace.clone(),
            geometry: *g,
            object_bytes: g.object_bytes(),
            block_bytes: g.block_bytes(),
            group_blocks: self.layout.group_blocks,
            group_bytes: self.layout.group_bytes(),
            devices: self
                .devices
                .iter()
                .zip(&self.layout.groups_per_device)
                .map(|(d, &n)| DeviceInfo {
                    path: d.path().to_path_buf(),
                    size: d.size(),
                    groups: n,
                })
                .collect(),
            total_slots: self.index.total_slots(),
            live_blocks: self.index.live(),
            free_slots: self.index.free_slots(),
            pinned_blocks: self.index.pinned(),
            capacity_bytes: self.index.total_slots() * g.block_bytes(),
            used_bytes: self.index.live() * g.block_bytes(),
            damaged_headers: self.damaged_headers.len() as u64,
        }
    }

    /// Verify every live block's data against its header checksum, group by
    /// group (one read per layer run), and report damaged headers found at
    /// open. `progress` is called with (groups done, groups total).
    pub fn check(&self, mut progress: impl FnMut(u32, u32)) -> Result<CheckReport> {
        let mut report = CheckReport {
            damaged_headers: self.damaged_headers.clone(),
            ..Default::default()
        };
        let g = self.layout.group_blocks as u64;
        let geo = self.layout.geometry;
        let obj = geo.object_bytes() as usize;
        let total = self.layout.total_groups();
        let mut live_by_group: Vec<Vec<(u64, Key, u64)>> = vec![Vec::new(); total as usize];
        for (k, e) in self.index.entries() {
            live_by_group[(e.slot / g) as usize].push((e.slot, *k, e.generation));
        }
        for (group, live) in live_by_group.iter().enumerate() {
            progress(group as u32, total);
            if live.is_empty() {
                continue;
            }
            // Headers again: their crc was checked at open; re-read to get data_crc.
            let (dev, hoff, hlen) = self.layout.group_headers(group as u32);
            let mut hbuf = AlignedBuf::zeroed(hlen as usize);
            self.devices[dev as usize].read_exact_at(&mut hbuf, hoff)?;
            let mut crcs = vec![0u32; g as usize];
            let mut run = AlignedBuf::zeroed(g as usize * obj);
            for layer in 0..geo.layers {
                for kv in 0..2 {
                    let (dev, off) = self.layout.object_offset(group as u64 * g, layer, kv);
                    self.devices[dev as usize].read_exact_at(&mut run, off)?;
                    report.bytes_read += run.len() as u64;
                    for &(slot, _, _) in live {
                        let i = (slot % g) as usize;
                        crcs[i] =
                            crc32c::crc32c_append(crcs[i], &run.as_slice()[i * obj..(i + 1) * obj]);
                    }
                }
            }
            for &(slot, key, _) in live {
                report.blocks_checked += 1;
                let i = (slot % g) as usize;
                let at = i * SLOT_HEADER_BYTES as usize;
                let h: BlockHeader = bytemuck::pod_read_unaligned(
                    &hbuf.as_slice()[at..at + std::mem::size_of::<BlockHeader>()],
                );
                if h.crc_ok() && h.flags & BLOCK_FLAG_NO_DATA_CRC != 0 {
                    report.blocks_unverifiable += 1;
                } else if h.crc_ok() && h.data_crc == crcs[i] {
                    report.blocks_ok += 1;
                } else {
                    report.bad_data.push((slot, key.to_string()));
                }
            }
        }
        progress(total, total);
        Ok(report)
    }

    pub fn paths(&self) -> Vec<PathBuf> {
        self.devices
            .iter()
            .map(|d| d.path().to_path_buf())
            .collect()
    }
}

enum HeaderKind {
    Empty,
    Damaged,
    Live(Key),
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn check_superblock(sb: &Superblock, path: &Path) -> Result<()> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_path_buf(),
        what: "superblock".into(),
        reason,
    };
    if sb.magic != POOL_MAGIC {
        return Err(Error::Backing {
            path: path.to_path_buf(),
            reason: "is not a kvtier pool (no superblock); create one with `kvtier pool create`"
                .into(),
        });
    }
    if !sb.crc_ok() {
        return Err(corrupt(
            "checksum mismatch; the device was overwritten or damaged. Recreate the pool with `kvtier pool create --force`".into(),
        ));
    }
    if sb.version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "format version {} is not supported by this kvtier (version {FORMAT_VERSION})",
            sb.version
        )));
    }
    if sb.data_offset != DATA_OFFSET
        || sb.slot_header_bytes as u64 != SLOT_HEADER_BYTES
        || sb.group_blocks == 0
    {
        return Err(corrupt("inconsistent layout fields".into()));
    }
    Ok(())
}
