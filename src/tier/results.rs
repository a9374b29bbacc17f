//! Results of finished jobs until they are handed out: in finishing order,
//! each handed out once (by id, or all at once). The tier's job table and
//! the staged path keep their finished jobs in this one shape.

use super::{JobId, JobResult};
use std::collections::{HashMap, VecDeque};

/// Finished jobs' results not yet collected.
#[derive(Default)]
pub(crate) struct FinishedJobs {
    results: HashMap<JobId, JobResult>,
    order: VecDeque<JobId>,
}

impl FinishedJobs {
    /// Keep `r` until it is collected.
    pub(crate) fn push(&mut self, r: JobResult) {
        self.order.push_back(r.job);
        self.results.insert(r.job, r);
    }

    /// Whether `id`'s result is here.
    pub(crate) fn contains(&self, id: JobId) -> bool {
        self.results.contains_key(&id)
    }

    /// `id`'s result, left here.
    pub(crate) fn get(&self, id: JobId) -> Option<&JobResult> {
        self.results.get(&id)
    }

    /// `id`'s result, handed out.
    pub(crate) fn take(&mut self, id: JobId) -> Option<JobResult> {
        let r = self.results.remove(&id)?;
        self.order.retain(|&j| j != id);
        Some(r)
    }

    /// Every result, in finishing order, handed out.
    pub(crate) fn take_all(&mut self) -> Vec<JobResult> {
        let order = std::mem::take(&mut self.order);
        order
            .into_iter()
            .filter_map(|id| self.results.remove(&id))
            .collect()
    }
}
