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

pub(crate) fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| failure_err(py, &failure_of(e)))
}

/// The failure, its fix (where the library gives one as a thing) said with
/// the Python TierBuilder's calls.
fn failure_of(e: Error) -> Failure {
    match e {
        Error::PoolPlace { path, reason, fix } => Failure::new(
            ErrorKind::Usage,
            format!("pool {}: {reason}; {}", path.display(), fix_words(&fix)),
        ),
        other => Failure::from(other),
    }
}

/// A library [`Fix`] in the words of the Python TierBuilder.
fn fix_words(fix: &Fix) -> String {
    match fix {
        Fix::RestoreOrReformat => "restore the missing file(s), or format the pool anew (its \
             blocks are lost) with create(\"always\")"
            .into(),
        Fix::Capacity { at_least } => format!("give at least capacity({at_least})"),
    }
}

/// [`to_py`] for errors of opening a pool or reading a model. The pool's
/// own checks (backing files, superblocks) and the model parser still name
/// the CLI's flags in their messages; until they give their fix as a
/// thing, as the pool policy's [`Error::PoolPlace`] does, name the
/// TierBuilder call that does the same.
pub(crate) fn to_py_builder(e: Error) -> PyErr {
    let mut f = failure_of(e);
    for (cli, py) in [
        (
            "run that `kvtier pool create` again (it needs no --force)",
            "build it again (no create(\"always\") needed)",
        ),
        (
            "run that create again (it needs no --force)",
            "build it again (no create(\"always\") needed)",
        ),
        (
            "`kvtier pool create --force`",
            "TierBuilder().create(\"always\")",
        ),
        (
            "`kvtier pool create`",
            "TierBuilder().create(\"always\").capacity(...)",
        ),
        ("pass --force", "call create(\"always\")"),
        ("--force", "create(\"always\")"),
        ("--size", "capacity()"),
        ("pass --dtype", "pass dtype= to model()"),
        ("--dtype", "model(dtype=)"),
        ("--model", "model()"),
    ] {
        f.message = f.message.replace(cli, py);
    }
    Python::with_gil(|py| failure_err(py, &f))
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
