//! kvtier's errors as Python exceptions: one class per [`ErrorKind`],
//! carrying the kind and, for device failures, the I/O.

use kvtier::error::{Error, ErrorKind, Failure, Fix};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(
    _kvtier,
    KvtierError,
    PyException,
    "Base of every kvtier error."
);
create_exception!(
    _kvtier,
    UsageError,
    KvtierError,
    "The call was wrong: fix it; retrying unchanged fails again."
);
create_exception!(
    _kvtier,
    BackpressureError,
    KvtierError,
    "A bounded queue is full; nothing was accepted: retry after jobs finish or pins are dropped."
);
create_exception!(
    _kvtier,
    IoError,
    KvtierError,
    "A device, the kernel or the driver failed an I/O; `io` says which."
);
create_exception!(
    _kvtier,
    CorruptError,
    KvtierError,
    "Stored data or metadata fails its checks: treat the blocks as missing."
);
create_exception!(
    _kvtier,
    UnsupportedError,
    KvtierError,
    "Not available with this build, engine or machine."
);
create_exception!(_kvtier, ClosedError, KvtierError, "The handle is closed.");
create_exception!(
    _kvtier,
    InternalError,
    KvtierError,
    "kvtier's own bookkeeping failed (a bug): report it."
);

pub(crate) fn kind_name(k: ErrorKind) -> &'static str {
    match k {
        ErrorKind::Usage => "usage",
        ErrorKind::Backpressure => "backpressure",
        ErrorKind::Io => "io",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Closed => "closed",
        ErrorKind::Internal => "internal",
    }
}

pub(crate) fn exception_for(kind: ErrorKind, msg: String) -> PyErr {
    match kind {
        ErrorKind::Usage => UsageError::new_err(msg),
        ErrorKind::Backpressure => BackpressureError::new_err(msg),
        ErrorKind::Io => IoError::new_err(msg),
        ErrorKind::Corrupt => CorruptError::new_err(msg),
        ErrorKind::Unsupported => UnsupportedError::new_err(msg),
        ErrorKind::Closed => ClosedError::new_err(msg),
        ErrorKind::Internal => InternalError::new_err(msg),
    }
}

/// The failure as a Python exception with `kind` and `io` attributes.
pub(crate) fn failure_err(py: Python<'_>, f: &Failure) -> PyErr {
    // Messages quote superblocks, configs and arguments: no raw control
    // characters reach a terminal that prints them.
    let err = exception_for(f.kind, kvtier::host::printable(&f.message).into_owned());
    let v = err.value(py);
    let _ = v.setattr("kind", kind_name(f.kind));
    let io = f.io.as_ref().map(|io| {
        let d = PyDict::new(py);
        let _ = d.set_item("device", &io.device);
        let _ = d.set_item("offset", io.offset);
        let _ = d.set_item("len", io.len);
        let _ = d.set_item("op", io.op);
        let _ = d.set_item("cause", format!("{:?}", io.cause));
        d
    });
    let _ = v.setattr("io", io);
    err
}

/// The error as a Python exception; a fix the library names by its meaning
/// (`Fix`) is said as the Python API's call that makes it.
pub(crate) fn to_py(e: Error) -> PyErr {
    let f = match e.fix() {
        Some(fix) => {
            let mut f = Failure::from(e.without_fix());
            f.message = format!("{}; {}", f.message, fix_text(fix));
            f
        }
        None => Failure::from(e),
    };
    Python::with_gil(|py| failure_err(py, &f))
}

/// A fix in the Python API's words.
fn fix_text(fix: &Fix) -> String {
    const ALWAYS: &str = "TierBuilder.create(\"always\")";
    match fix {
        Fix::Overwrite => format!("call {ALWAYS} to overwrite it (its contents will be lost)"),
        Fix::AllowSparse => format!("call {ALWAYS} to create it sparse anyway"),
        Fix::Truncate { to, .. } => format!(
            "call {ALWAYS} to truncate it to {to} bytes, or give a capacity() that keeps it"
        ),
        Fix::GiveSize {
            multiple_of,
            at_least,
        } => format!(
            "give capacity() (per file a multiple of {multiple_of} bytes, at least {at_least} bytes)"
        ),
        Fix::AlignSize { .. } => {
            "give a capacity() that is a multiple of 4096 bytes per file".into()
        }
        Fix::SmallerSize => "give a smaller capacity()".into(),
        Fix::LargerSize => "give a larger capacity()".into(),
        Fix::Recreate => {
            format!("recreate the pool with {ALWAYS} (every block stored in it is lost)")
        }
        Fix::RerunCreate => format!("build it again (no {ALWAYS} needed)"),
        Fix::CreatePool => "create one: TierBuilder().directory(...).capacity(...)".into(),
        Fix::NameDType => "pass dtype= to geometry() or model()".into(),
        Fix::RestoreOrRecreate => format!(
            "restore the missing or replaced file(s), or recreate the pool with {ALWAYS} (every block stored in it is lost)"
        ),
        Fix::GiveCapacity { at_least } => format!("give at least capacity({at_least})"),
        other => other.to_string(),
    }
}

pub(crate) fn usage(msg: impl Into<String>) -> PyErr {
    to_py(Error::invalid(msg))
}

/// The exception classes, as module attributes.
pub(crate) fn add_exceptions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    m.add("BackpressureError", py.get_type::<BackpressureError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
