//! Finished jobs and completion events as Python objects.

use crate::args::key_bytes;
use crate::errors::failure_err;
use kvtier::handle::Event;
use kvtier::tier::{JobKind, JobResult, KeyOutcome};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A finished job: per-key outcomes, and the keys a store evicted.
#[pyclass(module = "kvtier._kvtier", frozen, get_all)]
pub struct JobResultPy {
    job: u64,
    /// "load" or "store".
    kind: &'static str,
    keys: Vec<Py<PyBytes>>,
    /// Per key: "done", "already_stored" or "failed".
    outcomes: Vec<&'static str>,
    /// Per key: None, or the failure as an exception (not raised).
    errors: Vec<Option<PyObject>>,
    evicted: Vec<Py<PyBytes>>,
}

#[pymethods]
impl JobResultPy {
    /// Every key done (or already stored).
    #[getter]
    fn ok(&self) -> bool {
        self.errors.iter().all(Option::is_none)
    }

    /// Raise the first key's failure, if any.
    fn raise_for_failure(&self, py: Python<'_>) -> PyResult<()> {
        match self.errors.iter().flatten().next() {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        let failed = self.errors.iter().filter(|e| e.is_some()).count();
        format!(
            "JobResult(job={}, kind={}, keys={}, failed={failed}, evicted={})",
            self.job,
            self.kind,
            self.keys.len(),
            self.evicted.len()
        )
    }
}

pub(crate) fn result_py(py: Python<'_>, r: JobResult) -> JobResultPy {
    JobResultPy {
        job: r.job,
        kind: match r.kind {
            JobKind::Load => "load",
            JobKind::Store => "store",
        },
        keys: r.keys.iter().map(|k| key_bytes(py, k).unbind()).collect(),
        outcomes: r
            .outcomes
            .iter()
            .map(|o| match o {
                KeyOutcome::Done => "done",
                KeyOutcome::AlreadyStored => "already_stored",
                KeyOutcome::Failed(_) => "failed",
                KeyOutcome::Corrupt(_) => "corrupt",
            })
            .collect(),
        errors: r
            .outcomes
            .iter()
            .map(|o| match o {
                KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => {
                    Some(failure_err(py, f).into_value(py).into_any())
                }
                _ => None,
            })
            .collect(),
        evicted: r
            .evicted
            .iter()
            .map(|k| key_bytes(py, k).unbind())
            .collect(),
    }
}

/// A completion: layer `layer` of load `job` is in memory (or failed), or
/// `job` finished.
#[pyclass(module = "kvtier._kvtier", frozen, get_all)]
pub struct EventPy {
    /// "layer" or "finished".
    kind: &'static str,
    job: u64,
    /// The layer, for "layer" events.
    layer: Option<u32>,
    /// "load" or "store", for "finished" events.
    job_kind: Option<&'static str>,
    ok: bool,
    /// The failure as an exception (not raised), when not ok.
    error: Option<PyObject>,
}

#[pymethods]
impl EventPy {
    fn __repr__(&self) -> String {
        match self.kind {
            "layer" => format!(
                "Event(layer {} of job {}, ok={})",
                self.layer.unwrap_or(0),
                self.job,
                self.ok
            ),
            _ => format!("Event(job {} finished, ok={})", self.job, self.ok),
        }
    }
}

pub(crate) fn event_py(py: Python<'_>, e: Event) -> EventPy {
    match e {
        Event::Layer { job, layer, error } => EventPy {
            kind: "layer",
            job,
            layer: Some(layer),
            job_kind: None,
            ok: error.is_none(),
            error: error.map(|f| failure_err(py, &f).into_value(py).into_any()),
        },
        Event::Finished { job, kind, ok } => EventPy {
            kind: "finished",
            job,
            layer: None,
            job_kind: Some(match kind {
                JobKind::Load => "load",
                JobKind::Store => "store",
            }),
            ok,
            error: None,
        },
    }
}
