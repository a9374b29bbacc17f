//! Where a pool lives and whether to open or create it: the one policy that
//! [`TierBuilder`](crate::TierBuilder), the CLI and the Python bindings share.
//!
//! A pool directory holds the files kvtier made there (`kvtier-0.pool`,
//! ...). [`decide`] looks at what is at a pool's paths before anything is
//! locked: open a pool that is there; create one where nothing is, where
//! files hold no pool yet (a first create killed before its superblocks
//! landed: [`Pool::create`](super::Pool::create) still refuses any that hold
//! data other than zeros), or where a kvtier create did not finish (its
//! unfinished mark); refuse a pool only partly there. Formatting over
//! anything else takes [`CreateMode::Always`]. The crash guarantees are
//! [`Pool::create`](super::Pool::create)'s, which re-checks the marks under
//! the devices' locks.

use super::layout::PoolLayout;
use crate::error::{Error, Fix, Result};
use crate::host::signature::{unfinished_pool_id, POOL_MAGIC};
use crate::model::KvGeometry;
use std::path::{Path, PathBuf};

/// How a pool's location is met.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CreateMode {
    /// Open the pool there; create one where none is, or where a kvtier
    /// create did not finish (never over data kvtier did not write).
    #[default]
    Auto,
    /// Create the pool anew over whatever is there: the explicit force
    /// (every block stored there is lost; a filesystem is overwritten).
    Always,
    /// Open only.
    Never,
}

impl CreateMode {
    /// `auto`, `always` or `never`; `None` for anything else.
    pub fn parse(s: &str) -> Option<CreateMode> {
        Some(match s {
            "auto" => CreateMode::Auto,
            "always" => CreateMode::Always,
            "never" => CreateMode::Never,
            _ => return None,
        })
    }
}

/// What to do at a pool's paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Open the pool that is there.
    Open,
    /// Format a pool; `force`: over whatever is there.
    Create {
        /// Overwrite data and pools (only with [`CreateMode::Always`]).
        force: bool,
    },
}

/// The files of a pool of `files` files in directory `dir`.
pub fn directory_files(dir: &Path, files: u32) -> Vec<PathBuf> {
    (0..files)
        .map(|i| dir.join(format!("kvtier-{i}.pool")))
        .collect()
}

/// How many files the pool in `dir` has: as many as its first file's
/// superblock records (a file left from an earlier pool of more files is
/// not its), else one past the highest `kvtier-N.pool` there (N below 64;
/// 0 where there is none, or no directory), so that a file missing below
/// the highest is named as missing. A pool made over several files then
/// opens without its count given (`kvtier serve --dir` had no way to give
/// it).
pub fn directory_files_found(dir: &Path) -> u32 {
    if let Some(n) = recorded_device_count(&directory_files(dir, 1)[0]) {
        return n;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name();
            let n: u32 = name
                .to_str()?
                .strip_prefix("kvtier-")?
                .strip_suffix(".pool")?
                .parse()
                .ok()?;
            // Only the names kvtier makes: "kvtier-01.pool" is not file 1.
            (n < 64 && name.to_str() == Some(&format!("kvtier-{n}.pool"))).then_some(n + 1)
        })
        .max()
        .unwrap_or(0)
}

/// The device count of the pool whose file `path` is (its first sound
/// superblock copy, read without a lock); None for anything else.
fn recorded_device_count(path: &Path) -> Option<u32> {
    use super::layout::{Superblock, SUPERBLOCK_OFFSETS};
    use std::os::unix::fs::FileExt;
    if !std::fs::metadata(path).ok()?.is_file() {
        return None;
    }
    let f = std::fs::File::open(path).ok()?;
    SUPERBLOCK_OFFSETS.iter().find_map(|&off| {
        let mut b = [0u8; std::mem::size_of::<Superblock>()];
        f.read_exact_at(&mut b, off).ok()?;
        let sb: Superblock = bytemuck::pod_read_unaligned(&b);
        (sb.is_sound() && (1..=64).contains(&sb.device_count)).then_some(sb.device_count)
    })
}

/// The first 24 bytes of a regular file or block device, read without a lock
/// (None for anything else: opening a FIFO to read would wait for a writer).
pub(crate) fn head_of(path: &Path) -> Option<[u8; 24]> {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let ft = std::fs::metadata(path).ok()?.file_type();
    if !ft.is_file() && !ft.is_block_device() {
        return None;
    }
    let mut head = [0u8; 24];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .ok()?;
    Some(head)
}

/// Whether `path` begins with a kvtier superblock's magic (false when it
/// cannot be read: creating over it then reports why).
fn begins_a_pool(path: &Path) -> bool {
    head_of(path).is_some_and(|h| h[..8] == POOL_MAGIC)
}

/// Open or create the pool at `paths`, as `mode` allows (see the module).
pub fn decide(paths: &[PathBuf], mode: CreateMode) -> Result<Verdict> {
    match mode {
        CreateMode::Always => return Ok(Verdict::Create { force: true }),
        CreateMode::Never => return Ok(Verdict::Open),
        CreateMode::Auto => {}
    }
    let present: Vec<&PathBuf> = paths.iter().filter(|p| p.exists()).collect();
    // Files a first create made before a kill, no superblock in them yet
    // (allocated, zero, or partly prewritten with zeros): created over
    // without force, so that anything but zeros in them is still refused.
    let no_pool_yet = present.iter().all(|p| !begins_a_pool(p));
    // Superblocks beside a device still marked by an unfinished create:
    // killed between its superblock writes. Creating without force formats
    // over the superblocks only if that mark is their create's (checked
    // again by `Pool::create` under the locks).
    let interrupted = !no_pool_yet
        && paths
            .iter()
            .any(|p| head_of(p).is_some_and(|h| unfinished_pool_id(&h).is_some()));
    if no_pool_yet || interrupted {
        return Ok(Verdict::Create { force: false });
    }
    // Some files carry a superblock and others none (a create killed
    // between its superblock writes, or a file replaced): opening would
    // call the bare one "not a kvtier pool".
    let bare: Vec<String> = present
        .iter()
        .filter(|p| !begins_a_pool(p))
        .map(|p| p.display().to_string())
        .collect();
    if !bare.is_empty() {
        return Err(Error::Backing {
            path: PathBuf::from(&bare[0]),
            reason: format!(
                "the pool is incomplete: {} has no superblock while the pool's other files do \
                 (a create killed part way, or a file replaced)",
                bare.join(", ")
            ),
        }
        .with_fix(Fix::RestoreOrRecreate));
    }
    if present.len() < paths.len() {
        let missing = paths.iter().find(|p| !p.exists()).expect("one is missing");
        return Err(Error::Backing {
            path: missing.clone(),
            reason: format!(
                "it is missing ({} of the pool's {} files exist): the pool is incomplete",
                present.len(),
                paths.len()
            ),
        }
        .with_fix(Fix::RestoreOrRecreate));
    }
    Ok(Verdict::Open)
}

/// The least total capacity of a pool of `files` files: each holds its
/// superblock area and one extent group of `group_blocks` blocks.
pub fn min_capacity(geometry: &KvGeometry, group_blocks: u32, files: usize) -> u64 {
    PoolLayout::min_device_bytes(geometry, group_blocks).saturating_mul(files as u64)
}

/// `capacity` bytes split over `files` equal files (each a multiple of 4
/// KiB, for direct I/O).
pub fn split_capacity(capacity: u64, files: usize) -> u64 {
    (capacity / files.max(1) as u64) & !4095
}

/// [`split_capacity`], refused when a file would be smaller than the
/// smallest pool of this geometry needs; `path` names the pool in the error.
pub fn bytes_per_file(
    capacity: u64,
    files: usize,
    geometry: &KvGeometry,
    group_blocks: u32,
    path: &Path,
) -> Result<u64> {
    let per = split_capacity(capacity, files);
    let min = PoolLayout::min_device_bytes(geometry, group_blocks);
    if per < min {
        return Err(Error::invalid(format!(
            "pool {}: a capacity of {capacity} bytes gives each of {files} pool file(s) {per} \
             bytes, less than the {min} the smallest pool of this model needs (one group of \
             {group_blocks} blocks and the superblock area)",
            path.display()
        ))
        .with_fix(Fix::GiveCapacity {
            at_least: min_capacity(geometry, group_blocks, files),
        }));
    }
    Ok(per)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DType;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvtier-place-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn files_found_in_a_directory() {
        let d = dir("found");
        assert_eq!(directory_files_found(&d), 0);
        assert_eq!(directory_files_found(&d.join("none")), 0);
        for name in ["kvtier-1.pool", "kvtier-01.pool", "kvtier-99.pool", "other-7.pool"] {
            std::fs::write(d.join(name), b"").unwrap();
        }
        assert_eq!(directory_files_found(&d), 2);
        std::fs::write(d.join("kvtier-63.pool"), b"").unwrap();
        assert_eq!(directory_files_found(&d), 64);
    }

    #[test]
    fn verdicts() {
        let d = dir("verdicts");
        let paths = directory_files(&d, 2);
        assert_eq!(paths[1], d.join("kvtier-1.pool"));
        assert_eq!(
            decide(&paths, CreateMode::Auto).unwrap(),
            Verdict::Create { force: false },
            "nothing there"
        );
        assert_eq!(decide(&paths, CreateMode::Never).unwrap(), Verdict::Open);
        assert_eq!(
            decide(&paths, CreateMode::Always).unwrap(),
            Verdict::Create { force: true }
        );
        // Files without a superblock (a first create killed early): create,
        // without force (Pool::create refuses any data but zeros).
        std::fs::write(&paths[0], vec![0u8; 8192]).unwrap();
        assert_eq!(
            decide(&paths, CreateMode::Auto).unwrap(),
            Verdict::Create { force: false }
        );
        // Both with a superblock: open.
        let mut sb = vec![0u8; 8192];
        sb[..8].copy_from_slice(&POOL_MAGIC);
        std::fs::write(&paths[0], &sb).unwrap();
        std::fs::write(&paths[1], &sb).unwrap();
        assert_eq!(decide(&paths, CreateMode::Auto).unwrap(), Verdict::Open);
        // One bare beside a superblock: refused, naming the bare one.
        std::fs::write(&paths[1], vec![0u8; 8192]).unwrap();
        let e = decide(&paths, CreateMode::Auto).unwrap_err();
        assert_eq!(e.fix(), Some(&Fix::RestoreOrRecreate), "{e}");
        assert!(
            matches!(e.without_fix(), Error::Backing { path, .. } if *path == paths[1]),
            "{e}"
        );
        assert!(e.to_string().contains("CreateMode::Always"), "{e}");
        // ... unless it carries an unfinished create's mark.
        let mut mark = vec![0u8; 8192];
        mark[..8].copy_from_slice(&crate::host::signature::UNFINISHED_MAGIC);
        mark[8] = 1;
        std::fs::write(&paths[1], &mark).unwrap();
        assert_eq!(
            decide(&paths, CreateMode::Auto).unwrap(),
            Verdict::Create { force: false }
        );
        // One of two missing beside a pool: refused.
        std::fs::remove_file(&paths[1]).unwrap();
        let e = decide(&paths, CreateMode::Auto).unwrap_err();
        assert!(
            e.to_string().contains("1 of the pool's 2 files exist"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn capacity_splits_into_aligned_files_and_refuses_too_little() {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            dtype: DType::BF16,
            block_size: 16,
        };
        assert_eq!(split_capacity(3 << 20, 2), 3 << 19);
        assert_eq!(split_capacity(10_000, 1), 8192);
        let min = min_capacity(&g, 4, 2);
        assert_eq!(
            bytes_per_file(min, 2, &g, 4, Path::new("p")).unwrap(),
            min / 2
        );
        let e = bytes_per_file(min - 4096 * 2, 2, &g, 4, Path::new("p")).unwrap_err();
        assert_eq!(e.fix(), Some(&Fix::GiveCapacity { at_least: min }), "{e}");
        assert!(e.to_string().contains(&format!("capacity({min})")), "{e}");
    }
}
