//! One error type for the whole crate.
//!
//! Every variant's message names the thing that is wrong and, where there is one,
//! the fix: a user of a storage engine should never have to read the source to
//! learn why a pool did not open.
//!
//! A program acts on [`Error::kind`] (and, for I/O, on [`IoFailure`]), never on
//! the text: retry later on [`ErrorKind::Backpressure`], fix the call on
//! [`ErrorKind::Usage`], treat the blocks as missing on [`ErrorKind::Io`] and
//! [`ErrorKind::Corrupt`]. Per-key outcomes and per-layer events carry the same
//! structure as a [`Failure`].

use std::fmt;
use std::path::PathBuf;

/// kvtier's result: [`Error`] unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything kvtier can fail with; each message names the thing and the fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model description (config.json, preset name, geometry flag) that cannot be used.
    #[error("model config {source_name}: {reason}")]
    ModelConfig {
        /// The file, preset or flag.
        source_name: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A pool opened with a geometry or namespace other than the one it was created with.
    #[error("pool {path}: {reason}")]
    GeometryMismatch {
        /// The pool's first device.
        path: PathBuf,
        /// What differs.
        reason: String,
    },

    /// A backing file or block device that cannot hold (or cannot be) a pool.
    #[error("backing device {path}: {reason}")]
    Backing {
        /// The file or block device.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },

    /// A superblock or header that fails its checks.
    #[error("pool {path}: corrupted {what}: {reason}")]
    Corrupt {
        /// The device.
        path: PathBuf,
        /// The structure (superblock, header).
        what: String,
        /// The check it fails.
        reason: String,
    },

    /// Engine memory that cannot be registered for direct I/O.
    #[error("KV memory registration: {0}")]
    Registration(String),

    /// A key the pool does not hold.
    #[error(
        "key {key} is not in the pool; call lookup_prefix first and load only the keys it counts"
    )]
    UnknownKey {
        /// The key, as text.
        key: String,
    },

    /// Nothing can be evicted to make room.
    #[error("pool full: {needed} block(s) needed, {free} free, {reserved} being written by stores in flight, {pinned} stored block(s) pinned by loads and none unpinned to evict{}; unpin finished loads, wait for stores, or create a larger pool", retired_note(*.retired))]
    PoolFull {
        /// Blocks the request needs.
        needed: u64,
        /// Blocks free.
        free: u64,
        /// Blocks pinned by loads.
        pinned: u64,
        /// Blocks held by stores in flight.
        reserved: u64,
        /// Slots retired after device errors (capacity lost for good).
        retired: u64,
    },

    /// An argument out of its range (block ids, layer ranges, job ids, sizes).
    #[error("{0}")]
    InvalidArgument(String),

    /// An I/O that the device or kernel failed or completed short.
    #[error("I/O error on device {device} at offset {offset} ({len} bytes): {reason}")]
    Device {
        /// The device's path or name.
        device: String,
        /// Byte offset of the I/O.
        offset: u64,
        /// Bytes of the I/O.
        len: u64,
        /// What the device or kernel said.
        reason: String,
    },

    /// The gio_uring ring has no free IOCB or its queues are full.
    #[error("gio_uring: {0}")]
    Ring(String),

    /// The CUDA driver or a GPU resource: `what` names the call or the thing,
    /// `reason` the driver's error (name and text) and, where there is one,
    /// the fix; `code` is the raw CUresult when the driver returned one.
    #[error("GPU: {what}: {reason}")]
    Gpu {
        /// The call or the thing.
        what: String,
        /// The driver's error and the fix.
        reason: String,
        /// The raw CUresult, when the driver returned one.
        code: Option<u32>,
    },

    /// A plain OS error with what we were doing when it happened.
    #[error("{context}: {source}")]
    Io {
        /// What kvtier was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// Try again later: a bounded queue (the write backlog, header staging)
    /// is full. Nothing of the refused request was accepted.
    #[error("{0}")]
    Backpressure(String),

    /// What was asked for is not available with this build, engine or machine.
    #[error("{0}")]
    Unsupported(String),

    /// Data that reached memory but does not match what was stored (a
    /// checksum mismatch): the block must be treated as missing.
    #[error("corrupt data for key {key} on device {device} at offset {offset}: {message}")]
    CorruptData {
        /// The key, as text.
        key: String,
        /// The device's path or name.
        device: String,
        /// Byte offset of the block.
        offset: u64,
        /// What did not match.
        message: String,
    },

    /// A job's I/O (or a whole job) failed; the failure says which and why.
    #[error("{0}")]
    Failed(Failure),

    /// The handle was closed, or its I/O thread is gone.
    #[error("{0}")]
    Closed(String),

    /// kvtier's own bookkeeping broke an invariant (a bug, not the caller's
    /// doing): report it with the message.
    #[error("internal error (a kvtier bug; please report it): {0}")]
    Internal(String),

    /// An error and the change that gets past it; [`Error::fix`] gives the
    /// change, which each front end names in its own words.
    #[error("{error}; {fix}")]
    WithFix {
        /// The error.
        error: Box<Error>,
        /// What to change.
        fix: Fix,
    },
}

/// What to change to get past an error, by meaning: the library says it in
/// its API's terms ([`fmt::Display`]), the command line names its flags and
/// the Python bindings their builder calls. A message never names a front
/// end's flag; the front end renders the fix instead.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub enum Fix {
    /// Allow overwriting what the device or file holds (its contents are lost).
    Overwrite,
    /// Allow creating the pool file sparse on a file system that cannot preallocate.
    AllowSparse,
    /// Either allow shrinking the file to `to` bytes, or ask for `or_size` bytes.
    Truncate {
        /// The size asked for.
        to: u64,
        /// The size that keeps the file as it is.
        or_size: u64,
    },
    /// Give the pool file a size (a multiple of `multiple_of`, at least `at_least` bytes).
    GiveSize {
        /// The direct-I/O alignment.
        multiple_of: u64,
        /// The smallest size that holds a pool.
        at_least: u64,
    },
    /// Ask for a size that is a multiple of the direct-I/O alignment, e.g. `example` bytes.
    AlignSize {
        /// A size that would do.
        example: u64,
    },
    /// Ask for a smaller size.
    SmallerSize,
    /// Ask for a larger size.
    LargerSize,
    /// Create the pool again over this one (every block stored in it is lost).
    Recreate,
    /// Run the create that did not finish again; it needs no overwrite permission.
    RerunCreate,
    /// Create a pool there (nothing there is a pool yet).
    CreatePool,
    /// Name the KV element type explicitly.
    NameDType,
    /// Use PRP data pointers on this NVMe controller (it has no SGL support).
    UsePrp,
    /// Hand NVMe controller `addr` to a userspace driver (vfio-pci, uio_pci_generic) for the run.
    BindController {
        /// Its PCI address.
        addr: String,
    },
    /// Allow binding a device the checks refused (it may not be what was meant).
    ForceBind,
    /// Make a slack table for this geometry at block size `block_size` with kvtier's profiler.
    ProfileSlackTable {
        /// The block size the table must be made for.
        block_size: u32,
    },
    /// Choose another directory.
    OtherDirectory,
    /// Restore a pool's missing or replaced files, or create the pool anew
    /// over them (every block stored in it is lost).
    RestoreOrRecreate,
    /// Give the pool a total capacity of at least `at_least` bytes.
    GiveCapacity {
        /// The least capacity that makes the pool.
        at_least: u64,
    },
}

impl fmt::Display for Fix {
    /// The fix in the library's terms (its config fields and calls).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fix::Overwrite => {
                f.write_str("set PoolConfig::force to overwrite it (its contents will be lost)")
            }
            Fix::AllowSparse => f.write_str("set PoolConfig::force to create it sparse anyway"),
            Fix::Truncate { to, or_size } => write!(
                f,
                "set PoolConfig::force to truncate it to {to} bytes, or ask for {or_size} bytes"
            ),
            Fix::GiveSize {
                multiple_of,
                at_least,
            } => write!(
                f,
                "give it a size (DeviceSpec::size: a multiple of {multiple_of} bytes, at least {at_least} bytes)"
            ),
            Fix::AlignSize { example } => {
                write!(f, "ask for a size that is, e.g. {example} bytes")
            }
            Fix::SmallerSize => f.write_str("ask for a smaller size"),
            Fix::LargerSize => f.write_str("ask for a larger size"),
            Fix::Recreate => f.write_str(
                "create the pool again with PoolConfig::force (every block stored in it is lost)",
            ),
            Fix::RerunCreate => {
                f.write_str("run that create again (it needs no PoolConfig::force)")
            }
            Fix::CreatePool => f.write_str("create a pool there first (Pool::create)"),
            Fix::NameDType => f.write_str("name the KV dtype (KvGeometry::dtype)"),
            Fix::UsePrp => f.write_str("use PRP data pointers (DataMode::Prp or Auto)"),
            Fix::BindController { addr } => write!(
                f,
                "hand {addr} to a userspace driver (vfio-pci or uio_pci_generic) for the run"
            ),
            Fix::ForceBind => f.write_str("force the bind to bind it anyway"),
            Fix::ProfileSlackTable { block_size } => write!(
                f,
                "use the table made for this model, or make one with kvtier's profiler at block size {block_size}"
            ),
            Fix::OtherDirectory => f.write_str("pick another directory"),
            Fix::RestoreOrRecreate => f.write_str(
                "restore the missing or replaced file(s), or create the pool anew with \
                 TierBuilder::create_mode(CreateMode::Always) (every block stored in it is lost)",
            ),
            Fix::GiveCapacity { at_least } => {
                write!(f, "give at least TierBuilder::capacity({at_least})")
            }
        }
    }
}

/// What a program can do about an error; see [`Error::kind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum ErrorKind {
    /// The call was wrong (an argument, a key that is not stored, a state
    /// that does not allow it): fix the call; retrying unchanged fails again.
    Usage,
    /// A bounded resource is full (write backlog, every block pinned, header
    /// staging): retry after jobs finish or pins are dropped.
    Backpressure,
    /// A device, the kernel or the driver failed an I/O or a system call.
    Io,
    /// Stored data or metadata fails its checks.
    Corrupt,
    /// Not available with this build, engine or machine.
    Unsupported,
    /// The handle is closed.
    Closed,
    /// kvtier's own bookkeeping failed (a bug): report it.
    Internal,
}

/// Why one device I/O failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum IoCause {
    /// The kernel returned this errno.
    Errno(i32),
    /// The I/O moved `done` of its bytes.
    Short {
        /// Bytes moved.
        done: u64,
    },
    /// The NVMe controller completed the command with this status
    /// (status code type and code, as the engine reports them).
    NvmeStatus(u32),
    /// The command did not complete within the engine's timeout.
    Timeout,
    /// The engine could not build the I/O (bad segment, unknown device).
    Malformed,
}

/// One failed device I/O: where, how much, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct IoFailure {
    /// The device's path or name.
    pub device: String,
    /// Byte offset of the I/O.
    pub offset: u64,
    /// Bytes of the I/O.
    pub len: u64,
    /// "read", "write" or "flush".
    pub op: &'static str,
    /// Why it failed.
    pub cause: IoCause,
}

impl fmt::Display for IoFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = self.op;
        if op == "flush" {
            // A flush covers the device's whole write cache, not a range.
            write!(
                f,
                "I/O error on device {}: flush of its write cache failed (writes since the last flush may not be durable): ",
                self.device
            )?;
        } else {
            write!(
                f,
                "I/O error on device {} at offset {} ({} bytes): {op} failed: ",
                self.device, self.offset, self.len
            )?;
        }
        match self.cause {
            IoCause::Errno(e) if e == libc::ENOSPC => write!(
                f,
                "{}: the file system or thin device under it is full (a sparse pool file \
                 or a thin volume fills as it is written); free space there",
                std::io::Error::from_raw_os_error(e)
            ),
            IoCause::Errno(e) if op == "write" && (e == libc::EPERM || e == libc::EROFS) => {
                write!(
                    f,
                    "{}: the device or its file system was made read-only after the pool \
                     opened it (blockdev --setro, a remount); make it writable again",
                    std::io::Error::from_raw_os_error(e)
                )
            }
            IoCause::Errno(e) if e == libc::EFAULT => write!(
                f,
                "{}: the KV memory of this transfer is not mapped {} in this process (freed, \
                 resized or made read-only after it was registered?); the device is not at fault",
                std::io::Error::from_raw_os_error(e),
                if op == "read" { "writable" } else { "readable" }
            ),
            IoCause::Errno(e) => write!(f, "{}", std::io::Error::from_raw_os_error(e)),
            // A pool file's transfers end short where the file does: a
            // read past its end (cut under the pool), a write into space
            // the file system no longer has (a sparse file on a full disk).
            IoCause::Short { done } if op == "write" => write!(
                f,
                "short write: {done} of {} bytes: the file system under it filled up partway \
                 (a sparse pool file fills as it is written); free space there",
                self.len
            ),
            IoCause::Short { done } if op == "read" => write!(
                f,
                "short read: {done} of {} bytes: the file or device ends before this range (cut \
                 or shrunk under the pool); restore it to the size the pool was made with",
                self.len
            ),
            IoCause::Short { done } => write!(f, "short {op}: {done} of {} bytes", self.len),
            IoCause::NvmeStatus(s) => write!(f, "NVMe status {s:#x}"),
            IoCause::Timeout => write!(f, "timed out"),
            IoCause::Malformed => write!(f, "malformed I/O (bad segment or device)"),
        }
    }
}

/// The failure of one key of a job, or of one layer of a load: a kind to act
/// on, the I/O that failed (when one did), and a message for people.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Failure {
    /// What to do about it.
    pub kind: ErrorKind,
    /// The device I/O behind it, for I/O failures.
    pub io: Option<IoFailure>,
    /// For people.
    pub message: String,
}

impl Failure {
    /// A failure of `kind` with no device I/O behind it.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            io: None,
            message: message.into(),
        }
    }

    /// The failure of one device I/O ([`ErrorKind::Io`]).
    pub fn from_io(io: IoFailure) -> Failure {
        Failure {
            kind: ErrorKind::Io,
            message: io.to_string(),
            io: Some(io),
        }
    }

    /// Data that fails its checksum after a load.
    pub fn corrupt(key: &str, device: &str, offset: u64, message: &str) -> Failure {
        Failure::from(&Error::CorruptData {
            key: key.into(),
            device: device.into(),
            offset,
            message: message.into(),
        })
    }

    /// The same failure, with `context` put in front of its message.
    pub fn context(&self, context: impl fmt::Display) -> Failure {
        Failure {
            kind: self.kind,
            io: self.io.clone(),
            message: format!("{context}: {}", self.message),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<&Error> for Failure {
    fn from(e: &Error) -> Failure {
        match e {
            Error::Failed(f) => f.clone(),
            other => Failure::new(other.kind(), other.to_string()),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        match e {
            Error::Failed(f) => f,
            other => Failure::from(&other),
        }
    }
}

impl Error {
    /// An OS error while doing `context`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// An argument out of its range.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// A broken invariant of kvtier's own (a bug).
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// This error, carrying the change that gets past it.
    #[must_use]
    pub fn with_fix(self, fix: Fix) -> Self {
        Error::WithFix {
            error: Box::new(self),
            fix,
        }
    }

    /// The change that gets past this error, when there is one.
    pub fn fix(&self) -> Option<&Fix> {
        match self {
            Error::WithFix { fix, .. } => Some(fix),
            _ => None,
        }
    }

    /// The error without its fix: what a front end prints before its own
    /// words for [`Error::fix`].
    pub fn without_fix(&self) -> &Error {
        match self {
            Error::WithFix { error, .. } => error.without_fix(),
            other => other,
        }
    }

    /// A GPU error that is not a driver return code (a check of ours).
    pub fn gpu(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Gpu {
            what: what.into(),
            reason: reason.into(),
            code: None,
        }
    }

    /// What a program can do about this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::ModelConfig { .. }
            | Error::GeometryMismatch { .. }
            | Error::Backing { .. }
            | Error::Registration(_)
            | Error::UnknownKey { .. }
            | Error::InvalidArgument(_) => ErrorKind::Usage,
            Error::PoolFull { .. } | Error::Backpressure(_) => ErrorKind::Backpressure,
            Error::Device { .. } | Error::Io { .. } => ErrorKind::Io,
            Error::Corrupt { .. } | Error::CorruptData { .. } => ErrorKind::Corrupt,
            // A missing or too old driver is the usual GPU error; a failed
            // call on a working GPU still leaves nothing to retry.
            Error::Gpu { .. } | Error::Unsupported(_) => ErrorKind::Unsupported,
            Error::Ring(_) | Error::Internal(_) => ErrorKind::Internal,
            Error::WithFix { error, .. } => error.kind(),
            Error::Failed(f) => f.kind,
            Error::Closed(_) => ErrorKind::Closed,
        }
    }

    /// The failed device I/O behind this error, when there is one.
    pub fn io_failure(&self) -> Option<&IoFailure> {
        match self {
            Error::Failed(f) => f.io.as_ref(),
            Error::WithFix { error, .. } => error.io_failure(),
            _ => None,
        }
    }

    /// The CUresult of a failed CUDA driver call, if this is one.
    pub fn cuda_code(&self) -> Option<u32> {
        match self {
            Error::Gpu { code, .. } => *code,
            Error::WithFix { error, .. } => error.cuda_code(),
            _ => None,
        }
    }
}

/// Attach context to `std::io::Result`s.
pub trait IoContext<T> {
    /// An [`Error::Io`] that says `what` was being done.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(what(), e))
    }
}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Self {
        Error::io("system call", std::io::Error::from(e))
    }
}

/// The pool-full message's word on retired slots, when there are any.
fn retired_note(retired: u64) -> String {
    if retired == 0 {
        String::new()
    } else {
        format!(
            ", and {retired} slot(s) retired after device errors (their capacity is lost until the device is replaced or the pool recreated; `kvtier pool check` lists them)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_failures_say_whose_fault_the_errno_is() {
        let at = |op: &'static str, e: i32| {
            IoFailure {
                device: "/pool/kvtier-0.pool".into(),
                offset: 4096,
                len: 8192,
                op,
                cause: IoCause::Errno(e),
            }
            .to_string()
        };
        let m = at("read", libc::EFAULT);
        assert!(
            m.contains("not mapped writable") && m.contains("device is not at fault"),
            "{m}"
        );
        assert!(at("write", libc::EFAULT).contains("not mapped readable"));
        let m = at("write", libc::ENOSPC);
        assert!(
            m.contains("offset 4096 (8192 bytes)") && m.contains("free space"),
            "{m}"
        );
        assert!(!at("read", libc::EIO).contains("not at fault"));
        // Short transfers of a pool file say what cuts them short.
        let short = |op: &'static str| {
            IoFailure {
                device: "/pool/kvtier-0.pool".into(),
                offset: 4096,
                len: 8192,
                op,
                cause: IoCause::Short { done: 4096 },
            }
            .to_string()
        };
        let m = short("write");
        assert!(
            m.contains("4096 of 8192") && m.contains("filled up") && m.contains("free space"),
            "{m}"
        );
        let m = short("read");
        assert!(
            m.contains("4096 of 8192") && m.contains("ends before"),
            "{m}"
        );
    }

    #[test]
    fn a_fix_keeps_the_error_it_wraps() {
        let e = Error::Backing {
            path: "/pool/a".into(),
            reason: "it holds ext4".into(),
        }
        .with_fix(Fix::Overwrite);
        assert_eq!(e.kind(), ErrorKind::Usage);
        assert_eq!(e.fix(), Some(&Fix::Overwrite));
        assert_eq!(
            e.without_fix().to_string(),
            "backing device /pool/a: it holds ext4"
        );
        assert!(
            e.to_string()
                .ends_with("; set PoolConfig::force to overwrite it (its contents will be lost)"),
            "{e}"
        );
        let f = Failure::from(&e);
        assert_eq!((f.kind, f.message), (ErrorKind::Usage, e.to_string()));
        let bug = Error::internal("two jobs own block 3");
        assert_eq!(bug.kind(), ErrorKind::Internal);
        assert!(bug.to_string().contains("a kvtier bug"), "{bug}");
        assert_eq!(bug.fix(), None);
    }
}
