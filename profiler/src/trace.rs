//! `--compute trace FILE`: per-layer compute times measured elsewhere (or by
//! `profiler/torch_harness.py`, which writes this format).
//!
//! ```text
//! { "schema": "kvtier-trace/1",
//!   "model": "llama3-8b",            // informational
//!   "layers": 32,                    // must equal the model's layers
//!   "device": "NVIDIA H100 80GB HBM3",          // optional: what ran it
//!   "software": "torch 2.5.1, transformers 4.51.3, attention flash_attn",  // optional
//!   "timing": "graph",               // optional: graph | eager | cpu (how the harness timed)
//!   "prefill": [ {"input": 512, "prefix": 0, "layer_us": [412.5, ... one per layer],
//!                 "repeats": 5, "pass_layers": 8,                            // optional
//!                 "spread_us": {"min": 410.2, "p10": 411.0, "median": 412.5, "p90": 413.9, "max": 415.0}}, ... ],
//!   "decode":  [ {"context": 1024, "layer_us": [150.1, ...]}            // per layer, summed
//!              | {"context": 1024, "step_us": 4803.2}, ... ],        // or the whole step
//!   "partial": true,                                  // optional: the run was cut short
//!   "missing_prefill": [[65536, 131072]], "missing_decode": [131072],  // what it lacks
//!   "note": "stopped by --budget-s 420 ..." }                          // optional: why
//! ```
//!
//! Times are µs; `spread_us` is over the repeats of a row's mean layer time.
//! The table's grid is the trace's (input, prefix) points unless
//! `--inputs`/`--prefixes` pick some of them; every grid point must be in the
//! trace. Decode rows likewise (`--contexts` picks). A partial trace's grid
//! is the largest complete one among its points ([`Trace::complete_grid`]).

use kvtier::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

pub const TRACE_SCHEMA: &str = "kvtier-trace/1";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceFile {
    pub schema: String,
    #[serde(default)]
    pub model: Option<String>,
    pub layers: u32,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub software: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<String>,
    pub prefill: Vec<PrefillRow>,
    pub decode: Vec<DecodeTraceRow>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partial: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_prefill: Vec<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_decode: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How a row's mean layer time spread over the repeats, µs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spread {
    pub min: f64,
    pub p10: f64,
    pub median: f64,
    pub p90: f64,
    pub max: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillRow {
    pub input: u64,
    pub prefix: u64,
    pub layer_us: Vec<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_layers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_us: Option<Spread>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTraceRow {
    pub context: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_us: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass_layers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_us: Option<Spread>,
}

/// A checked trace: per-layer times by grid point, step times by context.
#[derive(Clone, Debug)]
pub struct Trace {
    pub file: TraceFile,
    pub source: String,
    prefill: BTreeMap<(u64, u64), Vec<f64>>,
    decode: BTreeMap<u64, f64>,
}

impl Trace {
    pub fn load(path: &Path, layers: u32) -> Result<Trace> {
        let src = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::invalid(format!(
                "{src}: cannot read the trace ({e}); --compute trace takes a {TRACE_SCHEMA} JSON file"
            ))
        })?;
        Self::parse(&text, &src, layers)
    }

    pub fn parse(text: &str, src: &str, layers: u32) -> Result<Trace> {
        let err = |what: String| Error::invalid(format!("{src}: {what}"));
        let file: TraceFile = serde_json::from_str(text).map_err(|e| {
            err(format!(
                "not a {TRACE_SCHEMA} trace: {e} (see profiler/src/trace.rs for the format)"
            ))
        })?;
        if file.schema != TRACE_SCHEMA {
            return Err(err(format!(
                "schema is {:?}, not \"{TRACE_SCHEMA}\"",
                file.schema
            )));
        }
        if file.layers != layers {
            return Err(err(format!(
                "layers is {} but the model has {layers}; was the trace taken on another model?",
                file.layers
            )));
        }
        let check = |times: &[f64], path: String| -> Result<()> {
            if times.len() != layers as usize {
                return Err(err(format!(
                    "{path}.layer_us has {} values but the model has {layers} layers",
                    times.len()
                )));
            }
            if let Some((l, t)) = times
                .iter()
                .enumerate()
                .find(|(_, t)| !(t.is_finite() && **t >= 0.0))
            {
                return Err(err(format!(
                    "{path}.layer_us[{l}] is {t:?}; times are µs ≥ 0"
                )));
            }
            Ok(())
        };
        let mut prefill = BTreeMap::new();
        for (k, row) in file.prefill.iter().enumerate() {
            check(&row.layer_us, format!("prefill[{k}]"))?;
            if prefill
                .insert((row.input, row.prefix), row.layer_us.clone())
                .is_some()
            {
                return Err(err(format!(
                    "prefill[{k}] repeats (input {}, prefix {})",
                    row.input, row.prefix
                )));
            }
        }
        let mut decode = BTreeMap::new();
        for (k, row) in file.decode.iter().enumerate() {
            let step = match (&row.layer_us, row.step_us) {
                (Some(l), None) => {
                    check(l, format!("decode[{k}]"))?;
                    l.iter().sum()
                }
                (None, Some(s)) if s.is_finite() && s >= 0.0 => s,
                (None, Some(s)) => {
                    return Err(err(format!(
                        "decode[{k}].step_us is {s:?}; times are µs ≥ 0"
                    )))
                }
                _ => {
                    return Err(err(format!(
                    "decode[{k}] needs exactly one of layer_us (per layer) or step_us (whole step)"
                )))
                }
            };
            if decode.insert(row.context, step).is_some() {
                return Err(err(format!("decode[{k}] repeats context {}", row.context)));
            }
        }
        if prefill.is_empty() || decode.is_empty() {
            return Err(err(
                "a trace needs at least one prefill row and one decode row".into(),
            ));
        }
        Ok(Trace {
            file,
            source: src.to_string(),
            prefill,
            decode,
        })
    }

    /// The trace's input lengths, ascending.
    pub fn inputs(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.prefill.keys().map(|k| k.0).collect();
        v.dedup();
        v
    }

    /// The trace's prefix lengths, ascending.
    pub fn prefixes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.prefill.keys().map(|k| k.1).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The trace's decode contexts, ascending.
    pub fn contexts(&self) -> Vec<u64> {
        self.decode.keys().copied().collect()
    }

    pub fn layer_us(&self, input: u64, prefix: u64) -> Result<&[f64]> {
        self.prefill
            .get(&(input, prefix))
            .map(Vec::as_slice)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "{}: no prefill row for grid point (input {input}, prefix {prefix}); the trace has inputs {:?} and prefixes {:?}: pick --inputs/--prefixes among them or trace that point",
                    self.source,
                    self.inputs(),
                    self.prefixes()
                ))
            })
    }

    pub fn step_us(&self, context: u64) -> Result<f64> {
        self.decode.get(&context).copied().ok_or_else(|| {
            Error::invalid(format!(
                "{}: no decode row for context {context}; the trace has contexts {:?}",
                self.source,
                self.contexts()
            ))
        })
    }

    /// Whether the run that wrote the trace was cut short (by its time
    /// budget or memory), so that it lacks points it was asked for.
    pub fn partial(&self) -> bool {
        self.file.partial
    }

    /// The largest grid among `inputs` x `prefixes` whose every point the
    /// trace has: for each set of prefixes some input has in full, the inputs
    /// that have them all; the one with the most points (then the most
    /// inputs). `None` when no point is in the trace.
    pub fn complete_grid(&self, inputs: &[u64], prefixes: &[u64]) -> Option<(Vec<u64>, Vec<u64>)> {
        let has = |i: u64| -> Vec<u64> {
            prefixes
                .iter()
                .copied()
                .filter(|&p| self.prefill.contains_key(&(i, p)))
                .collect()
        };
        let mut best: Option<(Vec<u64>, Vec<u64>)> = None;
        for &i in inputs {
            let cols = has(i);
            if cols.is_empty() {
                continue;
            }
            let rows: Vec<u64> = inputs
                .iter()
                .copied()
                .filter(|&r| cols.iter().all(|&p| self.prefill.contains_key(&(r, p))))
                .collect();
            let better = match &best {
                None => true,
                Some((br, bc)) => {
                    let (a, b) = (rows.len() * cols.len(), br.len() * bc.len());
                    a > b || (a == b && rows.len() > br.len())
                }
            };
            if better {
                best = Some((rows, cols));
            }
        }
        best
    }

    /// The method line of the table's provenance.
    pub fn describe(&self, what: &str) -> String {
        self.describe_from(what, &self.source)
    }

    /// [`describe`](Self::describe), naming `origin` as where the times came from.
    pub fn describe_from(&self, what: &str, origin: &str) -> String {
        let mut s = format!("{what}: per-layer times from {origin}");
        if let Some(d) = &self.file.device {
            s.push_str(&format!(", measured on {d}"));
        }
        if let Some(sw) = &self.file.software {
            s.push_str(&format!(" ({sw})"));
        }
        if self.file.partial {
            s.push_str("; PARTIAL: the run was cut short");
            if let Some(n) = &self.file.note {
                s.push_str(&format!(" ({n})"));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"schema": "kvtier-trace/1", "layers": 2,
        "prefill": [{"input": 16, "prefix": 0, "layer_us": [1.0, 2.0]},
                    {"input": 32, "prefix": 0, "layer_us": [3.0, 4.0]}],
        "decode": [{"context": 16, "layer_us": [0.5, 0.25]}, {"context": 64, "step_us": 2.0}]}"#;

    #[test]
    fn parses_and_looks_up() {
        let t = Trace::parse(GOOD, "t.json", 2).unwrap();
        assert_eq!(t.inputs(), vec![16, 32]);
        assert_eq!(t.prefixes(), vec![0]);
        assert_eq!(t.contexts(), vec![16, 64]);
        assert_eq!(t.layer_us(32, 0).unwrap(), &[3.0, 4.0]);
        assert_eq!(t.step_us(16).unwrap(), 0.75);
        assert_eq!(t.step_us(64).unwrap(), 2.0);
        let msg = t.layer_us(32, 16).unwrap_err().to_string();
        assert!(
            msg.contains("t.json: no prefill row for grid point (input 32, prefix 16)"),
            "{msg}"
        );
    }

    #[test]
    fn partial_traces_keep_their_largest_complete_grid() {
        let row = |i: u64, p: u64| {
            format!(
                r#"{{"input": {i}, "prefix": {p}, "layer_us": [1.0], "repeats": 5, "pass_layers": 1, "spread_us": {{"min": 0.9, "p10": 0.95, "median": 1.0, "p90": 1.1, "max": 1.2}}}}"#
            )
        };
        // Cheapest first, cut short: a staircase of points.
        let rows = [
            row(16, 0),
            row(16, 64),
            row(16, 1024),
            row(64, 0),
            row(64, 64),
            row(256, 0),
        ];
        let text = format!(
            r#"{{"schema": "kvtier-trace/1", "layers": 1, "timing": "graph", "partial": true,
                "missing_prefill": [[64, 1024], [256, 64], [256, 1024]], "missing_decode": [4096],
                "note": "stopped by --budget-s 420", "prefill": [{}],
                "decode": [{{"context": 64, "layer_us": [0.5], "repeats": 5}}]}}"#,
            rows.join(",")
        );
        let t = Trace::parse(&text, "p.json", 1).unwrap();
        assert!(t.partial());
        assert_eq!(t.file.missing_decode, vec![4096]);
        assert_eq!(t.file.prefill[0].spread_us.as_ref().unwrap().p90, 1.1);
        // 2 x 2 (16, 64 x 0, 64) beats 3 x 1 and 1 x 3 (ties go to more inputs).
        assert_eq!(
            t.complete_grid(&[16, 64, 256], &[0, 64, 1024]),
            Some((vec![16, 64], vec![0, 64]))
        );
        assert_eq!(
            t.complete_grid(&[16, 64, 256], &[0]),
            Some((vec![16, 64, 256], vec![0]))
        );
        assert_eq!(t.complete_grid(&[4096], &[0]), None);
        assert!(
            t.describe("trace").contains("PARTIAL"),
            "{}",
            t.describe("trace")
        );
        // Round trip: what serializes parses back the same.
        let again = serde_json::to_string(&t.file).unwrap();
        assert_eq!(Trace::parse(&again, "q.json", 1).unwrap().file, t.file);
        let bad = text.replace("\"p90\": 1.1", "\"p95\": 1.1");
        assert!(Trace::parse(&bad, "p.json", 1).is_err());
    }

    #[test]
    fn rejects_bad_traces() {
        let msg = Trace::parse(GOOD, "t.json", 3).unwrap_err().to_string();
        assert!(msg.contains("layers is 2 but the model has 3"), "{msg}");
        let bad = GOOD.replace("[3.0, 4.0]", "[3.0]");
        let msg = Trace::parse(&bad, "t.json", 2).unwrap_err().to_string();
        assert!(msg.contains("prefill[1].layer_us has 1 values"), "{msg}");
        let bad = GOOD.replace("[3.0, 4.0]", "[3.0, -4.0]");
        let msg = Trace::parse(&bad, "t.json", 2).unwrap_err().to_string();
        assert!(msg.contains("prefill[1].layer_us[1] is -4.0"), "{msg}");
        let bad = GOOD.replace("\"step_us\": 2.0", "\"stepus\": 2.0");
        let msg = Trace::parse(&bad, "t.json", 2).unwrap_err().to_string();
        assert!(msg.contains("unknown field `stepus`"), "{msg}");
        let bad = GOOD.replace("kvtier-trace/1", "other/1");
        let msg = Trace::parse(&bad, "t.json", 2).unwrap_err().to_string();
        assert!(msg.contains("schema is \"other/1\""), "{msg}");
    }
}
