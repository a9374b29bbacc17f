//! Scratch files: files a command creates for its own use (benchmark pools,
//! fio's test file, replay's pool) and removes when it is done.
//!
//! The rules, so that a benchmark never destroys what it was not given:
//! - a scratch file is created new (`O_CREAT | O_EXCL | O_NOFOLLOW`): an
//!   existing file, or a symlink planted at its name, is refused, never
//!   reused, truncated or followed;
//! - only the file this process created is removed: at removal the name
//!   must still be a regular file with the device and inode that were
//!   created, so a file someone put in its place is left alone (the file is
//!   held open until then, so its inode number cannot be reused by another);
//! - removal happens on drop (success and error paths alike) and, for
//!   SIGINT, SIGTERM and SIGHUP left at their default action, from a signal
//!   handler before the process dies of the signal as it would have; a
//!   signal the process already handles or ignores is never taken over.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

/// A file this process created and will remove (unless kept).
#[derive(Debug)]
pub struct ScratchFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
    keep: bool,
    slot: Option<usize>,
    /// Held open so no other file can get this inode number while the name
    /// may still be removed.
    file: File,
}

impl ScratchFile {
    /// Creates `path` new (mode 0600), refusing an existing file or symlink.
    /// `what` names the command for the error ("kvtier bench").
    pub fn create_new(path: &Path, what: &str) -> Result<ScratchFile> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.kind() {
                ErrorKind::AlreadyExists => Error::Backing {
                    path: path.to_path_buf(),
                    reason: format!(
                        "already exists; {what} creates its scratch files new and never \
                         overwrites or removes a file it did not create: move or remove it"
                    ),
                }
                .with_fix(crate::error::Fix::OtherDirectory),
                ErrorKind::NotFound => Error::Backing {
                    path: path.to_path_buf(),
                    reason: "its directory does not exist".into(),
                },
                _ => Error::io(format!("creating {}", path.display()), e),
            })?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
        let mut s = ScratchFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
            keep: false,
            slot: None,
            file,
        };
        s.slot = register(&s.path, s.dev, s.ino);
        Ok(s)
    }

    /// The file, open read-write.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// A second descriptor of the file and its path (one open file
    /// description: lock and mode are shared), so the file is used through
    /// what was created, never reopened by a name that may have been swapped.
    pub fn descriptor(&self) -> Result<(File, PathBuf)> {
        let f = self.file.try_clone().map_err(|e| {
            Error::io(
                format!("duplicating the descriptor of {}", self.path.display()),
                e,
            )
        })?;
        Ok((f, self.path.clone()))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `file` is the very file this created (same device and inode).
    pub fn is(&self, file: &File) -> bool {
        file.metadata()
            .is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino)
    }

    /// Whether the open descriptor `fd` is the file this created.
    pub fn is_fd(&self, fd: impl std::os::fd::AsFd) -> bool {
        nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_dev == self.dev && st.st_ino == self.ino)
    }

    /// Leave the file in place when this is dropped (`--keep`).
    pub fn keep(&mut self) {
        self.keep = true;
        self.unregister();
    }

    fn unregister(&mut self) {
        if let Some(i) = self.slot.take() {
            SLOTS[i].store(std::ptr::null_mut(), Ordering::SeqCst);
        }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        self.unregister();
        if !self.keep {
            remove_if_same(&self.path, self.dev, self.ino);
        }
    }
}

/// Removes `path` only if it is still the regular file (dev, ino).
fn remove_if_same(path: &Path, dev: u64, ino: u64) {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.file_type().is_file() && m.dev() == dev && m.ino() == ino {
            let _ = std::fs::remove_file(path);
        }
    }
}

// ---------------------------------------------------------------------------
// Removal on SIGINT / SIGTERM / SIGHUP.
//
// The handler may run on any thread at any time, so what it reads is set up
// beforehand and never freed: each live scratch file has a leaked entry (its
// path as a C string, device, inode) in a fixed table of atomic pointers.
// lstat and unlink are async-signal-safe.

struct Entry {
    path: CString,
    dev: u64,
    ino: u64,
}

const MAX_SLOTS: usize = 64;
static SLOTS: [AtomicPtr<Entry>; MAX_SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_SLOTS];
static HANDLERS: AtomicBool = AtomicBool::new(false);

fn register(path: &Path, dev: u64, ino: u64) -> Option<usize> {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let cpath = CString::new(abs.as_os_str().as_bytes()).ok()?;
    let entry = Box::into_raw(Box::new(Entry {
        path: cpath,
        dev,
        ino,
    }));
    install_handlers();
    for (i, s) in SLOTS.iter().enumerate() {
        if s.compare_exchange(
            std::ptr::null_mut(),
            entry,
            Ordering::SeqCst,
            Ordering::SeqCst,
        )
        .is_ok()
        {
            return Some(i);
        }
    }
    // Table full: the file is still removed on drop, just not on a signal.
    // SAFETY: `entry` came from Box::into_raw above and was never shared.
    drop(unsafe { Box::from_raw(entry) });
    None
}

fn install_handlers() {
    if HANDLERS.swap(true, Ordering::SeqCst) {
        return;
    }
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a handler that only calls async-signal-safe functions.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESETHAND;
            // Only a signal that would kill the process as it stands gets
            // our handler: one the parent set to be ignored stays ignored,
            // and one the embedding program handles (Python's
            // KeyboardInterrupt, a server's graceful SIGTERM) stays its own;
            // the file is then removed on drop as that program unwinds.
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old);
            if old.sa_sigaction == libc::SIG_DFL {
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    for s in &SLOTS {
        let e = s.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if e.is_null() {
            continue;
        }
        // SAFETY: entries are leaked, never freed, once published.
        let e = unsafe { &*e };
        // SAFETY: lstat/unlink with a NUL-terminated path; both are
        // async-signal-safe.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::lstat(e.path.as_ptr(), &mut st) == 0
                && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
                && st.st_dev as u64 == e.dev
                && st.st_ino as u64 == e.ino
            {
                libc::unlink(e.path.as_ptr());
            }
        }
    }
    // SA_RESETHAND restored the default action: die of the signal as the
    // caller expects (a shell sees 128 + sig).
    // SAFETY: raise is async-signal-safe.
    unsafe {
        libc::raise(sig);
    }
}

/// A directory for one test's files, `kvtier-TAG-PID-NANOS` under
/// `$KVTIER_TEST_DIR` or the system's temporary directory, removed with
/// everything in it when dropped. Test support (shared by the crates' unit
/// and integration tests), not for commands: they use [`ScratchFile`].
#[doc(hidden)]
pub struct TestDir(pub std::path::PathBuf);

impl TestDir {
    /// Make a new one; panics if it cannot (a test's setup failing).
    pub fn new(tag: &str) -> TestDir {
        let base = std::env::var_os("KVTIER_TEST_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let p = base.join(format!("kvtier-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p)
            .unwrap_or_else(|e| panic!("making test directory {}: {e}", p.display()));
        TestDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A path for `name` inside it.
    pub fn file(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kvtier-scratch-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn created_new_and_removed_on_drop() {
        let d = dir("drop");
        let p = d.join("a.pool");
        let s = ScratchFile::create_new(&p, "test").unwrap();
        assert!(s.is(s.file()));
        assert!(p.exists());
        drop(s);
        assert!(!p.exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn existing_file_and_symlink_are_refused_and_kept() {
        let d = dir("refuse");
        let p = d.join("a.pool");
        std::fs::write(&p, b"precious").unwrap();
        let e = ScratchFile::create_new(&p, "kvtier bench").unwrap_err();
        assert!(e.to_string().contains("already exists"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"precious");
        let target = d.join("target");
        std::fs::write(&target, b"keep me").unwrap();
        let link = d.join("b.pool");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(ScratchFile::create_new(&link, "kvtier bench").is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_replaced_file_is_not_removed() {
        let d = dir("replaced");
        let p = d.join("a.pool");
        let s = ScratchFile::create_new(&p, "test").unwrap();
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"someone else's").unwrap();
        drop(s);
        assert_eq!(std::fs::read(&p).unwrap(), b"someone else's");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
