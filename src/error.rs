//! One error type for the whole crate.
//!
//! Every variant's message names the thing that is wrong and, where there is one,
//! the fix: a user of a storage engine should never have to read the source to
//! learn why a pool did not open.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model description (config.json, preset name, geometry flag) that cannot be used.
    #[error("model config {source_name}: {reason}")]
    ModelConfig { source_name: String, reason: String },

    /// A pool opened with a geometry or namespace other than the one it was created with.
    #[error("pool {path}: {reason}")]
    GeometryMismatch { path: PathBuf, reason: String },

    /// A backing file or block device that cannot hold (or cannot be) a pool.
    #[error("backing device {path}: {reason}")]
    Backing { path: PathBuf, reason: String },

    /// A superblock or header that fails its checks.
    #[error("pool {path}: corrupted {what}: {reason}")]
    Corrupt {
        path: PathBuf,
        what: String,
        reason: String,
    },

    /// Engine memory that cannot be registered for direct I/O.
    #[error("KV memory registration: {0}")]
    Registration(String),

    /// A key the pool does not hold.
    #[error(
        "key {key} is not in the pool; call lookup_prefix first and load only the keys it counts"
    )]
    UnknownKey { key: String },

    /// Nothing can be evicted to make room.
    #[error("pool full: {needed} block(s) needed, {free} free, {reserved} being written by stores in flight, and every stored block is pinned ({pinned} pinned); unpin finished loads, wait for stores, or create a larger pool")]
    PoolFull {
        needed: u64,
        free: u64,
        pinned: u64,
        reserved: u64,
    },

    /// An argument out of its range (block ids, layer ranges, job ids, sizes).
    #[error("{0}")]
    InvalidArgument(String),

    /// An I/O that the device or kernel failed or completed short.
    #[error("I/O error on device {device} at offset {offset} ({len} bytes): {reason}")]
    Device {
        device: String,
        offset: u64,
        len: u64,
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
        what: String,
        reason: String,
        code: Option<u32>,
    },

    /// A plain OS error with what we were doing when it happened.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// A GPU error that is not a driver return code (a check of ours).
    pub fn gpu(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Gpu {
            what: what.into(),
            reason: reason.into(),
            code: None,
        }
    }

    /// The CUresult of a failed CUDA driver call, if this is one.
    pub fn cuda_code(&self) -> Option<u32> {
        match self {
            Error::Gpu { code, .. } => *code,
            _ => None,
        }
    }
}

/// Attach context to `std::io::Result`s.
pub trait IoContext<T> {
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
