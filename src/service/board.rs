//! A service client's job table: what its jobs have done (layers in memory
//! or failed, copies queued, results), the waits on it, and the
//! [`Completions`] streams it feeds. One shape for both clients: the host
//! client ([`super::ServiceClient`], whose reader thread fills it from the
//! service's frames) and the staged GPU client ([`super::StagedServiceClient`],
//! whose driver fills it from its staged path).

use super::protocol::Response;
use crate::error::{Error, Failure, Result};
use crate::handle::{Completions, Event, EventSubscribers, JobId, LayerCopy};
use crate::pool::Key;
use crate::staged::CopyMark;
use crate::tier::{JobKind, JobResult, KeyOutcome};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The error of every call once the service connection is gone.
pub(super) fn gone(why: &str) -> Error {
    Error::Closed(format!(
        "the kvtier service connection is gone ({why}); the job's keys are not loaded or stored: treat them as misses, and reconnect once the service is back"
    ))
}

#[derive(Default)]
pub(super) struct JobState {
    /// Submitted through this client (its id came back).
    known: bool,
    /// Load or store (set with `known`).
    kind: Option<JobKind>,
    keys: Vec<Key>,
    /// The memory blocks it reads (a store) or writes (a load).
    blocks: Vec<u32>,
    layers: Option<Range<u32>>,
    done_layers: HashMap<u32, Option<Failure>>,
    /// Per layer of a staged GPU load: the mark after its copy, once queued.
    queued: HashMap<u32, CopyMark>,
    result: Option<JobResult>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) replies: HashMap<u64, Response>,
    jobs: HashMap<JobId, JobState>,
    /// Why the connection ended, once it has.
    pub(super) broken: Option<String>,
    /// The [`Completions`] streams handed out.
    subscribers: EventSubscribers,
}

#[derive(Default)]
pub(super) struct Board {
    state: Mutex<State>,
    cond: Condvar,
}

fn unknown(job: JobId) -> Error {
    Error::invalid(format!(
        "job {job} is unknown or its result was already taken (by wait or try_result: each result is handed out once, to one caller)"
    ))
}

fn broadcast(st: &mut State, ev: Event) {
    let State {
        subscribers, jobs, ..
    } = st;
    subscribers.broadcast(&[ev], &|job| jobs.contains_key(&job));
}

impl Board {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Wake every waiter (after a change made under [`Self::lock`]).
    pub(super) fn notify(&self) {
        self.cond.notify_all();
    }

    /// Sleep until something changes or `deadline` passes (None once it
    /// has: the caller times out).
    pub(super) fn wait_for_news<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Option<Instant>,
    ) -> Option<MutexGuard<'a, State>> {
        let Some(d) = deadline else {
            return Some(self.cond.wait(st).unwrap_or_else(|e| e.into_inner()));
        };
        let left = d.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let (st, _) = self
            .cond
            .wait_timeout(st, left)
            .unwrap_or_else(|e| e.into_inner());
        Some(st)
    }

    /// A job this client submitted.
    pub(super) fn add_job(
        &self,
        job: JobId,
        kind: JobKind,
        keys: &[Key],
        blocks: &[u32],
        layers: Option<Range<u32>>,
    ) {
        let mut st = self.lock();
        let e = st.jobs.entry(job).or_default();
        e.known = true;
        e.kind = Some(kind);
        e.keys = keys.to_vec();
        e.blocks = blocks.to_vec();
        e.layers = layers;
        drop(st);
        self.notify();
    }

    /// Layer `layer` of load `job` is in memory (or failed).
    pub(super) fn layer_done(&self, job: JobId, layer: u32, error: Option<Failure>) {
        let mut st = self.lock();
        st.jobs
            .entry(job)
            .or_default()
            .done_layers
            .insert(layer, error.clone());
        broadcast(&mut st, Event::Layer { job, layer, error });
        drop(st);
        self.notify();
    }

    /// Layer `layer` of load `job` has its copy queued: a stream waits on `mark`.
    pub(super) fn layer_queued(&self, job: JobId, layer: u32, mark: CopyMark) {
        let mut st = self.lock();
        if let Some(e) = st.jobs.get_mut(&job) {
            e.queued.insert(layer, mark);
        }
        drop(st);
        self.notify();
    }

    /// `r.job` finished.
    pub(super) fn finished(&self, r: JobResult) {
        let mut st = self.lock();
        let job = r.job;
        let ev = Event::Finished {
            job,
            kind: r.kind,
            ok: r.all_ok(),
        };
        let e = st.jobs.entry(job).or_default();
        // The marks only hold CUDA events; the layers are settled now.
        e.queued.clear();
        e.result = Some(r);
        broadcast(&mut st, ev);
        drop(st);
        self.notify();
    }

    /// The connection ended: every waiting call fails (with the first
    /// reason: ending it here makes the reader see it closed after).
    pub(super) fn set_broken(&self, why: String) {
        self.lock().broken.get_or_insert(why);
        self.notify();
    }

    /// Results of finished jobs not yet taken; once the connection is
    /// gone, also a result for every unfinished job, each key failed
    /// (`ErrorKind::Closed`): nothing more will come for them.
    pub(super) fn take_finished_or_gone(&self) -> Vec<JobResult> {
        let mut st = self.lock();
        if let Some(why) = st.broken.clone() {
            let f = Failure::from(&gone(&why));
            for (&job, e) in st.jobs.iter_mut() {
                if e.known && e.result.is_none() {
                    e.result = Some(JobResult {
                        job,
                        kind: e.kind.unwrap_or(JobKind::Load),
                        keys: e.keys.clone(),
                        outcomes: vec![KeyOutcome::Failed(f.clone()); e.keys.len()],
                        evicted: Vec::new(),
                    });
                }
            }
        }
        Self::take_done(&mut st)
    }

    fn take_done(st: &mut State) -> Vec<JobResult> {
        let done: Vec<JobId> = st
            .jobs
            .iter()
            .filter(|(_, e)| e.known && e.result.is_some())
            .map(|(&j, _)| j)
            .collect();
        let mut out: Vec<JobResult> = done
            .into_iter()
            .filter_map(|j| st.jobs.remove(&j).and_then(|e| e.result))
            .collect();
        out.sort_by_key(|r| r.job);
        out
    }

    /// Results of every finished job not yet collected.
    pub(super) fn get_finished(&self) -> Vec<JobResult> {
        Self::take_done(&mut self.lock())
    }

    /// Wait for `job`'s result (then removed) until `deadline`.
    pub(super) fn wait_until(
        &self,
        job: JobId,
        deadline: Option<Instant>,
    ) -> Result<Option<JobResult>> {
        let mut st = self.lock();
        loop {
            let Some(e) = st.jobs.get_mut(&job).filter(|e| e.known) else {
                return Err(unknown(job));
            };
            if e.result.is_some() {
                let e = st.jobs.remove(&job).expect("present");
                return Ok(e.result);
            }
            if let Some(why) = &st.broken {
                return Err(gone(why));
            }
            st = match self.wait_for_news(st, deadline) {
                Some(st) => st,
                None => return Ok(None),
            };
        }
    }

    /// Blocks until `settle`, looking at load `job`'s entry (for a layer it
    /// has) after every change, has an answer; `None` once `deadline` has
    /// passed without one.
    fn wait_on_layer<T>(
        &self,
        job: JobId,
        layer: u32,
        deadline: Option<Instant>,
        settle: impl Fn(&JobState) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        let mut st = self.lock();
        loop {
            let Some(e) = st.jobs.get(&job).filter(|e| e.known) else {
                return Err(unknown(job));
            };
            if !e.layers.as_ref().is_some_and(|r| r.contains(&layer)) {
                return Err(Error::invalid(format!(
                    "job {job} is not a load of layer {layer}"
                )));
            }
            if let Some(r) = settle(e) {
                return r.map(Some);
            }
            if let Some(why) = &st.broken {
                return Err(gone(why));
            }
            st = match self.wait_for_news(st, deadline) {
                Some(st) => st,
                None => return Ok(None),
            };
        }
    }

    /// Wait until layer `layer` of load `job` is in memory (true), failed
    /// (an error), or `deadline` passed (false).
    pub(super) fn wait_layer_until(
        &self,
        job: JobId,
        layer: u32,
        deadline: Option<Instant>,
    ) -> Result<bool> {
        let done = self.wait_on_layer(job, layer, deadline, |e| {
            if let Some(err) = e.done_layers.get(&layer) {
                return Some(match err {
                    Some(f) => Err(Error::Failed(
                        f.context(format_args!("layer {layer} of job {job} failed")),
                    )),
                    None => Ok(()),
                });
            }
            let r = e.result.as_ref()?;
            // Finished without this layer's event: only when it failed.
            Some(match r.failures().next() {
                Some((k, f)) => Err(Error::Failed(
                    f.context(format_args!("job {job} failed to load key {k}")),
                )),
                None => Ok(()),
            })
        })?;
        Ok(done.is_some())
    }

    /// As `TierHandle::wait_layer_queued_timeout`: the mark once layer
    /// `layer`'s copy is queued, [`LayerCopy::Settled`] once it is in
    /// memory or failed, `None` at `deadline`.
    pub(super) fn wait_layer_queued_until(
        &self,
        job: JobId,
        layer: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<LayerCopy>> {
        self.wait_on_layer(job, layer, deadline, |e| {
            if e.done_layers.contains_key(&layer) || e.result.is_some() {
                return Some(Ok(LayerCopy::Settled));
            }
            e.queued
                .get(&layer)
                .cloned()
                .map(|m| Ok(LayerCopy::Queued(m)))
        })
    }

    /// Which unfinished job uses memory block `block`: `Load` while a load
    /// writes it, `Store` while a store reads it.
    pub(super) fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        let st = self.lock();
        let mut using = st
            .jobs
            .values()
            .filter(|e| e.known && e.result.is_none() && e.blocks.contains(&block))
            .filter_map(|e| e.kind);
        // A load's use is the stronger one (nothing may touch the block).
        let first = using.next()?;
        Some(
            if first == JobKind::Load || using.any(|k| k == JobKind::Load) {
                JobKind::Load
            } else {
                JobKind::Store
            },
        )
    }

    /// Whether a job submitted here has not finished.
    pub(super) fn any_open(st: &State) -> bool {
        st.jobs.values().any(|e| e.known && e.result.is_none())
    }

    /// A new stream of the events.
    pub(super) fn subscribe(&self) -> Result<Completions> {
        self.lock().subscribers.subscribe()
    }

    /// Block until every job submitted here has finished.
    pub(super) fn wait_all(&self) -> Result<()> {
        let mut st = self.lock();
        loop {
            if !Self::any_open(&st) {
                return Ok(());
            }
            if let Some(why) = &st.broken {
                return Err(gone(why));
            }
            st = self.cond.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait for the answer to request `id`, at most `timeout` (`Ok(None)`
    /// then: the caller ends the connection).
    pub(super) fn wait_reply(&self, id: u64, timeout: Duration) -> Result<Option<Response>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let Some(r) = st.replies.remove(&id) {
                return match r {
                    Response::Refused(f) => Err(Error::Failed(f)),
                    r => Ok(Some(r)),
                };
            }
            if let Some(why) = &st.broken {
                return Err(gone(why));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            st = self
                .cond
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
