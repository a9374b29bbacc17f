//! The process around the handles: fork (a child has the handles' memory
//! but not their I/O threads) and interpreter exit (daemon threads inside
//! kvtier calls must not be unwound through Rust frames).

use pyo3::prelude::*;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Once;
use std::time::Duration;

/// fork()s this process has gone through, counted in the child.
pub(crate) static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
    // The threads the parent counted are not in the child (the forking one
    // held the GIL, outside any count): its exit must not wait for them.
    GIL_TAKERS.store(0, Ordering::SeqCst);
}

/// Set by an atexit hook: the interpreter is exiting.
pub(crate) static EXITING: AtomicBool = AtomicBool::new(false);
/// The thread that ran the hook (the one finalizing the interpreter).
pub(crate) static EXIT_TID: AtomicI64 = AtomicI64::new(0);

/// Threads inside a kvtier call that may still take the GIL: those that
/// decided to take it back after [`without_gil`] and do not hold it yet, and
/// those running Python code ([`run_python_code`]), which may hand the GIL
/// to another thread and take it back. Raised before the decision looks at
/// `EXITING`/`EXIT_GRACE` and lowered once the GIL is held (or the Python
/// code returned), so the hook (which sets `EXITING` first, then reads this)
/// either is seen by such a thread or sees it, and then waits for it.
static GIL_TAKERS: AtomicU64 = AtomicU64::new(0);

/// The interpreter's exit begins (kvtier's atexit hook, run by the thread
/// that finalizes, before CPython marks itself finalizing): from now on no
/// other thread takes the GIL back from a kvtier call, and those that
/// already decided to are let through before finalization can begin.
#[pyfunction]
pub(crate) fn _mark_exiting(py: Python<'_>) {
    // SAFETY: gettid has no preconditions.
    EXIT_TID.store(unsafe { libc::gettid() } as i64, Ordering::SeqCst);
    EXITING.store(true, Ordering::SeqCst);
    let_gil_takers_through(py);
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
/// Leaving the last one lets through the threads it had let go before the
/// exit handler returns (and finalization can begin).
#[pyfunction]
pub(crate) fn _exit_grace(py: Python<'_>, on: bool) {
    if on {
        EXIT_GRACE.fetch_add(1, Ordering::SeqCst);
    } else {
        let left =
            EXIT_GRACE.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| g.checked_sub(1));
        if left == Ok(1) {
            let_gil_takers_through(py);
        }
    }
}

/// Whether this thread may take the GIL back now. Once the interpreter is
/// exiting, only the thread finalizing it may (or any, in an exit grace).
fn may_retake_gil() -> bool {
    !EXITING.load(Ordering::SeqCst)
        || EXIT_GRACE.load(Ordering::SeqCst) > 0
        // SAFETY: gettid has no preconditions.
        || unsafe { libc::gettid() } as i64 == EXIT_TID.load(Ordering::SeqCst)
}

/// Count this thread in `GIL_TAKERS` if it may take the GIL now (see
/// [`may_retake_gil`]); `false` (not counted) if not.
fn count_in() -> bool {
    GIL_TAKERS.fetch_add(1, Ordering::SeqCst);
    if may_retake_gil() {
        return true;
    }
    GIL_TAKERS.fetch_sub(1, Ordering::SeqCst);
    false
}

fn count_out() {
    GIL_TAKERS.fetch_sub(1, Ordering::SeqCst);
}

/// Called with the GIL by the exiting thread: release it until no thread
/// is counted in `GIL_TAKERS` (each has left kvtier's frames, or parks at
/// its next kvtier call). Without this, such a thread could still be
/// waiting for the GIL when CPython begins finalizing, and CPython ends a
/// thread that takes the GIL then.
fn let_gil_takers_through(py: Python<'_>) {
    while GIL_TAKERS.load(Ordering::SeqCst) > 0 {
        py.allow_threads(|| std::thread::sleep(Duration::from_millis(1)));
    }
}

/// Run `f` with the GIL released: every kvtier call that blocks or does I/O
/// goes through here, and only here, to release the GIL.
///
/// Once the interpreter is exiting, a thread other than the one finalizing
/// it never takes the GIL back: CPython up to 3.13 ends such a (daemon)
/// thread with pthread_exit as it retakes the GIL once finalizing, and that
/// forced unwind reaches PyO3's trampoline, whose catch_unwind cannot stop
/// it (panic_unwind deletes the foreign exception and glibc aborts with
/// "FATAL: exception not rethrown"). The thread parks until the process is
/// gone; its call never returns, as CPython would have it. A thread that
/// decided to retake the GIL just before the exit began is waited for by
/// the exit hook (`GIL_TAKERS`), so none can still be waiting for the GIL
/// when CPython begins finalizing. (3.14 parks such threads itself; the
/// hook is not set there.) A panic in `f` is carried past the GIL's
/// retaking the same way and resumed after.
pub(crate) fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let r = py.allow_threads(|| {
        let r = panic::catch_unwind(AssertUnwindSafe(f));
        while !count_in() {
            std::thread::park_timeout(Duration::from_millis(5));
        }
        r
    });
    count_out();
    r.unwrap_or_else(|p| panic::resume_unwind(p))
}

/// Run Python code (bytecode: `json.loads`) from inside a kvtier call. The
/// eval loop hands the GIL to waiting threads and takes it back, which at
/// exit is [`without_gil`]'s hazard: so once the interpreter is exiting, a
/// thread other than the finalizing one parks before running any (its
/// call never returns), and the exit hook waits for those already in it.
pub(crate) fn run_python_code<T>(py: Python<'_>, f: impl FnOnce() -> T) -> T {
    while !count_in() {
        // Exiting: park without the GIL (back only in an exit grace).
        without_gil(py, || ());
    }
    struct CountOut;
    impl Drop for CountOut {
        fn drop(&mut self) {
            count_out();
        }
    }
    let _out = CountOut;
    f()
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
