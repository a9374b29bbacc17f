//! Where a load's time goes, layer by layer: with `KVTIER_TRACE_LOADS` set
//! in the environment, each load records when it was submitted, when each
//! layer's IOCBs were issued and landed, when the layer's checksums were
//! taken and when it was announced, and prints one line per layer to stderr
//! when it finishes. A debugging aid for time to first layer; off (one
//! branch per event) otherwise.

use super::JobId;
use std::collections::HashMap;
use std::time::Instant;

/// What happened to a layer of a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ev {
    /// An IOCB of the layer went to the engine.
    Issue,
    /// An IOCB of the layer completed (accounted on the tier's thread).
    Land,
    /// The layer's landed reads were hashed.
    Hashed,
    /// The layer was announced.
    Announce,
}

#[derive(Default)]
struct LayerTimes {
    issue: Option<(f64, f64)>,
    land: Option<(f64, f64)>,
    iocbs: u32,
    hashed: f64,
    announce: f64,
}

struct LoadRecord {
    t0: Instant,
    first_layer: u32,
    layers: Vec<LayerTimes>,
}

/// Per load in flight, its layers' times (ms since submission).
pub(super) struct LoadTrace {
    loads: HashMap<JobId, LoadRecord>,
}

impl LoadTrace {
    /// A tracer when `KVTIER_TRACE_LOADS` is set.
    pub(super) fn from_env() -> Option<LoadTrace> {
        std::env::var_os("KVTIER_TRACE_LOADS").map(|_| LoadTrace {
            loads: HashMap::new(),
        })
    }

    pub(super) fn submitted(&mut self, job: JobId, t0: Instant, layers: std::ops::Range<u32>) {
        self.loads.insert(
            job,
            LoadRecord {
                t0,
                first_layer: layers.start,
                layers: layers.map(|_| LayerTimes::default()).collect(),
            },
        );
    }

    pub(super) fn event(&mut self, job: JobId, layer: u32, ev: Ev) {
        let Some(r) = self.loads.get_mut(&job) else {
            return;
        };
        let ms = r.t0.elapsed().as_secs_f64() * 1e3;
        let Some(l) = r.layers.get_mut((layer - r.first_layer) as usize) else {
            return;
        };
        let span = |s: &mut Option<(f64, f64)>| {
            *s = Some(s.map_or((ms, ms), |(a, _)| (a, ms)));
        };
        match ev {
            Ev::Issue => {
                span(&mut l.issue);
                l.iocbs += 1;
            }
            Ev::Land => span(&mut l.land),
            Ev::Hashed => l.hashed = ms,
            Ev::Announce => l.announce = ms,
        }
    }

    /// Print a finished load's layers to stderr.
    pub(super) fn finished(&mut self, job: JobId) {
        let Some(r) = self.loads.remove(&job) else {
            return;
        };
        let n = r.layers.len().max(1) as f64;
        let total = r.layers.last().map_or(0.0, |l| l.announce);
        let mut out = format!(
            "kvtier load {job}: {} layers in {total:.2} ms (avg {:.2} ms/layer)\n  layer iocbs  issue first..last   land first..last     hashed  announced  (ms since submit)\n",
            r.layers.len(),
            total / n
        );
        let fmt =
            |s: Option<(f64, f64)>| s.map_or("-".into(), |(a, b)| format!("{a:8.2}..{b:8.2}"));
        for (i, l) in r.layers.iter().enumerate() {
            out += &format!(
                "  {:5} {:5} {:>18} {:>18} {:10.2} {:10.2}\n",
                r.first_layer + i as u32,
                l.iocbs,
                fmt(l.issue),
                fmt(l.land),
                l.hashed,
                l.announce
            );
        }
        eprint!("{out}");
    }
}

/// Where a store's time goes, step by step: with `KVTIER_TRACE_STORES` set
/// in the environment, each store job records when its steps' IOCBs were
/// issued and completed, when its flush steps joined a group flush and when
/// that flush was issued and done, and how long staging its headers waited
/// for the checksum worker; one block of lines per store on stderr when it
/// finishes. A debugging aid (the device idling between steps, a step
/// waiting on hashing); off (one branch per event) otherwise.
pub(super) struct StoreTrace {
    stores: HashMap<JobId, StoreRecord>,
}

struct StoreRecord {
    t0: Instant,
    /// (what, first ms, last ms, count), in the order first seen.
    spans: Vec<(String, f64, f64, u32)>,
}

impl StoreTrace {
    /// A tracer when `KVTIER_TRACE_STORES` is set.
    pub(super) fn from_env() -> Option<StoreTrace> {
        std::env::var_os("KVTIER_TRACE_STORES").map(|_| StoreTrace {
            stores: HashMap::new(),
        })
    }

    pub(super) fn submitted(&mut self, job: JobId, t0: Instant) {
        self.stores.insert(
            job,
            StoreRecord {
                t0,
                spans: Vec::new(),
            },
        );
    }

    /// Something named `what` happened to the store now (a span per name:
    /// first and last time, and how often).
    pub(super) fn event(&mut self, job: JobId, what: impl std::fmt::Display) {
        let Some(r) = self.stores.get_mut(&job) else {
            return;
        };
        let ms = r.t0.elapsed().as_secs_f64() * 1e3;
        let what = what.to_string();
        match r.spans.iter_mut().find(|s| s.0 == what) {
            Some(s) => {
                s.2 = ms;
                s.3 += 1;
            }
            None => r.spans.push((what, ms, ms, 1)),
        }
    }

    /// Print a finished store's spans to stderr.
    pub(super) fn finished(&mut self, job: JobId) {
        let Some(r) = self.stores.remove(&job) else {
            return;
        };
        let total = r.t0.elapsed().as_secs_f64() * 1e3;
        let mut out = format!(
            "kvtier store {job}: {total:.2} ms\n  {:<28} {:>9} {:>9} {:>6}  (ms since submit)\n",
            "what", "first", "last", "count"
        );
        for (what, a, b, n) in &r.spans {
            out += &format!("  {what:<28} {a:9.2} {b:9.2} {n:6}\n");
        }
        eprint!("{out}");
    }
}
