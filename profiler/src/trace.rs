//! `--compute trace FILE`: per-layer compute times measured elsewhere (or by
//! `profiler/torch_harness.py`, which writes this format).
//!
//! ```text
//! { "schema": "kvtier-trace/1",
//!   "model": "llama3-8b",            // informational
//!   "layers": 32,                    // must equal the model's layers
//!   "device": "NVIDIA H100 80GB HBM3",          // optional: what ran it
//!   "software": "torch 2.5.1, transformers 4.51.3, attention flash_attn",  // optional
//!   "prefill": [ {"input": 512, "prefix": 0, "layer_us": [412.5, ... one per layer]}, ... ],
//!   "decode":  [ {"context": 1024, "layer_us": [150.1, ...]}            // per layer, summed
//!              | {"context": 1024, "step_us": 4803.2}, ... ] }         // or the whole step
//! ```
//!
//! Times are µs. The table's grid is the trace's (input, prefix) points
//! unless `--inputs`/`--prefixes` pick some of them; every grid point must be
//! in the trace. Decode rows likewise (`--contexts` picks).

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
    pub prefill: Vec<PrefillRow>,
    pub decode: Vec<DecodeTraceRow>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillRow {
    pub input: u64,
    pub prefix: u64,
    pub layer_us: Vec<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTraceRow {
    pub context: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_us: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_us: Option<f64>,
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
