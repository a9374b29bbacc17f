//! The process around the handles: fork (a child has the handles' memory
//! but not their I/O threads) and interpreter exit (daemon threads inside
//! kvtier calls must not be unwound through Rust frames).

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Once;
use std::time::Duration;

/// fork()s this process has gone through, counted in the child.
pub(crate) static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Set by an atexit hook: the interpreter is exiting.
pub(crate) static EXITING: AtomicBool = AtomicBool::new(false);
/// The thread that ran the hook (the one finalizing the interpreter).
pub(crate) static EXIT_TID: AtomicI64 = AtomicI64::new(0);

#[pyfunction]
pub(crate) fn _mark_exiting() {
    // SAFETY: gettid has no preconditions.
    EXIT_TID.store(unsafe { libc::gettid() } as i64, Ordering::SeqCst);
    EXITING.store(true, Ordering::SeqCst);
}

/// Whether the interpreter has begun exiting (kvtier's atexit hook ran):
/// threads other than the exiting one no longer come back from kvtier calls.
#[pyfunction]
pub(crate) fn _exiting() -> bool {
    EXITING.load(Ordering::SeqCst)
}

/// While above zero, threads come back from kvtier calls even though the
/// interpreter is exiting: an exit handler is waiting for them (blocked in
/// a join, without the GIL), so they retake the GIL before finalization
/// starts. Raised and lowered by `_exit_grace`.
pub(crate) static EXIT_GRACE: AtomicU64 = AtomicU64::new(0);

/// Enter (`True`) or leave (`False`) a stretch of an exit handler that
/// waits for threads inside kvtier calls (KvtierL2.close joining its
/// workers): while in it, they finish their calls instead of parking.
#[pyfunction]
pub(crate) fn _exit_grace(on: bool) {
    if on {
        EXIT_GRACE.fetch_add(1, Ordering::SeqCst);
    } else {
        let _ = EXIT_GRACE.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| g.checked_sub(1));
    }
}

/// Run `f` with the GIL released. Once the interpreter is exiting, a thread
/// other than the one finalizing it never takes the GIL back: CPython up to
/// 3.13 ends such a (daemon) thread with pthread_exit as it retakes the GIL,
/// and that forced unwind through Rust frames aborts the whole process
/// ("FATAL: exception not rethrown") instead of letting it exit. The thread
/// parks until the process is gone; its call never returns, as CPython
/// would have it. (3.14 parks such threads itself; the hook is not set there.)
pub(crate) fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.allow_threads(|| {
        let r = f();
        // SAFETY: gettid has no preconditions.
        if EXITING.load(Ordering::SeqCst)
            && unsafe { libc::gettid() } as i64 != EXIT_TID.load(Ordering::SeqCst)
        {
            while EXIT_GRACE.load(Ordering::SeqCst) == 0 {
                std::thread::park_timeout(Duration::from_millis(5));
            }
        }
        r
    })
}

/// Count forks in the child, and (before 3.14) mark the interpreter's exit
/// before it ends daemon threads (see [`without_gil`]).
pub(crate) fn install(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    static AT_FORK: Once = Once::new();
    // SAFETY: the child handler only increments an atomic.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(count_fork_in_child));
    });
    let vi = py.import("sys")?.getattr("version_info")?;
    let version: (u32, u32) = (vi.get_item(0)?.extract()?, vi.get_item(1)?.extract()?);
    if version < (3, 14) {
        py.import("atexit")?
            .getattr("register")?
            .call1((wrap_pyfunction!(_mark_exiting, m)?,))?;
    }
    m.add_function(wrap_pyfunction!(_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(_exit_grace, m)?)?;
    Ok(())
}
