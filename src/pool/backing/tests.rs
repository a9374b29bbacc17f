use super::locks::{parse_lock_holders, process_alive, LockHolder};
use super::*;
use crate::host::mounts::mounted_at;
use crate::host::signature::POOL_MAGIC;
use std::io::Write;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

const MIB: u64 = 1024 * 1024;

/// A unique scratch directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "kvtier-backing-{tag}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn write_file(path: &Path, bytes: &[u8]) {
    let mut f = File::create(path).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

fn pattern(len: usize, seed: u8) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    buf
}

fn write_magic(dev: &BackingDevice) {
    let mut sb = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    sb.as_mut_slice()[..8].copy_from_slice(&POOL_MAGIC);
    dev.write_all_at(&sb, 0).unwrap();
    dev.sync_data().unwrap();
}

/// The refusal's reason, followed by its fix in the library's words (what
/// a front end replaces with its own).
fn backing_reason(err: Error) -> String {
    let fix = err.fix().map(|f| format!("; {f}")).unwrap_or_default();
    match err.without_fix() {
        Error::Backing { reason, .. } => format!("{reason}{fix}"),
        other => panic!("expected Error::Backing, got {other:?}"),
    }
}

// ---- probe_signature ---------------------------------------------------------------

// ---- AlignedBuf --------------------------------------------------------------------

// ---- file-backed devices -----------------------------------------------------------

#[test]
fn backing_device_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<BackingDevice>();
}

#[test]
fn file_pool_create_write_read() {
    let dir = TempDir::new("rw");
    let path = dir.path("pool.img");
    let size = 8 * MIB;
    let dev = BackingDevice::create(&path, Some(size), MIB, false).unwrap();
    assert_eq!(dev.size(), size);
    assert_eq!(dev.kind(), BackingKind::File);
    assert_eq!(dev.path(), path.as_path());
    let lbs = dev.logical_block_size();
    assert!(lbs >= 512 && DIRECT_IO_ALIGN as u32 % lbs == 0, "lbs {lbs}");
    assert!(dev.as_fd().as_raw_fd() >= 0);
    let meta = fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), size);
    assert_eq!(meta.mode() & 0o777, 0o600);
    // fallocate really allocated the space (not a sparse file).
    assert!(meta.blocks() * 512 >= size, "blocks {}", meta.blocks());
    // The descriptor is really O_DIRECT.
    let flags = nix::fcntl::fcntl(dev.as_fd(), FcntlArg::F_GETFL).unwrap();
    assert_ne!(flags & libc::O_DIRECT, 0);

    for (offset, len, seed) in [
        (0u64, 4096usize, 1u8),
        (4096, 8192, 2),
        (3 * MIB, 64 * 1024, 3),
        (size - 4096, 4096, 4),
    ] {
        let data = pattern(len, seed);
        dev.write_all_at(&data, offset).unwrap();
        let mut back = AlignedBuf::zeroed(len);
        dev.read_exact_at(&mut back, offset).unwrap();
        assert_eq!(back.as_slice(), data.as_slice(), "offset {offset}");
    }
    dev.sync_data().unwrap();

    // Misaligned offset: a programming error, reported as such.
    let buf = AlignedBuf::zeroed(4096);
    assert!(matches!(
        dev.write_all_at(&buf, 512),
        Err(Error::InvalidArgument(_))
    ));
    // Past the end: refused, the file never grows.
    let err = dev
        .write_all_at(&AlignedBuf::zeroed(8192), size - 4096)
        .unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    let err = dev.write_all_at(&buf, size).unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err:?}");
    assert_eq!(fs::metadata(&path).unwrap().len(), size);
    drop(dev);

    // Not a pool yet (offset 0 holds a test pattern)...
    let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
    assert!(reason.contains("not a kvtier pool"), "{reason}");
    assert!(reason.contains("create a pool there first"), "{reason}");

    // ...until the magic is written at byte 0.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&POOL_MAGIC, 0)
        .unwrap();
    let dev = BackingDevice::open(&path).unwrap();
    assert_eq!(dev.size(), size);
    assert_eq!(dev.kind(), BackingKind::File);
    let mut back = AlignedBuf::zeroed(8192);
    dev.read_exact_at(&mut back, 4096).unwrap();
    assert_eq!(back.as_slice(), pattern(8192, 2).as_slice());
    assert_eq!(fs::metadata(&path).unwrap().len(), size);
    drop(dev);
    // Re-creating over an existing pool needs force (its blocks would be lost) and
    // keeps the size exact.
    let reason = backing_reason(BackingDevice::create(&path, Some(size), MIB, false).unwrap_err());
    assert!(
        reason.contains("holds a kvtier pool") && reason.contains("PoolConfig::force"),
        "{reason}"
    );
    let dev = BackingDevice::create(&path, Some(size), MIB, true).unwrap();
    assert_eq!(dev.size(), size);
    assert_eq!(fs::metadata(&path).unwrap().len(), size);
}

#[test]
fn a_second_opener_is_refused_naming_the_holder() {
    let dir = TempDir::new("lock");
    let path = dir.path("pool.img");
    let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap();
    write_magic(&dev);
    let me = std::process::id();
    // A writer holds it: no second writer, no reader, no re-create (even forced).
    for err in [
        BackingDevice::open(&path).unwrap_err(),
        BackingDevice::open_with(&path, Access::Shared).unwrap_err(),
        BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(
            text.contains("pool.img")
                && text.contains("in use")
                && text.contains(&format!("pid {me}")),
            "{text}"
        );
    }
    drop(dev);
    // Readers share; a writer waits for them to go.
    let r1 = BackingDevice::open_with(&path, Access::Shared).unwrap();
    let r2 = BackingDevice::open_with(&path, Access::Shared).unwrap();
    let mut buf = AlignedBuf::zeroed(4096);
    r1.read_exact_at(&mut buf, 0).unwrap();
    assert!(r1.write_all_at(&buf, 0).is_err(), "a reader cannot write");
    let text = BackingDevice::open(&path).unwrap_err().to_string();
    assert!(
        text.contains("in use") && text.contains(&format!("pid {me}")),
        "{text}"
    );
    drop((r1, r2));
    BackingDevice::open(&path).unwrap();
}

#[test]
fn lock_holders_are_parsed_from_proc_locks() {
    let text = "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF\n\
                1: -> FLOCK  ADVISORY  WRITE 99 00:2a:1234 0 EOF\n\
                2: POSIX  ADVISORY  WRITE 7 00:2a:1234 0 EOF\n\
                3: FLOCK  ADVISORY  READ 17 fd:01:1234 0 EOF\n\
                4: FLOCK  ADVISORY  READ 18 00:2a:1234 0 EOF\n";
    assert_eq!(
        parse_lock_holders(text, 0, 0x2a, 1234),
        vec![
            LockHolder {
                pid: 4242,
                exclusive: true
            },
            LockHolder {
                pid: 18,
                exclusive: false
            }
        ]
    );
    assert_eq!(parse_lock_holders(text, 0xfd, 1, 1234).len(), 1);
    assert!(!process_alive(-1) && process_alive(std::process::id() as i32));
}

#[test]
fn dangling_symlink_sparse_files_and_identities_are_named() {
    let dir = TempDir::new("names");
    let link = dir.path("link.pool");
    std::os::unix::fs::symlink(dir.path("missing/target.pool"), &link).unwrap();
    let reason =
        backing_reason(BackingDevice::create(&link, Some(8 * MIB), MIB, false).unwrap_err());
    assert!(
        reason.contains("symbolic link") && reason.contains("does not exist"),
        "{reason}"
    );
    let reason = backing_reason(check_sparse_ok(&link, false).unwrap_err());
    assert!(
        reason.contains("fallocate") && reason.contains("PoolConfig::force"),
        "{reason}"
    );
    check_sparse_ok(&link, true).unwrap();
    // A loop of links is named as one, to create or to open.
    std::os::unix::fs::symlink(dir.path("loop-b"), dir.path("loop-a")).unwrap();
    std::os::unix::fs::symlink(dir.path("loop-a"), dir.path("loop-b")).unwrap();
    for reason in [
        backing_reason(
            BackingDevice::create(&dir.path("loop-a"), Some(8 * MIB), MIB, false).unwrap_err(),
        ),
        backing_reason(BackingDevice::open(&dir.path("loop-a")).unwrap_err()),
    ] {
        assert!(
            reason.contains("loop of links") && reason.contains("name the pool file"),
            "{reason}"
        );
    }

    let a = dir.path("a.pool");
    write_file(&a, &[0u8; 4096]);
    fs::hard_link(&a, dir.path("b.pool")).unwrap();
    assert_eq!(device_identity(&a), device_identity(&dir.path("b.pool")));
    assert_eq!(
        device_identity(&dir.path("new.pool")),
        device_identity(&dir.0.join(".").join("new.pool"))
    );
    assert_ne!(device_identity(&a), device_identity(&dir.path("new.pool")));
}

#[test]
fn data_past_the_first_256_kib_is_foreign_data() {
    let dir = TempDir::new("deep");
    let path = dir.path("image.bin");
    let mut img = vec![0u8; 8 * MIB as usize];
    img[5 * MIB as usize + 77] = 1;
    write_file(&path, &img);
    let reason =
        backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
    assert!(
        reason.contains("not a kvtier pool") && reason.contains("PoolConfig::force"),
        "{reason}"
    );
    assert_eq!(fs::read(&path).unwrap(), img, "untouched");
    // A sparse or zero file is still fine.
    let zero = dir.path("zero.bin");
    fs::File::create(&zero).unwrap().set_len(8 * MIB).unwrap();
    BackingDevice::create(&zero, Some(8 * MIB), MIB, false).unwrap();
}

#[test]
fn file_create_grows_an_existing_smaller_pool_file_exactly() {
    let dir = TempDir::new("grow");
    let path = dir.path("pool.img");
    let dev = BackingDevice::create(&path, Some(4 * MIB), MIB, false).unwrap();
    write_magic(&dev);
    drop(dev);
    let dev = BackingDevice::create(&path, Some(6 * MIB), MIB, true).unwrap();
    assert_eq!(dev.size(), 6 * MIB);
    assert_eq!(fs::metadata(&path).unwrap().len(), 6 * MIB);
}

#[test]
fn file_create_refuses_foreign_data_without_force() {
    let dir = TempDir::new("foreign");
    let path = dir.path("notes.txt");
    write_file(&path, b"my precious notes\n");

    let err = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("PoolConfig::force"), "{text}");
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("not a kvtier pool"), "{text}");
    // Untouched.
    assert_eq!(fs::read(&path).unwrap(), b"my precious notes\n");

    let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap();
    assert_eq!(dev.size(), 8 * MIB);
    assert_eq!(fs::metadata(&path).unwrap().len(), 8 * MIB);
    // The old data is gone from the head.
    let mut head = AlignedBuf::zeroed(SIGNATURE_PROBE_BYTES);
    dev.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(probe_signature(head.as_slice()), Signature::Empty);
}

#[test]
fn file_create_refuses_ext4_magic_without_force() {
    let dir = TempDir::new("ext4");
    let path = dir.path("fs.img");
    let mut img = vec![0u8; 2 * MIB as usize];
    img[1080] = 0x53;
    img[1081] = 0xef;
    write_file(&path, &img);
    let err = BackingDevice::create(&path, Some(2 * MIB), MIB, false).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("ext2/3/4"), "{text}");
    assert!(
        text.contains("set PoolConfig::force to overwrite it"),
        "{text}"
    );
    // The fix is structured: front ends name it in their own words.
    assert_eq!(err.fix(), Some(&crate::error::Fix::Overwrite));
    assert_eq!(err.kind(), crate::error::ErrorKind::Usage);
    assert!(!err.without_fix().to_string().contains("force"), "{err}");

    let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
    assert!(
        reason.contains("not a kvtier pool (found: an ext2/3/4 filesystem)"),
        "{reason}"
    );

    let dev = BackingDevice::create(&path, Some(2 * MIB), MIB, true).unwrap();
    assert_eq!(dev.size(), 2 * MIB);
}

#[test]
fn file_create_size_rules() {
    let dir = TempDir::new("sizes");
    let path = dir.path("pool.img");

    let reason =
        backing_reason(BackingDevice::create(&path, Some(8 * MIB + 100), MIB, false).unwrap_err());
    assert!(reason.contains("not a multiple of 4096"), "{reason}");
    assert!(!path.exists(), "nothing created on a bad size");

    let reason = backing_reason(BackingDevice::create(&path, None, MIB, false).unwrap_err());
    assert!(reason.contains("DeviceSpec::size"), "{reason}");

    let min = 4 * MIB + 8192;
    let err = BackingDevice::create(&path, Some(MIB), min, false).unwrap_err();
    let reason = backing_reason(err);
    assert!(reason.contains("1 MiB"), "{reason}");
    assert!(reason.contains(&min.to_string()), "{reason}");
    assert!(reason.contains("ask for a larger size"), "{reason}");
    assert!(!path.exists());

    // Exactly the minimum is fine.
    let dev = BackingDevice::create(&path, Some(min), min, false).unwrap();
    assert_eq!(dev.size(), min);
}

#[test]
fn file_create_never_shrinks_without_force() {
    let dir = TempDir::new("shrink");
    let path = dir.path("pool.img");
    let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap();
    drop(dev);

    let reason =
        backing_reason(BackingDevice::create(&path, Some(4 * MIB), MIB, false).unwrap_err());
    assert!(reason.contains("PoolConfig::force"), "{reason}");
    assert!(
        reason.contains("larger than the requested size"),
        "{reason}"
    );
    assert_eq!(fs::metadata(&path).unwrap().len(), 8 * MIB);

    let dev = BackingDevice::create(&path, Some(4 * MIB), MIB, true).unwrap();
    assert_eq!(dev.size(), 4 * MIB);
    assert_eq!(fs::metadata(&path).unwrap().len(), 4 * MIB);
}

#[test]
fn create_refuses_directories_and_missing_parents() {
    let dir = TempDir::new("dirs");
    let reason =
        backing_reason(BackingDevice::create(&dir.0, Some(8 * MIB), MIB, true).unwrap_err());
    assert!(reason.contains("a directory"), "{reason}");

    let path = dir.path("no/such/dir/pool.img");
    let reason =
        backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
    assert!(reason.contains("does not exist"), "{reason}");

    let reason = backing_reason(BackingDevice::open(&dir.0).unwrap_err());
    assert!(reason.contains("a directory"), "{reason}");
}

#[test]
fn open_errors_are_clear() {
    let dir = TempDir::new("open");
    let missing = dir.path("missing.img");
    let reason = backing_reason(BackingDevice::open(&missing).unwrap_err());
    assert!(reason.contains("does not exist"), "{reason}");
    assert!(reason.contains("create a pool there first"), "{reason}");

    let empty = dir.path("empty.img");
    write_file(&empty, b"");
    let reason = backing_reason(BackingDevice::open(&empty).unwrap_err());
    assert!(
        reason.contains("not a kvtier pool (it is empty)"),
        "{reason}"
    );

    let zeros = dir.path("zeros.img");
    write_file(&zeros, &vec![0u8; 65536]);
    let reason = backing_reason(BackingDevice::open(&zeros).unwrap_err());
    assert!(reason.contains("all zero"), "{reason}");

    let text = dir.path("text.img");
    write_file(&text, b"hello world");
    let err = BackingDevice::open(&text).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&text.display().to_string()), "{msg}");
    assert!(msg.contains("not a kvtier pool"), "{msg}");
}

#[test]
fn short_reads_are_device_errors() {
    let dir = TempDir::new("short");
    let path = dir.path("pool.img");
    let size = 8 * MIB;
    let dev = BackingDevice::create(&path, Some(size), MIB, false).unwrap();
    write_magic(&dev);

    // Past the end of the device.
    let mut buf = AlignedBuf::zeroed(8192);
    match dev.read_exact_at(&mut buf, size - 4096).unwrap_err() {
        Error::Device {
            device,
            offset,
            len,
            reason,
        } => {
            assert_eq!(device, path.display().to_string());
            assert_eq!(offset, size - 4096);
            assert_eq!(len, 8192);
            assert!(reason.contains("past the end"), "{reason}");
        }
        other => panic!("expected Error::Device, got {other:?}"),
    }

    // The file shrinks under us: pread comes back short.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(size - 4096)
        .unwrap();
    match dev.read_exact_at(&mut buf, size - 8192).unwrap_err() {
        Error::Device { reason, len, .. } => {
            assert_eq!(len, 8192);
            assert!(reason.contains("short read: got 4096 of 8192"), "{reason}");
        }
        other => panic!("expected Error::Device, got {other:?}"),
    }
}

// ---- mounts ------------------------------------------------------------------------

/// The block device mounted at "/" according to mountinfo, if its node exists.
fn root_device() -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.get(4) != Some(&"/") {
            continue;
        }
        let sep = fields.iter().position(|f| *f == "-")?;
        let source = fields.get(sep + 2)?;
        let meta = fs::metadata(source).ok()?;
        if meta.file_type().is_block_device() {
            return Some(PathBuf::from(source));
        }
    }
    None
}

#[test]
fn mounted_at_finds_the_root_device() {
    match root_device() {
        Some(dev) => {
            assert_eq!(mounted_at(&dev).unwrap().as_deref(), Some("/"), "{dev:?}");
            // And create refuses it, even with force.
            let reason = backing_reason(BackingDevice::create(&dev, None, MIB, true).unwrap_err());
            assert!(reason.contains("mounted at /"), "{reason}");
            let reason = backing_reason(BackingDevice::open(&dev).unwrap_err());
            assert!(reason.contains("mounted at /"), "{reason}");
        }
        None => eprintln!(
            "note: the root filesystem's block device node was not found; \
             skipping the mounted_at(\"/\") assertion"
        ),
    }
    // A regular file is never "mounted".
    let dir = TempDir::new("mnt");
    let file = dir.path("f");
    write_file(&file, b"x");
    assert_eq!(mounted_at(&file).unwrap(), None);
    assert!(mounted_at(&dir.path("missing")).is_err());
}

// ---- loop devices ------------------------------------------------------------------

fn run(cmd: &str, args: &[&str]) -> std::result::Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A loop device over a file, detached on drop.
struct Loop(PathBuf);

impl Loop {
    fn attach(file: &Path, partscan: bool) -> std::result::Result<Loop, String> {
        let file = file.to_str().ok_or("non-UTF-8 path")?;
        let mut args = vec!["-f", "--show"];
        if partscan {
            args.push("-P");
        }
        args.push(file);
        run("losetup", &args).map(|dev| Loop(PathBuf::from(dev)))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if let Some(dev) = self.0.to_str() {
            let _ = run("losetup", &["-d", dev]);
        }
    }
}

/// A mount, unmounted on drop.
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(dir) = self.0.to_str() {
            let _ = run("umount", &[dir]);
        }
    }
}

fn mkfs_and_mount(dev: &Path, dir: &Path) -> std::result::Result<Mount, String> {
    let dev = dev.to_str().ok_or("non-UTF-8 path")?;
    run("mkfs.ext4", &["-q", "-F", dev])?;
    fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    run("mount", &[dev, dir.to_str().ok_or("non-UTF-8 path")?])?;
    Ok(Mount(dir.to_path_buf()))
}

#[test]
fn loop_device_create_open_and_mount_checks() {
    let dir = TempDir::new("loop");
    let img = dir.path("disk.img");
    let size = 16 * MIB;
    File::create(&img).unwrap().set_len(size).unwrap();
    let lo = match Loop::attach(&img, false) {
        Ok(lo) => lo,
        Err(why) => {
            eprintln!("note: skipping the loop-device test: {why}");
            return;
        }
    };
    let path = lo.0.clone();
    assert!(fs::metadata(&path).unwrap().file_type().is_block_device());
    assert_eq!(mounted_at(&path).unwrap(), None);

    // Size checks against BLKGETSIZE64.
    let reason =
        backing_reason(BackingDevice::create(&path, Some(32 * MIB), MIB, false).unwrap_err());
    assert!(reason.contains("larger than the device"), "{reason}");
    let reason = backing_reason(BackingDevice::create(&path, None, 64 * MIB, false).unwrap_err());
    assert!(reason.contains("16 MiB") && reason.contains(&(64 * MIB).to_string()));

    // A blank device is accepted without force; not a pool until the magic is written.
    let dev = BackingDevice::create(&path, None, MIB, false).unwrap();
    assert_eq!(dev.kind(), BackingKind::BlockDevice);
    assert_eq!(dev.size(), size);
    let lbs = dev.logical_block_size();
    assert!(lbs >= 512 && DIRECT_IO_ALIGN as u32 % lbs == 0, "lbs {lbs}");
    // Held exclusively: a second exclusive open is refused as "in use".
    let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
    assert!(reason.contains("in use"), "{reason}");
    let data = pattern(65536, 7);
    dev.write_all_at(&data, MIB).unwrap();
    let mut back = AlignedBuf::zeroed(65536);
    dev.read_exact_at(&mut back, MIB).unwrap();
    assert_eq!(back.as_slice(), data.as_slice());
    assert!(matches!(
        dev.read_exact_at(&mut back, size),
        Err(Error::Device { .. })
    ));
    dev.sync_data().unwrap();
    drop(dev);
    let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
    assert!(reason.contains("not a kvtier pool"), "{reason}");
    // The data at 1 MiB is someone's, though the head is all zero.
    let reason =
        backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
    assert!(reason.contains("PoolConfig::force"), "{reason}");

    let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap();
    assert_eq!(dev.size(), 8 * MIB);
    write_magic(&dev);
    drop(dev);
    let dev = BackingDevice::open(&path).unwrap();
    assert_eq!(dev.size(), size);
    assert_eq!(dev.kind(), BackingKind::BlockDevice);
    drop(dev);

    // A filesystem on it: mounted -> refused even with force; unmounted -> needs force.
    let mnt = dir.path("mnt");
    match mkfs_and_mount(&path, &mnt) {
        Ok(mount) => {
            let mp = mounted_at(&path).unwrap();
            assert_eq!(mp.as_deref(), Some(mnt.to_str().unwrap()));
            let reason = backing_reason(BackingDevice::create(&path, None, MIB, true).unwrap_err());
            assert!(reason.contains("mounted at"), "{reason}");
            assert!(reason.contains("unmount"), "{reason}");
            drop(mount);
            assert_eq!(mounted_at(&path).unwrap(), None);

            let reason =
                backing_reason(BackingDevice::create(&path, None, MIB, false).unwrap_err());
            assert!(reason.contains("ext2/3/4"), "{reason}");
            assert!(
                reason.contains("set PoolConfig::force to overwrite it"),
                "{reason}"
            );
            let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
            assert!(reason.contains("found: an ext2/3/4 filesystem"), "{reason}");

            let dev = BackingDevice::create(&path, None, MIB, true).unwrap();
            let mut head = AlignedBuf::zeroed(SIGNATURE_PROBE_BYTES);
            dev.read_exact_at(&mut head, 0).unwrap();
            assert_eq!(probe_signature(head.as_slice()), Signature::Empty);
        }
        Err(why) => eprintln!("note: skipping the mounted-filesystem part: {why}"),
    }
    drop(lo);

    // A partitioned disk whose partition is mounted: the whole disk is in use.
    let img2 = dir.path("parted.img");
    let mut mbr = vec![0u8; 512];
    mbr[446 + 4] = 0x83;
    mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
    mbr[446 + 12..446 + 16].copy_from_slice(&((size / 512 - 2048) as u32).to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xaa;
    write_file(&img2, &mbr);
    OpenOptions::new()
        .write(true)
        .open(&img2)
        .unwrap()
        .set_len(size)
        .unwrap();
    let lo = match Loop::attach(&img2, true) {
        Ok(lo) => lo,
        Err(why) => {
            eprintln!("note: skipping the partition test: {why}");
            return;
        }
    };
    let part = PathBuf::from(format!("{}p1", lo.0.display()));
    if !part.exists() {
        // Kernels without msdos partition parsing: add the partition with BLKPG.
        let _ = run("partx", &["-a", lo.0.to_str().unwrap()]);
    }
    for _ in 0..50 {
        if part.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    if !part.exists() {
        eprintln!("note: skipping the partition test: {part:?} did not appear");
        return;
    }
    let reason = backing_reason(BackingDevice::create(&lo.0, None, MIB, false).unwrap_err());
    assert!(reason.contains("dos partition table"), "{reason}");
    match mkfs_and_mount(&part, &dir.path("pmnt")) {
        Ok(mount) => {
            let mp = mounted_at(&lo.0).unwrap();
            assert_eq!(mp.as_deref(), dir.path("pmnt").to_str());
            let reason = backing_reason(BackingDevice::create(&lo.0, None, MIB, true).unwrap_err());
            assert!(reason.contains(&part.display().to_string()), "{reason}");
            assert!(reason.contains("mounted at"), "{reason}");
            drop(mount);
        }
        Err(why) => eprintln!("note: skipping the mounted-partition part: {why}"),
    }
    drop(lo);
}

#[test]
fn open_errors_name_the_limit_or_the_mode() {
    let p = Path::new("/pools/d29.pool");
    for errno in [libc::EMFILE, libc::ENFILE] {
        let m = open_error(p, BackingKind::File, io::Error::from_raw_os_error(errno)).to_string();
        assert!(m.contains("d29.pool") && m.contains("ulimit -n"), "{m}");
    }
    let m = open_error(
        p,
        BackingKind::File,
        io::Error::from_raw_os_error(libc::EACCES),
    )
    .to_string();
    assert!(
        m.contains("read-write") && m.contains("run as a user"),
        "{m}"
    );
}

/// A loop device attached (by root) over a pool file a writer holds used to
/// let a second writer in through /dev/loopN (the device's lock is another
/// inode's): it is refused now, naming the file and its holder, for readers
/// too; and once the loop device holds the file, the file is refused by its
/// own name.
#[test]
fn a_loop_device_over_a_held_pool_file_is_refused_and_the_reverse() {
    let dir = TempDir::new("loopheld");
    let img = dir.path("pool.img");
    let held = BackingDevice::create(&img, Some(8 * MIB), MIB, false).unwrap();
    write_magic(&held);
    let lo = match Loop::attach(&img, false) {
        Ok(lo) => lo,
        Err(why) => {
            eprintln!("note: skipping the loop-over-a-pool-file test: {why}");
            return;
        }
    };
    for access in [Access::Exclusive, Access::Shared] {
        let reason = backing_reason(BackingDevice::open_with(&lo.0, access).unwrap_err());
        assert!(
            reason.contains("loop device over") && reason.contains("pool.img"),
            "{access:?}: {reason}"
        );
        assert!(reason.contains("in use"), "{access:?}: {reason}");
    }
    drop(held);
    let via = BackingDevice::open(&lo.0).unwrap();
    let reason = backing_reason(BackingDevice::open(&img).unwrap_err());
    assert!(reason.contains("backing file of loop device"), "{reason}");
    drop(via);
    drop(lo);
}
