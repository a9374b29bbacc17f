//! The pool: GPU files (blocks) on one or more SSDs, found by key.
//!
//! `create` formats devices (superblock per device); `open` reads every
//! superblock, checks they form one pool with the expected geometry, and
//! rebuilds the index from the block headers. The pool does no data I/O of
//! its own besides that and `check`: stores and loads go through the tier and
//! an engine, and the pool only hands out slots and makes keys visible.

internal_room! {
    backing;
    index;
    layout;
    place;
    storage;
}
pub use place::CreateMode;

use crate::checksum::CrcConcat;
use crate::error::{Error, Fix, Result};
use crate::host::dio::AlignedBuf;
use crate::host::signature::POOL_MAGIC;
use crate::model::{DType, KvGeometry};
pub use backing::Access;
use backing::{BackingDevice, BackingKind};
use bytemuck::Zeroable;
use index::{Index, SharedIndex};
use layout::*;
use std::fmt;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
#[cfg(feature = "internals")]
pub use storage::Storage;
#[cfg(not(feature = "internals"))]
pub(crate) use storage::Storage;

/// Live headers carry generations below this. Generations count stores
/// from 1; a forged header claiming more (up to u64::MAX) would make every
/// later store's generation wrap and lose "newest generation wins", so it is
/// damaged instead.
pub const MAX_GENERATION: u64 = 1 << 62;

/// A block's identity: its content hash (up to 32 bytes: vLLM BlockHash,
/// LMCache chunk hash) within the pool's namespace.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    bytes: [u8; 32],
    len: u8,
}

impl Key {
    /// A key of 1 to 32 bytes of content hash.
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

    /// The key's bytes.
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

/// The namespace's stable 64-bit id in block headers (FNV-1a).
pub(crate) fn namespace_hash(ns: &str) -> u64 {
    crate::checksum::fnv1a64(ns.as_bytes())
}

/// One backing device to format: a path and, for files, its size.
#[derive(Clone, Debug)]
pub struct DeviceSpec {
    /// The file or block device.
    pub path: PathBuf,
    /// Bytes; required for files, optional for block devices (whole device).
    pub size: Option<u64>,
}

/// What [`Pool::create`] formats: build it with [`PoolConfig::new`] and the
/// `with_*` setters.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// The KV geometry of every block.
    pub geometry: KvGeometry,
    /// Model name recorded for `pool info` (free text).
    pub model: String,
    /// Namespace of the keys: model, dtype, layout, TP rank. A pool serves
    /// one namespace; opening it for another is an error.
    pub namespace: String,
    /// Blocks per extent group (G).
    pub group_blocks: u32,
    /// The files or block devices to format (empty for `Pool::create_on`).
    pub devices: Vec<DeviceSpec>,
    /// Overwrite devices that hold a filesystem or other data.
    pub force: bool,
    /// Write every data byte of the pool's regular files once while
    /// formatting. A filesystem hands out preallocated space as unwritten
    /// extents, and the first write into one converts it in the journal at
    /// completion: on ext4 a first store ran at ~0.6x the bandwidth of an
    /// overwrite (fio, same file system). Prewriting pays that once, at
    /// creation (a pool's size at the disk's write bandwidth), so stores run
    /// at overwrite speed from the start. Block devices have no unwritten
    /// extents and are never prewritten.
    pub prewrite: bool,
}

impl PoolConfig {
    /// A pool of `geometry` for `model` serving keys of `namespace`, with
    /// [`DEFAULT_GROUP_BLOCKS`], no devices yet and no `force`.
    pub fn new(
        geometry: KvGeometry,
        model: impl Into<String>,
        namespace: impl Into<String>,
    ) -> PoolConfig {
        PoolConfig {
            geometry,
            model: model.into(),
            namespace: namespace.into(),
            group_blocks: DEFAULT_GROUP_BLOCKS,
            devices: Vec::new(),
            force: false,
            prewrite: false,
        }
    }
}

with_setters!(PoolConfig {
    /// With `group_blocks` blocks per extent group.
    with_group_blocks => group_blocks: u32,
    /// With these devices.
    with_devices => devices: Vec<DeviceSpec>,
    /// Overwriting (or not) devices that hold other data.
    with_force => force: bool,
    /// Writing (or not) every data byte of regular pool files at creation.
    with_prewrite => prewrite: bool,
});

/// Blocks per extent group unless the caller says otherwise.
pub const DEFAULT_GROUP_BLOCKS: u32 = 64;

/// What the caller expects of a pool it opens.
#[derive(Clone, Debug, Default)]
pub struct OpenExpect {
    /// The geometry the pool must have (`None`: any).
    pub geometry: Option<KvGeometry>,
    /// The namespace the pool must serve (`None`: any).
    pub namespace: Option<String>,
}

/// A pool: key → slot on the devices, the devices' superblocks, block headers and data.
pub struct Pool {
    devices: Vec<Box<dyn Storage>>,
    /// Bytes of each device the pool uses (its superblock's `device_size`).
    device_sizes: Vec<u64>,
    /// Opened to write (create, serve, repair), not only to inspect.
    writable: bool,
    layout: PoolLayout,
    crcs: SlotCrcs,
    /// Joins a layer's V object checksum to its K object's (a layer's crc).
    kv_concat: CrcConcat,
    /// Appends one layer's checksum to a block's running checksum.
    layer_concat: CrcConcat,
    /// Slots whose header sector could not be read at open: their blocks are lost.
    unreadable_headers: Vec<u64>,
    /// Devices whose bad-slot table was damaged or unreadable at open, and
    /// why (`check` reports them; `repair` writes them anew).
    damaged_bad_tables: Vec<(usize, String)>,
    uuid: [u8; 16],
    namespace: String,
    namespace_hash: u64,
    model: String,
    index: SharedIndex,
    next_generation: u64,
    /// Headers that are neither all zeroes nor a valid header of this pool.
    damaged_headers: Vec<u64>,
    /// Per device (in pool order): the superblock in use, and where a copy
    /// of it is damaged (offset, what is wrong), found at open.
    superblocks: Vec<DeviceSuperblock>,
}

/// One device's superblock as read at open: the copy in use and the copies
/// that differ from it.
#[derive(Clone)]
struct DeviceSuperblock {
    sb: Superblock,
    damaged: Vec<(u64, String)>,
}

/// One device of a pool, for `pool info`.
#[non_exhaustive]
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    /// The device's path or name.
    #[serde(serialize_with = "crate::json::path_lossy")]
    pub path: PathBuf,
    /// Bytes of the device the pool uses.
    pub size: u64,
    /// Bytes of the file or block device (at least `size`).
    pub backing_size: u64,
    /// Extent groups on it.
    pub groups: u32,
    /// Bytes of a pool file allocated but never written (fallocate's
    /// unwritten extents, which a first store converts at ~0.6x of overwrite
    /// speed on ext4; `PoolConfig::prewrite` leaves none). None where the
    /// file system cannot say, and for block devices and namespaces.
    pub unwritten_bytes: Option<u64>,
}

/// What `pool info` shows.
#[non_exhaustive]
#[derive(Clone, Debug, serde::Serialize)]
pub struct PoolInfo {
    /// The pool's id, hex.
    pub uuid: String,
    /// Model name recorded at create.
    pub model: String,
    /// Namespace of its keys.
    pub namespace: String,
    /// KV geometry.
    pub geometry: KvGeometry,
    /// Bytes of one object (one layer's K or V of a block).
    pub object_bytes: u64,
    /// Bytes of one block (2L objects).
    pub block_bytes: u64,
    /// Blocks per extent group.
    pub group_blocks: u32,
    /// Bytes of one extent group.
    pub group_bytes: u64,
    /// Its devices.
    pub devices: Vec<DeviceInfo>,
    /// Slots in all.
    pub total_slots: u64,
    /// Slots holding a stored block.
    pub live_blocks: u64,
    /// Slots free.
    pub free_slots: u64,
    /// Blocks pinned.
    pub pinned_blocks: u64,
    /// Bytes the pool can hold.
    pub capacity_bytes: u64,
    /// Bytes of stored blocks.
    pub used_bytes: u64,
    /// Headers that are neither all zeroes nor a valid header of this pool.
    pub damaged_headers: u64,
    /// Superblock copies (primary or backup) that are damaged or missing.
    pub damaged_superblocks: u64,
    /// Slots whose header sector could not be read at open.
    pub unreadable_headers: u64,
    /// Slots retired because their sectors failed a write.
    pub bad_slots: u64,
}

/// What `check` found.
#[non_exhaustive]
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CheckReport {
    /// Live blocks read.
    pub blocks_checked: u64,
    /// Blocks whose data matched.
    pub blocks_ok: u64,
    /// Blocks stored from memory the host could not read (GPU memory), which
    /// carry no data checksum: nobody can say whether their bytes are right.
    pub blocks_unverifiable: u64,
    /// Slots whose header is neither all zeroes nor a valid header of this pool.
    pub damaged_headers: Vec<u64>,
    /// Superblock copies that are damaged, unreadable or differ from the one
    /// in use: "DEVICE at OFFSET: why" (the pool opened from a sound copy).
    pub damaged_superblocks: Vec<String>,
    /// Slots whose header sector could not be read (their blocks are lost).
    pub unreadable_headers: Vec<u64>,
    /// Bad-slot tables that are damaged or unreadable: "DEVICE at OFFSET:
    /// why". The slots they listed are retired again as their writes fail;
    /// `repair` writes the tables anew.
    pub damaged_bad_tables: Vec<String>,
    /// (slot, key) of live blocks whose data does not match the header's checksum.
    pub bad_data: Vec<(u64, String)>,
    /// (slot, key) of live blocks whose data could not be read.
    pub unreadable_data: Vec<(u64, String)>,
    /// Slots retired because their sectors failed a write (capacity lost, no data).
    pub bad_slots: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

impl CheckReport {
    /// Nothing damaged and every block verified.
    pub fn is_clean(&self) -> bool {
        self.is_undamaged() && self.blocks_unverifiable == 0
    }
    /// Nothing found damaged (unverifiable blocks may remain).
    pub fn is_undamaged(&self) -> bool {
        self.damaged_headers.is_empty()
            && self.damaged_superblocks.is_empty()
            && self.unreadable_headers.is_empty()
            && self.damaged_bad_tables.is_empty()
            && self.bad_data.is_empty()
            && self.unreadable_data.is_empty()
    }
    /// Live blocks a repair drops.
    pub fn damaged_keys(&self) -> usize {
        self.bad_data.len() + self.unreadable_data.len()
    }
}

/// What a load can verify each slot's data against, kept in memory so that a
/// load costs no extra header reads.
struct SlotCrcs {
    /// Layers per slot in `per_layer`; 0 when the model is too deep to keep them.
    layers: u32,
    per_layer: Vec<u32>,
    whole: Vec<u32>,
    kind: Vec<CrcKind>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CrcKind {
    /// Stored from memory the host could not read: nothing to verify against.
    None,
    Whole,
    Layers,
}

impl SlotCrcs {
    fn new(slots: u64, layers: u32) -> SlotCrcs {
        let layers = if layers <= MAX_LAYER_CRCS { layers } else { 0 };
        SlotCrcs {
            layers,
            per_layer: vec![0; (slots * layers as u64) as usize],
            whole: vec![0; slots as usize],
            kind: vec![CrcKind::None; slots as usize],
        }
    }
    fn set(&mut self, slot: u64, whole: Option<u32>, layers: Option<&[u32]>) {
        let s = slot as usize;
        self.kind[s] = match (whole, layers) {
            (None, _) => CrcKind::None,
            (Some(_), Some(l)) if self.layers > 0 && l.len() == self.layers as usize => {
                let n = self.layers as usize;
                self.per_layer[s * n..(s + 1) * n].copy_from_slice(l);
                CrcKind::Layers
            }
            (Some(_), _) => CrcKind::Whole,
        };
        self.whole[s] = whole.unwrap_or(0);
    }
}

/// crc32c of a whole block from its per-layer checksums (each over the layer's
/// K then V object; `concat` built for that length): the block's (layer,
/// K|V) order.
pub(crate) fn combine_layer_crcs(layer_crcs: &[u32], concat: &CrcConcat) -> u32 {
    let mut it = layer_crcs.iter();
    let Some(&first) = it.next() else {
        return 0;
    };
    it.fold(first, |acc, &c| concat.apply(acc, c))
}

/// Builds a pool's block header sectors (see [`Pool::header_writer`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeaderSectorWriter {
    uuid: [u8; 16],
    namespace_hash: u64,
    block_bytes: u64,
    layer_concat: CrcConcat,
}

impl HeaderSectorWriter {
    /// The header a committed store writes for `key` in `slot`.
    fn header(&self, key: &Key, slot: u64, generation: u64, data_crc: Option<u32>) -> BlockHeader {
        let mut h = BlockHeader::zeroed();
        h.magic = BLOCK_HEADER_MAGIC;
        h.version = BLOCK_HEADER_VERSION;
        h.pool_uuid = self.uuid;
        h.slot = slot;
        h.generation = generation;
        h.key[..key.as_bytes().len()].copy_from_slice(key.as_bytes());
        h.key_len = key.as_bytes().len() as u8;
        h.namespace_hash = self.namespace_hash;
        h.data_len = self.block_bytes;
        h.data_crc = data_crc.unwrap_or(0);
        if data_crc.is_none() {
            h.flags |= BLOCK_FLAG_NO_DATA_CRC;
        }
        h.state = BLOCK_STATE_LIVE;
        h.seal();
        h
    }

    /// Write the header sector of `key` in `slot` into `sector` (4 KiB);
    /// returns the whole block's checksum it records (None without
    /// `layer_crcs`).
    pub(crate) fn write(
        &self,
        sector: &mut [u8],
        key: &Key,
        slot: u64,
        generation: u64,
        layer_crcs: Option<&[u32]>,
    ) -> Option<u32> {
        let data_crc = layer_crcs.map(|l| combine_layer_crcs(l, &self.layer_concat));
        let mut h = self.header(key, slot, generation, data_crc);
        sector.fill(0);
        if let Some(l) = layer_crcs.filter(|l| l.len() as u32 <= MAX_LAYER_CRCS) {
            let table = &mut sector[LAYER_CRCS_OFFSET..LAYER_CRCS_OFFSET + 4 * l.len()];
            for (c, v) in table.chunks_mut(4).zip(l) {
                c.copy_from_slice(&v.to_le_bytes());
            }
            h.flags |= BLOCK_FLAG_LAYER_CRCS;
            h.layer_crcs_crc = crc32c::crc32c(table);
            h.seal();
        }
        sector[..std::mem::size_of::<BlockHeader>()].copy_from_slice(bytemuck::bytes_of(&h));
        data_crc
    }
}

/// The range of slots one device of a pool holds, for its bad table.
fn device_slots(layout: &PoolLayout, dev: usize) -> impl Iterator<Item = u64> + '_ {
    (0..layout.total_groups())
        .filter(move |&g| layout.group_place(g).dev as usize == dev)
        .flat_map(move |g| {
            let n = layout.group_blocks as u64;
            g as u64 * n..(g as u64 + 1) * n
        })
}

fn random_uuid() -> Result<[u8; 16]> {
    let mut u = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut u))
        .map_err(|e| Error::io("reading /dev/urandom for the pool id", e))?;
    Ok(u)
}

/// Write zeros over each (device, offset, length) in large direct writes,
/// then make them durable (the extent conversions they cost land in the
/// file system's journal now, not in a later store's flush).
fn prewrite_spans(
    devices: &[Box<dyn Storage>],
    spans: &[(usize, u64, u64)],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<()> {
    const CHUNK: u64 = 8 << 20;
    let total: u64 = spans.iter().map(|s| s.2).sum();
    if total == 0 {
        return Ok(());
    }
    let zeros = AlignedBuf::zeroed(CHUNK as usize);
    let mut done = 0u64;
    progress(0, total);
    for &(i, offset, len) in spans {
        let dev = &devices[i];
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(CHUNK);
            if n == CHUNK {
                dev.write_all_at(&zeros, offset + at)?;
            } else {
                dev.write_all_at(&AlignedBuf::zeroed(n as usize), offset + at)?;
            }
            at += n;
            done += n;
            progress(done, total);
        }
        dev.sync_data()?;
    }
    Ok(())
}

/// The pool files a failing [`Pool::create`] made, removed when it returns
/// the error (disarmed by emptying it).
struct RemoveMadeOnError(Vec<PathBuf>);

impl Drop for RemoveMadeOnError {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// What to do about a pool device shorter than its superblock says.
fn truncated_fix(path: &Path, size: u64) -> String {
    let grow = if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_file()) {
        format!("`truncate -s {size} {}`", path.display())
    } else {
        format!("to {size} bytes")
    };
    format!(
        " (the blocks past its end are lost): restore it, or grow it back {grow} to open \
         what is left (blocks it lost fail their checks, never load)"
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Pool {
    /// Format a new pool over the given devices (files or block devices).
    pub fn create(cfg: &PoolConfig) -> Result<Pool> {
        Self::create_with_progress(cfg, &mut |_, _| {})
    }

    /// [`Pool::create`], telling `progress(done, total)` how many bytes of a
    /// [`PoolConfig::prewrite`] are written (called only when there is one).
    pub fn create_with_progress(
        cfg: &PoolConfig,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Pool> {
        Self::check_config(cfg, cfg.devices.len())?;
        let paths: Vec<PathBuf> = cfg.devices.iter().map(|d| d.path.clone()).collect();
        check_named_once(&paths)?;
        let min_size = PoolLayout::min_device_bytes(&cfg.geometry, cfg.group_blocks);
        // Pools whose create was killed between its superblock writes: some
        // named device still carries that create's mark. Their superblocks
        // need no force to be formatted over (such a pool never served).
        let unfinished: Vec<[u8; 16]> = cfg
            .devices
            .iter()
            .filter_map(|d| crate::host::signature::unfinished_pool_id(&place::head_of(&d.path)?))
            .collect();
        // Files this call creates are removed if it fails after making
        // them (a later device refused, the file system full while
        // formatting or prewriting): a failed create leaves no half-made
        // pool file taking the space, and never touches one it did not make.
        let mut made = RemoveMadeOnError(Vec::new());
        let mut devices: Vec<Box<dyn Storage>> = Vec::new();
        let mut prewrite = Vec::new();
        for d in &cfg.devices {
            let dev = BackingDevice::create_for(&d.path, d.size, min_size, cfg.force, &unfinished)?;
            if dev.created() {
                made.0.push(d.path.clone());
            }
            prewrite.push(cfg.prewrite && dev.kind() == BackingKind::File);
            devices.push(Box::new(dev));
        }
        if !cfg.force && !unfinished.is_empty() {
            Self::recheck_unfinished(&devices)?;
        }
        let pool = Self::format(cfg, devices, &prewrite, progress)?;
        made.0.clear();
        Ok(pool)
    }

    internal_pub! {
        /// Format a new pool in regular files the caller created new and still
        /// holds open (scratch files, `(file, path)`, each made `size` bytes):
        /// created, formatted and served through these descriptors, never
        /// reopened by path, so a name swapped for a symbolic link meanwhile
        /// cannot redirect the superblocks into another file. `cfg.devices` is
        /// not used; `cfg.prewrite` is.
        fn create_in_files(
            cfg: &PoolConfig,
            files: Vec<(std::fs::File, PathBuf)>,
            size: u64,
            progress: &mut dyn FnMut(u64, u64),
        ) -> Result<Pool> {
            Self::check_config(cfg, files.len())?;
            let min_size = PoolLayout::min_device_bytes(&cfg.geometry, cfg.group_blocks);
            let mut devices: Vec<Box<dyn Storage>> = Vec::new();
            for (file, path) in files {
                devices.push(Box::new(BackingDevice::create_in_file(
                    file, &path, size, min_size,
                )?));
            }
            let prewrite = vec![cfg.prewrite; devices.len()];
            Self::format(cfg, devices, &prewrite, progress)
        }
    }

    internal_pub! {
        /// Open a pool in regular files through descriptors the caller holds
        /// (see [`Pool::create_in_files`]), exclusively, never by path.
        fn open_in_files(
            files: Vec<(std::fs::File, PathBuf)>,
            expect: &OpenExpect,
        ) -> Result<Pool> {
            let mut devices: Vec<Box<dyn Storage>> = Vec::new();
            for (file, path) in files {
                devices.push(Box::new(BackingDevice::open_file(
                    file,
                    &path,
                    Access::Exclusive,
                )?));
            }
            Self::open_on(devices, expect)
        }
    }

    /// The marks that let a superblock be formatted over without force were
    /// read before the devices were locked: another create may have finished
    /// its pool since. Now that every device is held, a pool superblock is
    /// formatted over only if one of the devices still carries its create's
    /// mark; otherwise it is refused as any pool is.
    fn recheck_unfinished(devices: &[Box<dyn Storage>]) -> Result<()> {
        use crate::host::signature::{probe_signature, unfinished_pool_id, Signature};
        let mut heads = Vec::new();
        for d in devices {
            let mut head = AlignedBuf::zeroed(4096);
            d.read_exact_at(&mut head, 0)?;
            heads.push(head);
        }
        let marks: Vec<[u8; 16]> = heads
            .iter()
            .filter_map(|h| unfinished_pool_id(h.as_slice()))
            .collect();
        for (d, h) in devices.iter().zip(&heads) {
            if probe_signature(h.as_slice()) != Signature::KvtierPool {
                continue;
            }
            let n = std::mem::size_of::<Superblock>();
            let sb: Superblock = bytemuck::pod_read_unaligned(&h.as_slice()[..n]);
            if !marks.contains(&sb.pool_uuid) {
                return backing::check_signature(d.path(), &Signature::KvtierPool, false);
            }
        }
        Ok(())
    }

    internal_pub! {
        /// Format a new pool over storage the caller opened (an NVMe namespace
        /// driven from userspace); `cfg.devices` is not used.
        /// Like [`Pool::create`], it refuses storage that holds a filesystem,
        /// a partition table or data that is not a kvtier pool, unless
        /// `cfg.force`.
        fn create_on(cfg: &PoolConfig, devices: Vec<Box<dyn Storage>>) -> Result<Pool> {
            Self::check_config(cfg, devices.len())?;
            let min_size = PoolLayout::min_device_bytes(&cfg.geometry, cfg.group_blocks);
            for d in &devices {
                let probe = (crate::host::signature::SIGNATURE_PROBE_BYTES as u64).min(d.size())
                    as usize
                    & !4095;
                if probe > 0 {
                    let mut head = AlignedBuf::zeroed(probe);
                    d.read_exact_at(&mut head, 0)?;
                    let sig = crate::host::signature::probe_signature(head.as_slice());
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
            let none = vec![false; devices.len()];
            Self::format(cfg, devices, &none, &mut |_, _| {})
        }
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
        // It is printed by `pool info` and in errors, and compared at open.
        if let Some((at, c)) = cfg.namespace.char_indices().find(|(_, c)| c.is_control()) {
            return Err(Error::invalid(format!(
                "namespace {:?} has a control character ({}) at byte {at}; use printable text",
                cfg.namespace,
                c.escape_unicode()
            )));
        }
        Ok(())
    }

    /// Write superblocks and empty header areas on `devices`.
    ///
    /// A device may hold an older pool (reformatting needs `force`). Its
    /// superblock goes first, durably, on every device, replaced by the
    /// unfinished mark ([`crate::host::signature::UNFINISHED_MAGIC`]): a
    /// crash after that leaves no pool at all rather than the old superblock
    /// and headers over a half-written new layout (whose header zeroing
    /// lands on the old pool's data, so old keys would read back zeros as if
    /// stored), and the mark lets the same create run again without force.
    ///
    /// `prewrite[i]`: write zeros over all of device i past the mark (after
    /// its old superblock is gone, so a crash part way leaves no pool, never
    /// an old pool whose data was zeroed under its headers).
    fn format(
        cfg: &PoolConfig,
        devices: Vec<Box<dyn Storage>>,
        prewrite: &[bool],
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Pool> {
        let g = cfg.geometry;
        // Not zeros: a device left so by a kill says what happened, and the
        // same create runs again on it without --force.
        // With the new pool's id: a device whose superblock landed before a
        // kill is known, by that id, to belong to this unfinished create.
        let uuid = random_uuid()?;
        let mut unfinished = AlignedBuf::zeroed(4096);
        unfinished.as_mut_slice()[..8].copy_from_slice(&crate::host::signature::UNFINISHED_MAGIC);
        unfinished.as_mut_slice()[8..24].copy_from_slice(&uuid);
        // Every copy: an old pool's backup must not outlive its primary.
        for dev in &devices {
            for &off in &SUPERBLOCK_OFFSETS {
                dev.write_all_at(&unfinished, off)?;
            }
        }
        for dev in &devices {
            dev.sync_data()?;
        }
        let groups: Vec<u32> = devices
            .iter()
            .map(|d| PoolLayout::groups_fitting(&g, cfg.group_blocks, d.size()))
            .collect();
        let layout = PoolLayout::new(g, cfg.group_blocks, groups.clone());
        let spans: Vec<(usize, u64, u64)> = (0..devices.len())
            .filter(|&i| prewrite.get(i).copied().unwrap_or(false))
            // Past the first 4 KiB, just written: the unfinished mark stays.
            .map(|i| (i, 4096, devices[i].size() - 4096))
            .collect();
        prewrite_spans(&devices, &spans, progress)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let model = truncate(&cfg.model, MODEL_NAME_MAX);
        let mut superblocks = Vec::new();
        for (i, dev) in devices.iter().enumerate() {
            // Zero every group's header area first: a device reused from an
            // earlier pool carries old headers, and a header the new pool
            // did not write must never be mistaken for one it did (the uuid
            // check would already refuse them; zeroing makes `check` quiet).
            let zero_headers =
                AlignedBuf::zeroed((cfg.group_blocks as u64 * SLOT_HEADER_BYTES) as usize);
            // The bad-slot table of an earlier pool describes another layout.
            dev.write_all_at(&AlignedBuf::zeroed(BAD_TABLE_BYTES), BAD_TABLE_OFFSET)?;
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
            sb.copies = SUPERBLOCK_OFFSETS.len() as u32;
            sb.seal();
            // The backups, durably with the zeroed headers, then the primary:
            // the primary commits the device (while it is still the mark,
            // the device is an unfinished create whatever the backups say).
            let buf = superblock_sector(&sb);
            for &off in sb.backup_offsets() {
                dev.write_all_at(&buf, off)?;
            }
            dev.sync_data()?;
            dev.write_all_at(&buf, 0)?;
            dev.sync_data()?;
            superblocks.push(DeviceSuperblock {
                sb,
                damaged: Vec::new(),
            });
        }
        Ok(Pool {
            index: SharedIndex::new(Index::new(layout.total_slots())),
            crcs: SlotCrcs::new(layout.total_slots(), g.layers),
            kv_concat: CrcConcat::new(g.object_bytes()),
            layer_concat: CrcConcat::new(2 * g.object_bytes()),
            device_sizes: devices.iter().map(|d| d.size()).collect(),
            writable: true,
            devices,
            layout,
            uuid,
            namespace_hash: namespace_hash(&cfg.namespace),
            namespace: cfg.namespace.clone(),
            model,
            next_generation: 1,
            damaged_headers: Vec::new(),
            unreadable_headers: Vec::new(),
            damaged_bad_tables: Vec::new(),
            superblocks,
        })
    }

    /// Open an existing pool to serve it: all of its devices, in any order,
    /// held exclusively until the pool is dropped.
    pub fn open(paths: &[PathBuf], expect: &OpenExpect) -> Result<Pool> {
        Self::open_with(paths, expect, Access::Exclusive)
    }

    /// Open a pool to inspect it (`info`, `check`): read-only, beside other
    /// readers, refused while a process writes it.
    pub fn open_read_only(paths: &[PathBuf], expect: &OpenExpect) -> Result<Pool> {
        Self::open_with(paths, expect, Access::Shared)
    }

    fn open_with(paths: &[PathBuf], expect: &OpenExpect, access: Access) -> Result<Pool> {
        if paths.is_empty() {
            return Err(Error::invalid("name the pool's backing devices to open it"));
        }
        check_named_once(paths)?;
        // Lock the devices in one order whatever order they are named in
        // (the superblocks say which is which): two writers naming them in
        // opposite orders could each take one and both be refused.
        let mut order: Vec<&PathBuf> = paths.iter().collect();
        order.sort_by_key(|p| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok()
        });
        let mut devices: Vec<Box<dyn Storage>> = Vec::new();
        for p in order {
            devices.push(Box::new(BackingDevice::open_with(p, access)?));
        }
        let mut pool = Self::open_on(devices, expect)?;
        pool.writable = access == Access::Exclusive;
        Ok(pool)
    }

    internal_pub! {
        /// Open an existing pool on storage the caller opened, in any order.
        fn open_on(devices: Vec<Box<dyn Storage>>, expect: &OpenExpect) -> Result<Pool> {
            if devices.is_empty() {
                return Err(Error::invalid("name the pool's backing devices to open it"));
            }
            let path0 = devices[0].path().to_path_buf();
            let mut found: Vec<(Superblock, Box<dyn Storage>)> = Vec::new();
            let mut damaged_copies: Vec<Vec<(u64, String)>> = Vec::new();
            for dev in devices {
                let (sb, damaged) = read_superblock(dev.as_ref())?;
                damaged_copies.push(damaged);
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
            for (sb, dev) in &found {
                check_same_pool(sb, &first, dev.path())?;
            }
            let mut order: Vec<usize> = (0..found.len()).collect();
            order.sort_by_key(|&i| found[i].0.device_index);
            let superblocks: Vec<DeviceSuperblock> = order
                .iter()
                .map(|&i| DeviceSuperblock {
                    sb: found[i].0,
                    damaged: std::mem::take(&mut damaged_copies[i]),
                })
                .collect();
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
                            "is {} bytes but the pool was formatted with {}; it was truncated{}",
                            dev.size(),
                            sb.device_size,
                            truncated_fix(dev.path(), sb.device_size)
                        ),
                    }
                    .with_fix(Fix::Recreate));
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
            let groups: Vec<u32> = found.iter().map(|(sb, _)| sb.groups_on_device).collect();
            let sum = groups.iter().map(|&n| n as u64).sum::<u64>();
            if sum != first.total_groups as u64 {
                return Err(Error::Corrupt {
                    path: path0,
                    what: "superblock".into(),
                    reason: format!(
                        "field total_groups is {} but the devices' groups_on_device add up to {sum}",
                        first.total_groups
                    ),
                }
                .with_fix(Fix::Recreate));
            }
            let layout = PoolLayout::new(geometry, first.group_blocks, groups);
            let device_sizes = found.iter().map(|(sb, _)| sb.device_size).collect();
            let devices: Vec<Box<dyn Storage>> = found.into_iter().map(|(_, d)| d).collect();
            let mut pool = Pool {
                index: SharedIndex::new(Index::new(layout.total_slots())),
                crcs: SlotCrcs::new(layout.total_slots(), geometry.layers),
                kv_concat: CrcConcat::new(geometry.object_bytes()),
                layer_concat: CrcConcat::new(2 * geometry.object_bytes()),
                device_sizes,
                writable: true,
                unreadable_headers: Vec::new(),
                damaged_bad_tables: Vec::new(),
                devices,
                layout,
                uuid: first.pool_uuid,
                namespace_hash: namespace_hash(&namespace),
                namespace,
                model: first.model(),
                next_generation: 1,
                damaged_headers: Vec::new(),
                superblocks,
            };
            pool.rebuild_index()?;
            Ok(pool)
        }
    }

    /// Read every header and make each whole, newest block visible. A group
    /// whose headers cannot be read in one I/O is read sector by sector; the
    /// slots of unreadable sectors are lost (reported, never handed out) and
    /// the rest of the pool opens.
    fn rebuild_index(&mut self) -> Result<()> {
        self.load_bad_tables();
        let g = self.layout.group_blocks as u64;
        let mut max_gen = 0;
        for group in 0..self.layout.total_groups() {
            let sectors = self.read_group_headers(group);
            for (i, sector) in sectors.iter().enumerate() {
                let slot = group as u64 * g + i as u64;
                if self.index.lock().is_bad(slot) {
                    continue;
                }
                let Some(sector) = sector else {
                    self.unreadable_headers.push(slot);
                    self.index.lock().retire(slot);
                    continue;
                };
                let h: BlockHeader =
                    bytemuck::pod_read_unaligned(&sector[..std::mem::size_of::<BlockHeader>()]);
                match self.classify(&h, slot, sector) {
                    HeaderKind::Live(key, layer_crcs) => {
                        max_gen = max_gen.max(h.generation);
                        let whole = (h.flags & BLOCK_FLAG_NO_DATA_CRC == 0).then_some(h.data_crc);
                        self.crcs.set(slot, whole, layer_crcs.as_deref());
                        self.index.lock().load_header(key, slot, h.generation);
                    }
                    HeaderKind::Damaged => self.damaged_headers.push(slot),
                    HeaderKind::Empty => {}
                }
            }
        }
        self.index.lock().order_lru_by_generation();
        self.next_generation = max_gen + 1;
        Ok(())
    }

    /// A group's header sectors; `None` for each sector that cannot be read.
    fn read_group_headers(&self, group: u32) -> Vec<Option<Vec<u8>>> {
        let (dev, off, len) = self.layout.group_headers(group);
        let dev = &self.devices[dev as usize];
        let n = (len / SLOT_HEADER_BYTES) as usize;
        let sector = SLOT_HEADER_BYTES as usize;
        let mut buf = AlignedBuf::zeroed(len as usize);
        if dev.read_exact_at(&mut buf, off).is_ok() {
            return buf
                .as_slice()
                .chunks(sector)
                .map(|c| Some(c.to_vec()))
                .collect();
        }
        let mut one = AlignedBuf::zeroed(sector);
        (0..n)
            .map(|i| {
                dev.read_exact_at(&mut one, off + (i * sector) as u64)
                    .ok()
                    .map(|_| one.as_slice().to_vec())
            })
            .collect()
    }

    /// Retire the slots every device's bad table lists. A table that cannot be
    /// read or fails its checksum retires nothing (its slots fail again and are
    /// retired again); it is noted in `damaged_bad_tables` for `check` and
    /// `repair`. All zeroes is no table (none written yet).
    fn load_bad_tables(&mut self) {
        self.damaged_bad_tables.clear();
        for dev in 0..self.devices.len() {
            let mut buf = AlignedBuf::zeroed(BAD_TABLE_BYTES);
            if let Err(e) = self.devices[dev].read_exact_at(&mut buf, BAD_TABLE_OFFSET) {
                self.damaged_bad_tables
                    .push((dev, format!("unreadable: {e}")));
                continue;
            }
            let b = buf.as_slice();
            if b.iter().all(|&x| x == 0) {
                continue;
            }
            if b[..8] != BAD_TABLE_MAGIC || b[8..24] != self.uuid {
                self.damaged_bad_tables
                    .push((dev, "neither this pool's table nor zeroes".into()));
                continue;
            }
            let count = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(b[28..32].try_into().expect("4 bytes"));
            if count > BAD_TABLE_MAX || crc32c::crc32c(&b[32..32 + 8 * count]) != crc {
                self.damaged_bad_tables
                    .push((dev, format!("its {count} entries fail their checksum")));
                continue;
            }
            let total = self.layout.total_slots();
            for e in b[32..32 + 8 * count].chunks(8) {
                let slot = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                if slot < total && self.layout.header_offset(slot).0 as usize == dev {
                    self.index.lock().retire(slot);
                }
            }
        }
    }

    /// Bad-slot tables found damaged at open: "DEVICE: why".
    fn damaged_bad_tables(&self) -> Vec<String> {
        self.damaged_bad_tables
            .iter()
            .map(|(dev, why)| {
                format!(
                    "{} at offset {BAD_TABLE_OFFSET}: {why}",
                    self.devices[*dev].path().display()
                )
            })
            .collect()
    }

    internal_pub! {
        /// Retire `slots` (their sectors failed a write) and record them in their
        /// devices' bad tables, durably where the table itself can be written, so
        /// a reopened pool routes around them too. Returns the first error of
        /// persisting; the slots are retired in memory regardless.
        fn retire_slots(&mut self, slots: &[u64]) -> Result<()> {
            for &s in slots {
                self.index.lock().retire(s);
            }
            if !self.writable {
                return Ok(());
            }
            let mut devs: Vec<usize> = slots
                .iter()
                .map(|&s| self.layout.header_offset(s).0 as usize)
                .collect();
            devs.sort_unstable();
            devs.dedup();
            let mut first_err = None;
            for dev in devs {
                if let Err(e) = self.write_bad_table(dev) {
                    first_err.get_or_insert(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        }
    }

    /// Write device `dev`'s bad table from the slots retired in memory,
    /// durably.
    fn write_bad_table(&self, dev: usize) -> Result<()> {
        let bad: Vec<u64> = device_slots(&self.layout, dev)
            .filter(|&s| self.index.lock().is_bad(s) && !self.unreadable_headers.contains(&s))
            .take(BAD_TABLE_MAX)
            .collect();
        let mut buf = AlignedBuf::zeroed(BAD_TABLE_BYTES);
        let b = buf.as_mut_slice();
        b[..8].copy_from_slice(&BAD_TABLE_MAGIC);
        b[8..24].copy_from_slice(&self.uuid);
        b[24..28].copy_from_slice(&(bad.len() as u32).to_le_bytes());
        for (i, s) in bad.iter().enumerate() {
            b[32 + 8 * i..40 + 8 * i].copy_from_slice(&s.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b[32..32 + 8 * bad.len()]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        self.devices[dev]
            .write_all_at(&buf, BAD_TABLE_OFFSET)
            .and_then(|_| self.devices[dev].sync_data())
    }

    /// What a header sector holds: nothing (all zeroes: never written, or
    /// cleared), a live block of this pool, or damage (anything else: a
    /// flipped bit in the magic is damage, not an empty slot).
    fn classify(&self, h: &BlockHeader, slot: u64, sector: &[u8]) -> HeaderKind {
        if bytemuck::bytes_of(h).iter().all(|&b| b == 0) {
            return HeaderKind::Empty;
        }
        if h.magic != BLOCK_HEADER_MAGIC
            || h.pool_uuid != self.uuid
            || h.namespace_hash != self.namespace_hash
            || !h.crc_ok()
            || h.version != BLOCK_HEADER_VERSION
            || h.generation >= MAX_GENERATION
            || h.slot != slot
            || h.state != BLOCK_STATE_LIVE
            || h.data_len != self.layout.geometry.block_bytes()
            || h.key_len == 0
            || h.key_len > 32
        {
            return HeaderKind::Damaged;
        }
        let mut layer_crcs = None;
        if h.flags & BLOCK_FLAG_LAYER_CRCS != 0 {
            let n = self.layout.geometry.layers as usize;
            if self.layout.geometry.layers > MAX_LAYER_CRCS || h.flags & BLOCK_FLAG_NO_DATA_CRC != 0
            {
                return HeaderKind::Damaged;
            }
            let table = &sector[LAYER_CRCS_OFFSET..LAYER_CRCS_OFFSET + 4 * n];
            if crc32c::crc32c(table) != h.layer_crcs_crc {
                return HeaderKind::Damaged;
            }
            let crcs: Vec<u32> = table
                .chunks(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            if combine_layer_crcs(&crcs, &self.layer_concat) != h.data_crc {
                return HeaderKind::Damaged;
            }
            layer_crcs = Some(crcs);
        }
        match Key::new(&h.key[..h.key_len as usize]) {
            Ok(k) => HeaderKind::Live(k, layer_crcs),
            Err(_) => HeaderKind::Damaged,
        }
    }

    internal_pub! {
        /// The header sector a committed store writes for `key` in `slot`, into
        /// `sector` (4 KiB), and what loads of the slot verify against from now
        /// on. `layer_crcs` (one crc32c per layer of its K then V object) is
        /// `None` for data the host could not read (GPU memory).
        fn write_header_sector(
            &mut self,
            sector: &mut [u8],
            key: &Key,
            slot: u64,
            generation: u64,
            layer_crcs: Option<&[u32]>,
        ) {
            let data_crc = self
                .header_writer()
                .write(sector, key, slot, generation, layer_crcs);
            self.crcs.set(slot, data_crc, layer_crcs);
        }
    }

    /// What builds this pool's header sectors, detached from the pool so a
    /// store's checksum worker can build each block's sector as soon as it
    /// has the block's checksums (4096 sectors took ~14 ms on the tier's
    /// thread, between a 64K-token store's data flush and its header writes).
    pub(crate) fn header_writer(&self) -> HeaderSectorWriter {
        HeaderSectorWriter {
            uuid: self.uuid,
            namespace_hash: self.namespace_hash,
            block_bytes: self.layout.geometry.block_bytes(),
            layer_concat: self.layer_concat,
        }
    }

    /// Record what loads of `slot` verify against, for a header sector built
    /// by a [`HeaderSectorWriter`] (which returned `data_crc`).
    pub(crate) fn set_slot_crcs(
        &mut self,
        slot: u64,
        data_crc: Option<u32>,
        layer_crcs: Option<&[u32]>,
    ) {
        self.crcs.set(slot, data_crc, layer_crcs);
    }

    internal_pub! {
        /// The checksum a load verifies layer `layer` of `slot` against (crc32c of
        /// its K then V object), when the slot's header carries per-layer checksums.
        fn layer_crc(&self, slot: u64, layer: u32) -> Option<u32> {
            let s = slot as usize;
            (self.crcs.kind.get(s) == Some(&CrcKind::Layers))
                .then(|| self.crcs.per_layer[s * self.crcs.layers as usize + layer as usize])
        }
    }

    /// Joins a layer's V object checksum to its K object's: the layer's
    /// checksum from its two objects' (built once per pool, not per load).
    pub(crate) fn kv_concat(&self) -> &CrcConcat {
        &self.kv_concat
    }

    /// Appends a layer's checksum to the checksum of the layers before it.
    pub(crate) fn layer_concat(&self) -> &CrcConcat {
        &self.layer_concat
    }

    internal_pub! {
        /// The crc32c of the whole block in `slot`, if it has one (blocks stored
        /// from memory the host could not read have none).
        fn block_crc(&self, slot: u64) -> Option<u32> {
            let s = slot as usize;
            (self.crcs.kind.get(s).is_some_and(|k| *k != CrcKind::None)).then(|| self.crcs.whole[s])
        }
    }

    internal_pub! {
        /// The header a committed store writes for `key` in `slot`.
        /// `data_crc` is `None` for data the host could not read (GPU memory).
        fn make_header(
            &self,
            key: &Key,
            slot: u64,
            generation: u64,
            data_crc: Option<u32>,
        ) -> BlockHeader {
            self.header_writer().header(key, slot, generation, data_crc)
        }
    }

    internal_pub! {
        /// A fresh generation number for a store.
        fn next_generation(&mut self) -> u64 {
            // Never past MAX_GENERATION: headers above it are refused as damaged
            // (2^62 stores at ten million a second take 14,000 years).
            debug_assert!(self.next_generation < MAX_GENERATION);
            let g = self.next_generation;
            self.next_generation += 1;
            g
        }
    }

    /// The pool's KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.layout.geometry
    }
    internal_pub! {
        /// Its address arithmetic.
        fn layout(&self) -> &PoolLayout {
            &self.layout
        }
    }
    internal_pub! {
        /// Its index, locked: hold the guard for index operations only (see
        /// [`SharedIndex::lock`]).
        fn index(&self) -> std::sync::MutexGuard<'_, Index> {
            self.index.lock()
        }
    }
    internal_pub! {
        /// Its index, locked, to change.
        fn index_mut(&mut self) -> std::sync::MutexGuard<'_, Index> {
            self.index.lock()
        }
    }
    internal_pub! {
        /// Its index, for a reader on another thread ([`SharedIndex`]).
        fn shared_index(&self) -> SharedIndex {
            self.index.clone()
        }
    }
    internal_pub! {
        /// Its devices.
        fn devices(&self) -> &[Box<dyn Storage>] {
            &self.devices
        }
    }

    internal_pub! {
        /// Owned duplicates of the file descriptors of the pool's devices, for the io_uring
        /// engine, or an error naming a device only another engine can drive.
        fn device_fds(&self) -> Result<Vec<(OwnedFd, String)>> {
            self.devices
                .iter()
                .map(|d| {
                    let name = d.path().display().to_string();
                    let fd = d.io_fd().ok_or_else(|| {
                        Error::invalid(format!(
                            "{name} is not a file or block device; serve this pool with the nvme engine"
                        ))
                    })?;
                    let fd = fd
                        .try_clone_to_owned()
                        .map_err(|e| Error::io(format!("duplicating the descriptor of {name}"), e))?;
                    Ok((fd, name))
                })
                .collect()
        }
    }
    /// The namespace it serves.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// The model name recorded at its create.
    pub fn model(&self) -> &str {
        &self.model
    }
    /// Slots whose header failed its checksum at open.
    pub fn damaged_headers(&self) -> &[u64] {
        &self.damaged_headers
    }
    /// Slots whose header sector could not be read at open.
    pub fn unreadable_headers(&self) -> &[u64] {
        &self.unreadable_headers
    }
    /// Opened to write (create, `open`), not read-only (`open_read_only`).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    internal_pub! {
        /// Take a block that failed verification out of the pool for good: out of
        /// the index now, its header invalidated on the device (and that made
        /// durable) so a reopened pool does not serve it either. Returns its slot,
        /// or None if the key was not live. If the header cannot be cleared the
        /// slot keeps a stale mark, so the next store into it clears it first.
        fn drop_damaged(&mut self, key: &Key) -> Result<Option<u64>> {
            let Some(e) = self.index.lock().get(key).copied() else {
                return Ok(None);
            };
            let cleared = self.clear_header(e.slot);
            self.index.lock().condemn(key, cleared.is_ok());
            cleared.map(|_| Some(e.slot))
        }
    }

    /// Zero the header sector of `slot`, durably.
    fn clear_header(&self, slot: u64) -> Result<()> {
        if !self.writable {
            return Err(Error::invalid(
                "the pool is open read-only; open it for writing to change it",
            ));
        }
        let (dev, off) = self.layout.header_offset(slot);
        let d = &self.devices[dev as usize];
        d.write_all_at(&AlignedBuf::zeroed(SLOT_HEADER_BYTES as usize), off)?;
        d.sync_data()
    }

    /// Drop every block `report` (from `check`) found damaged or unreadable,
    /// clear damaged headers, rewrite unreadable header sectors (retiring
    /// those that still fail) and damaged bad-slot tables, so the pool checks
    /// clean afterwards. Returns
    /// how many blocks were dropped. Needs a pool opened for writing.
    pub fn repair(&mut self, report: &CheckReport) -> Result<u64> {
        if !self.writable {
            return Err(Error::invalid(
                "the pool is open read-only; open it with Pool::open to repair it",
            ));
        }
        self.restore_superblocks()?;
        let mut dropped = 0;
        let mut lost_slots = Vec::new();
        for (slot, _) in report.bad_data.iter().chain(&report.unreadable_data) {
            let Some(key) = self.index.lock().key_of_slot(*slot).copied() else {
                continue;
            };
            if self.drop_damaged(&key).is_err() {
                // The header cannot even be written: the slot's sectors fail.
                lost_slots.push(*slot);
            }
            dropped += 1;
        }
        let damaged = std::mem::take(&mut self.damaged_headers);
        for slot in damaged {
            if self.clear_header(slot).is_err() {
                lost_slots.push(slot);
            }
        }
        // A header sector that could not be read: rewriting it lets a drive
        // remap it. If it reads back now, the slot is in service again;
        // if not, it is retired for good (recorded in the bad table), so no
        // store is handed it and the pool checks clean afterwards.
        let unreadable = std::mem::take(&mut self.unreadable_headers);
        for slot in unreadable {
            let (dev, off) = self.layout.header_offset(slot);
            let revived = self.clear_header(slot).is_ok() && {
                let mut buf = AlignedBuf::zeroed(SLOT_HEADER_BYTES as usize);
                self.devices[dev as usize]
                    .read_exact_at(&mut buf, off)
                    .is_ok()
            };
            if revived {
                self.index.lock().reinstate(slot);
            } else {
                lost_slots.push(slot);
            }
        }
        if !lost_slots.is_empty() {
            self.retire_slots(&lost_slots)?;
        }
        // A damaged bad-slot table written anew from the slots retired now
        // (what it listed is lost: those slots are retired again as their
        // writes fail).
        let tables = std::mem::take(&mut self.damaged_bad_tables);
        for (dev, _) in &tables {
            if let Err(e) = self.write_bad_table(*dev) {
                self.damaged_bad_tables = tables.clone();
                return Err(e);
            }
        }
        Ok(dropped)
    }

    /// Rewrite every damaged copy of a device's superblock from the copy in
    /// use, durably: backups first, the primary last.
    fn restore_superblocks(&mut self) -> Result<()> {
        for (dev, d) in self.devices.iter().zip(&mut self.superblocks) {
            if d.damaged.is_empty() {
                continue;
            }
            let buf = superblock_sector(&d.sb);
            let mut offsets: Vec<u64> = d.damaged.iter().map(|(o, _)| *o).collect();
            offsets.sort_unstable_by(|a, b| b.cmp(a));
            for off in offsets {
                dev.write_all_at(&buf, off)?;
                dev.sync_data()?;
            }
            d.damaged.clear();
        }
        Ok(())
    }

    /// Superblock copies found damaged at open: "DEVICE at OFFSET: why".
    pub fn damaged_superblocks(&self) -> Vec<String> {
        self.devices
            .iter()
            .zip(&self.superblocks)
            .flat_map(|(dev, d)| {
                d.damaged.iter().map(move |(off, why)| {
                    format!(
                        "{} at offset {off} ({}): {why}",
                        dev.path().display(),
                        if *off == 0 { "primary" } else { "backup" }
                    )
                })
            })
            .collect()
    }

    /// What `pool info` shows.
    pub fn info(&self) -> PoolInfo {
        let g = &self.layout.geometry;
        let devices = self
            .devices
            .iter()
            .zip(&self.layout.groups_per_device)
            .zip(&self.device_sizes)
            .map(|((d, &n), &size)| DeviceInfo {
                path: d.path().to_path_buf(),
                size,
                backing_size: d.size(),
                groups: n,
                unwritten_bytes: d
                    .io_fd()
                    .and_then(|fd| crate::host::extents::space_map(fd, size).ok())
                    .map(|m| m.unwritten),
            })
            .collect();
        let ix = self.index.lock();
        PoolInfo {
            uuid: hex(&self.uuid),
            model: self.model.clone(),
            namespace: self.namespace.clone(),
            geometry: *g,
            object_bytes: g.object_bytes(),
            block_bytes: g.block_bytes(),
            group_blocks: self.layout.group_blocks,
            group_bytes: self.layout.group_bytes(),
            devices,
            total_slots: ix.total_slots(),
            live_blocks: ix.live(),
            free_slots: ix.free_slots(),
            pinned_blocks: ix.pinned(),
            capacity_bytes: ix.total_slots() * g.block_bytes(),
            used_bytes: ix.live() * g.block_bytes(),
            damaged_headers: self.damaged_headers.len() as u64,
            damaged_superblocks: self
                .superblocks
                .iter()
                .map(|d| d.damaged.len() as u64)
                .sum(),
            unreadable_headers: self.unreadable_headers.len() as u64,
            bad_slots: ix.bad_slots() - self.unreadable_headers.len() as u64,
        }
    }

    /// Verify every live block's data against its header checksum, group by
    /// group (one read per layer run), and report damaged headers found at
    /// open. `progress` is called with (groups done, groups total).
    pub fn check(&self, mut progress: impl FnMut(u32, u32)) -> Result<CheckReport> {
        let mut report = CheckReport {
            damaged_headers: self.damaged_headers.clone(),
            damaged_superblocks: self.damaged_superblocks(),
            unreadable_headers: self.unreadable_headers.clone(),
            damaged_bad_tables: self.damaged_bad_tables(),
            bad_slots: self.index.lock().bad_slots() - self.unreadable_headers.len() as u64,
            ..Default::default()
        };
        let g = self.layout.group_blocks as u64;
        let geo = self.layout.geometry;
        let obj = geo.object_bytes() as usize;
        let total = self.layout.total_groups();
        let mut live_by_group: Vec<Vec<(u64, Key)>> = vec![Vec::new(); total as usize];
        for (k, e) in self.index.lock().entries() {
            live_by_group[(e.slot / g) as usize].push((e.slot, *k));
        }
        for (group, live) in live_by_group.iter_mut().enumerate() {
            progress(group as u32, total);
            if live.is_empty() {
                continue;
            }
            live.sort();
            // Per live slot: running whole-block crc, per-layer crc, and whether
            // a layer already failed (bad or unreadable).
            let mut whole = vec![0u32; g as usize];
            let mut bad = vec![false; g as usize];
            let mut unreadable = vec![false; g as usize];
            let mut run = AlignedBuf::zeroed(g as usize * obj);
            let mut one = AlignedBuf::zeroed(obj);
            for layer in 0..geo.layers {
                let mut layer_crc = vec![0u32; g as usize];
                for kv in 0..2 {
                    let (dev, off) = self.layout.object_offset(group as u64 * g, layer, kv);
                    let dev = &self.devices[dev as usize];
                    let whole_run = dev.read_exact_at(&mut run, off).is_ok();
                    if whole_run {
                        report.bytes_read += run.len() as u64;
                    }
                    for &(slot, _) in live.iter() {
                        let i = (slot % g) as usize;
                        if unreadable[i] {
                            continue;
                        }
                        let bytes = if whole_run {
                            &run.as_slice()[i * obj..(i + 1) * obj]
                        } else {
                            // Go on past an unreadable sector: read object by
                            // object so every damaged key is named.
                            let (_, o) = self.layout.object_offset(slot, layer, kv);
                            if dev.read_exact_at(&mut one, o).is_err() {
                                unreadable[i] = true;
                                continue;
                            }
                            report.bytes_read += obj as u64;
                            one.as_slice()
                        };
                        whole[i] = crate::checksum::crc32c_append(whole[i], bytes);
                        layer_crc[i] = crate::checksum::crc32c_append(layer_crc[i], bytes);
                    }
                }
                for &(slot, _) in live.iter() {
                    let i = (slot % g) as usize;
                    if let Some(want) = self.layer_crc(slot, layer) {
                        bad[i] |= !unreadable[i] && layer_crc[i] != want;
                    }
                }
            }
            for &(slot, key) in live.iter() {
                report.blocks_checked += 1;
                let i = (slot % g) as usize;
                if unreadable[i] {
                    report.unreadable_data.push((slot, key.to_string()));
                    continue;
                }
                match self.block_crc(slot) {
                    None => report.blocks_unverifiable += 1,
                    Some(want) if want == whole[i] && !bad[i] => report.blocks_ok += 1,
                    Some(_) => report.bad_data.push((slot, key.to_string())),
                }
            }
        }
        progress(total, total);
        Ok(report)
    }

    /// Its devices' paths or names.
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
    /// A live block, with its per-layer checksums when its header has them.
    Live(Key, Option<Vec<u32>>),
}

/// Refuse a device named twice, however it is named: a hard link, `./`, a
/// symlink or a second node of one block device is the same device, and two
/// "devices" on one file would overwrite each other's groups.
fn check_named_once(paths: &[PathBuf]) -> Result<()> {
    let mut seen: Vec<(backing::DeviceIdentity, &PathBuf)> = Vec::new();
    for p in paths {
        let id = backing::device_identity(p);
        if let Some((_, first)) = seen.iter().find(|(i, _)| *i == id) {
            return Err(Error::Backing {
                path: p.clone(),
                reason: format!(
                    "is the same {} as {}; each backing device may appear once",
                    if matches!(id, backing::DeviceIdentity::Block(_)) {
                        "block device"
                    } else {
                        "file"
                    },
                    first.display()
                ),
            });
        }
        seen.push((id, p));
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The 4 KiB sector a superblock copy is written as (the superblock, then zeroes).
fn superblock_sector(sb: &Superblock) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(4096);
    buf.as_mut_slice()[..std::mem::size_of::<Superblock>()].copy_from_slice(bytemuck::bytes_of(sb));
    buf
}

/// What is wrong with a superblock copy that differs from `used`.
fn copy_fault(copy: &Superblock, used: &Superblock) -> String {
    if copy.magic == crate::host::signature::UNFINISHED_MAGIC {
        "holds an unfinished-create mark instead of the superblock".into()
    } else if copy.magic != POOL_MAGIC {
        if bytemuck::bytes_of(copy).iter().all(|&b| b == 0) {
            "is all zeroes (lost)".into()
        } else {
            "does not begin with the pool magic (damaged or overwritten)".into()
        }
    } else if !copy.crc_ok() {
        "fails its checksum (damaged)".into()
    } else if copy.pool_uuid != used.pool_uuid {
        format!(
            "belongs to another pool ({}), left from an earlier one",
            hex(&copy.pool_uuid)
        )
    } else {
        "differs from the superblock in use".into()
    }
}

/// Read a device's superblock: its primary copy when that is sound (or an
/// unfinished-create mark: the primary is the create's commit point), else
/// the first sound backup. A primary that is damaged, unreadable, zeroed or
/// overwritten by unrecognised bytes costs nothing while a backup survives;
/// one overwritten by a filesystem or partition table is not recovered over
/// (that device was given to something else). Returns the superblock in use
/// and each copy that differs from it (offset, what is wrong).
fn read_superblock(dev: &dyn Storage) -> Result<(Superblock, Vec<(u64, String)>)> {
    use crate::host::signature::{probe_signature, Signature, UNFINISHED_MAGIC};
    let read = |off: u64| -> Result<AlignedBuf> {
        let mut b = AlignedBuf::zeroed(4096);
        dev.read_exact_at(&mut b, off).map(|_| b)
    };
    let parse = |b: &AlignedBuf| -> Superblock {
        bytemuck::pod_read_unaligned(&b.as_slice()[..std::mem::size_of::<Superblock>()])
    };
    // The copies of `used` other than the one at `at` that differ from it.
    let others = |used: &Superblock, sector: &AlignedBuf, at: u64| -> Vec<(u64, String)> {
        SUPERBLOCK_OFFSETS[..used.backup_offsets().len() + 1]
            .iter()
            .filter(|&&off| off != at && off + 4096 <= dev.size())
            .filter_map(|&off| match read(off) {
                Ok(b) if b.as_slice() == sector.as_slice() => None,
                Ok(b) => Some((off, copy_fault(&parse(&b), used))),
                Err(e) => Some((off, format!("cannot be read ({e})"))),
            })
            .collect()
    };
    let primary = read(0);
    if let Ok(p) = &primary {
        let sb = parse(p);
        if sb.is_sound() || sb.magic == UNFINISHED_MAGIC {
            check_superblock(&sb, dev.path(), dev.size())?;
            return Ok((sb, others(&sb, p, 0)));
        }
        if let sig @ Signature::Filesystem(_) = probe_signature(p.as_slice()) {
            return Err(Error::Backing {
                path: dev.path().to_path_buf(),
                reason: format!("is not a kvtier pool (found: {sig})"),
            }
            .with_fix(Fix::CreatePool));
        }
    }
    for &off in &SUPERBLOCK_OFFSETS[1..] {
        if off + 4096 > dev.size() {
            continue;
        }
        let Ok(b) = read(off) else { continue };
        let sb = parse(&b);
        if !sb.is_sound() || !sb.backup_offsets().contains(&off) {
            continue;
        }
        check_superblock(&sb, dev.path(), dev.size())?;
        return Ok((sb, others(&sb, &b, off)));
    }
    let p = primary?;
    let sb = parse(&p);
    check_superblock(&sb, dev.path(), dev.size())?;
    Err(Error::Corrupt {
        path: dev.path().to_path_buf(),
        what: "superblock".into(),
        reason: "no sound copy".into(),
    }
    .with_fix(Fix::Recreate))
}

fn check_superblock(sb: &Superblock, path: &Path, backing_size: u64) -> Result<()> {
    let corrupt = |reason: String| Error::Corrupt {
        path: path.to_path_buf(),
        what: "superblock".into(),
        reason,
    };
    if sb.magic == crate::host::signature::UNFINISHED_MAGIC {
        return Err(Error::Backing {
            path: path.to_path_buf(),
            reason: "is not a kvtier pool (a kvtier pool create on it did not finish: it was \
                     killed or failed part way)"
                .into(),
        }
        .with_fix(Fix::RerunCreate));
    }
    if sb.magic != POOL_MAGIC {
        return Err(Error::Backing {
            path: path.to_path_buf(),
            reason: "is not a kvtier pool (no superblock)".into(),
        }
        .with_fix(Fix::CreatePool));
    }
    if !sb.crc_ok() {
        return Err(corrupt(
            "checksum mismatch, and no backup copy is sound; the device was overwritten or damaged"
                .into(),
        )
        .with_fix(Fix::Recreate));
    }
    if sb.version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "format version {} is not supported by this kvtier (version {FORMAT_VERSION})",
            sb.version
        )));
    }
    // Every field below sizes an allocation or an offset: a superblock with a
    // valid checksum but impossible values (written by a bug, or forged) must
    // be refused here, by name, before anything trusts it.
    let field = |name: &str, value: String, why: &str| {
        corrupt(format!("field {name} is {value}, {why}")).with_fix(Fix::Recreate)
    };
    if sb.sb_bytes as usize != std::mem::size_of::<Superblock>() {
        return Err(field("sb_bytes", sb.sb_bytes.to_string(), "not 512"));
    }
    if sb.data_offset != DATA_OFFSET {
        return Err(field(
            "data_offset",
            sb.data_offset.to_string(),
            &format!("not {DATA_OFFSET}"),
        ));
    }
    if sb.slot_header_bytes as u64 != SLOT_HEADER_BYTES {
        return Err(field(
            "slot_header_bytes",
            sb.slot_header_bytes.to_string(),
            &format!("not {SLOT_HEADER_BYTES}"),
        ));
    }
    if sb.device_count == 0 || sb.device_count > u16::MAX as u32 {
        return Err(field(
            "device_count",
            sb.device_count.to_string(),
            "not between 1 and 65535",
        ));
    }
    if sb.device_index >= sb.device_count {
        return Err(field(
            "device_index",
            sb.device_index.to_string(),
            &format!("not below device_count {}", sb.device_count),
        ));
    }
    if sb.group_blocks == 0 || sb.group_blocks > 4096 {
        return Err(field(
            "group_blocks",
            sb.group_blocks.to_string(),
            "not between 1 and 4096",
        ));
    }
    if sb.namespace_len as usize > NAMESPACE_MAX {
        return Err(field(
            "namespace_len",
            sb.namespace_len.to_string(),
            &format!("more than {NAMESPACE_MAX}"),
        ));
    }
    if sb.model_len as usize > MODEL_NAME_MAX {
        return Err(field(
            "model_len",
            sb.model_len.to_string(),
            &format!("more than {MODEL_NAME_MAX}"),
        ));
    }
    let dtype = DType::from_code(sb.dtype)
        .ok_or_else(|| field("dtype", sb.dtype.to_string(), "no known dtype code"))?;
    let geometry = KvGeometry {
        layers: sb.layers,
        kv_heads: sb.kv_heads,
        head_dim: sb.head_dim,
        dtype,
        block_size: sb.block_size,
    };
    for (name, value) in [
        ("layers", sb.layers),
        ("kv_heads", sb.kv_heads),
        ("head_dim", sb.head_dim),
        ("block_size", sb.block_size),
    ] {
        if value == 0 {
            return Err(field(name, "0".into(), "but a model has at least one"));
        }
    }
    if let Err(e) = geometry.validate() {
        return Err(corrupt(format!(
            "its geometry ({} layers, {} kv heads, head_dim {}, block_size {}) is not one kvtier accepts: {e}",
            sb.layers, sb.kv_heads, sb.head_dim, sb.block_size
        )));
    }
    if sb.object_bytes != geometry.object_bytes() {
        return Err(field(
            "object_bytes",
            sb.object_bytes.to_string(),
            &format!(
                "but its geometry makes objects of {} bytes",
                geometry.object_bytes()
            ),
        ));
    }
    if sb.device_size < DATA_OFFSET || sb.device_size % 4096 != 0 {
        return Err(field(
            "device_size",
            sb.device_size.to_string(),
            "not a multiple of 4096 holding at least the reserved first MiB",
        ));
    }
    if sb.device_size > backing_size {
        return Err(Error::Backing {
            path: path.to_path_buf(),
            reason: format!(
                "is {backing_size} bytes but the pool was formatted with {}; it was truncated{}",
                sb.device_size,
                truncated_fix(path, sb.device_size)
            ),
        }
        .with_fix(Fix::Recreate));
    }
    let fit = PoolLayout::groups_fitting(&geometry, sb.group_blocks, sb.device_size);
    if sb.groups_on_device == 0 || sb.groups_on_device > fit {
        return Err(field(
            "groups_on_device",
            sb.groups_on_device.to_string(),
            &format!(
                "but {} bytes hold 1 to {fit} groups of {} blocks",
                sb.device_size, sb.group_blocks
            ),
        ));
    }
    if sb.total_groups < sb.groups_on_device {
        return Err(field(
            "total_groups",
            sb.total_groups.to_string(),
            &format!("fewer than this device's {} groups", sb.groups_on_device),
        ));
    }
    Ok(())
}

/// The fields every device of one pool must agree on.
fn check_same_pool(sb: &Superblock, first: &Superblock, path: &Path) -> Result<()> {
    let same = sb.device_count == first.device_count
        && sb.total_groups == first.total_groups
        && sb.group_blocks == first.group_blocks
        && sb.layers == first.layers
        && sb.kv_heads == first.kv_heads
        && sb.head_dim == first.head_dim
        && sb.dtype == first.dtype
        && sb.block_size == first.block_size
        && sb.object_bytes == first.object_bytes
        && sb.namespace_len == first.namespace_len
        && sb.namespace == first.namespace;
    if same {
        return Ok(());
    }
    Err(Error::Corrupt {
        path: path.to_path_buf(),
        what: "superblock".into(),
        reason: "its geometry, group size, device count or namespace differs from the other devices' of the same pool".into(),
    }
    .with_fix(Fix::Recreate))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_layer_checksums_combine_to_the_whole_block_checksum() {
        let layer = 3 * 4096;
        let data: Vec<u8> = (0..5 * layer).map(|i| (i * 31 % 251) as u8).collect();
        let per: Vec<u32> = data.chunks(layer).map(crc32c::crc32c).collect();
        let concat = CrcConcat::new(layer as u64);
        assert_eq!(combine_layer_crcs(&per, &concat), crc32c::crc32c(&data));
        assert_eq!(
            concat.apply(per[0], per[1]),
            crc32c::crc32c(&data[..2 * layer])
        );
    }
}
