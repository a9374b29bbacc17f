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
