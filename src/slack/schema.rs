//! The file as serde reads and writes it, and the shape check: the schema as data, walked
//! with the path of every value, so a wrong field is named where it stands.

use super::*;

// ---------------------------------------------------------------------------
// The file, as serde reads and writes it.

/// `model`: the model the table was profiled for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// Model name (`llama3-8b`).
    pub name: String,
    /// Decoder layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// PyTorch spelling (`bfloat16`); see [`DType::name`].
    pub dtype: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Hidden size.
    pub hidden_size: u32,
    /// MLP intermediate size.
    pub intermediate_size: u32,
    /// Query heads per layer.
    pub attention_heads: u32,
}

/// `gpu`: the GPU the compute times are for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    /// GPU name as the driver reports it.
    pub name: String,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Dense bf16 peak, TFLOPS.
    pub bf16_tflops: f64,
    /// HBM bandwidth, GB/s.
    pub hbm_gbs: f64,
}

/// `storage`: the SSD side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageInfo {
    /// Reads alone, GB/s (10^9 B/s).
    pub read_gbs: f64,
    /// Writes alone, GB/s.
    pub write_gbs: f64,
    /// One IOCB (one object-sized read) at queue depth 1, submission to completion, µs.
    pub iocb_service_us: f64,
    /// `measured on <dir> ...` or `assumed: ...`.
    pub source: String,
}

/// `mode`: where the compute times came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// From FLOP and byte counts against the GPU's peaks.
    Analytic,
    /// From a profiler trace of a real run.
    Trace,
    /// Timed with PyTorch on the GPU.
    Torch,
}

impl Mode {
    /// Its spelling in the file (`analytic`, `trace`, `torch`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Analytic => "analytic",
            Mode::Trace => "trace",
            Mode::Torch => "torch",
        }
    }
}

/// `provenance`: who made the table, where, when, how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    /// Host name of the machine that made it.
    pub machine: String,
    /// Its kernel release.
    pub kernel: String,
    /// kvtier's version.
    pub kvtier_version: String,
    /// `YYYY-MM-DD`.
    pub date: String,
    /// The command line that made it.
    pub command: String,
    /// How the compute times were found, in words.
    pub method: String,
}

/// One row of `entries[].layers[]`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRow {
    /// The layer's compute time, microseconds.
    pub compute_us: f64,
    /// Time to read the layer's KV, microseconds.
    pub read_us: f64,
    /// Compute time left over the read, microseconds.
    pub slack_us: f64,
    /// SMs the I/O may take during the layer.
    pub sm_budget: u32,
    /// Read IOCBs of the layer.
    pub read_iocbs: u32,
    /// Write IOCBs that fit in the slack.
    pub write_iocbs: u32,
}

/// One element of `entries`: a grid point and its layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Input tokens.
    pub input: u64,
    /// Tokens of that input already in the pool.
    pub prefix: u64,
    /// One row per layer.
    pub layers: Vec<LayerRow>,
}

/// One element of `decode`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeRow {
    /// Context tokens.
    pub context: u64,
    /// Time of one decode step, microseconds.
    pub step_us: f64,
    /// Time in a step the I/O may use, microseconds.
    pub slack_us: f64,
    /// SMs the I/O may take.
    pub sm_budget: u32,
    /// Write IOCBs that fit in a step.
    pub write_iocbs: u32,
}

/// The whole file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableFile {
    /// The schema's name and version.
    pub schema: String,
    /// The model.
    pub model: ModelInfo,
    /// The GPU.
    pub gpu: GpuInfo,
    /// The storage.
    pub storage: StorageInfo,
    /// Where the compute times came from.
    pub mode: Mode,
    /// Whether the times are estimates (not measured).
    pub estimated: bool,
    /// Who made it, where, when, how.
    pub provenance: Provenance,
    /// The grid's input lengths.
    pub input_lengths: Vec<u64>,
    /// The grid's prefix lengths.
    pub prefix_lengths: Vec<u64>,
    /// One entry per grid point.
    pub entries: Vec<Entry>,
    /// Decode rows by context.
    pub decode: Vec<DecodeRow>,
}

/// Everything of a table but its rows: what [`SlackTable::build`] derives rows under.
#[derive(Clone, Debug, PartialEq)]
pub struct TableHeader {
    /// The model.
    pub model: ModelInfo,
    /// The GPU.
    pub gpu: GpuInfo,
    /// The storage.
    pub storage: StorageInfo,
    /// Where the compute times came from.
    pub mode: Mode,
    /// Whether the times are estimates (not measured).
    pub estimated: bool,
    /// Who made it, where, when, how.
    pub provenance: Provenance,
}

// ---------------------------------------------------------------------------
// The shape check: the schema as data, walked with the path of every value,
// so a wrong or missing field is named (`entries[3].layers[7].compute_us`)
// before serde builds the typed table.

#[derive(Clone, Copy)]
pub(super) enum Ty {
    Str,
    Num,
    U32,
    U64,
    Bool,
    OneOf(&'static [&'static str]),
    Obj(&'static [Field]),
    Arr(&'static Ty),
}

pub(super) struct Field {
    name: &'static str,
    ty: Ty,
    about: &'static str,
}

pub(super) const fn field(name: &'static str, ty: Ty, about: &'static str) -> Field {
    Field { name, ty, about }
}

pub(super) const MODEL_FIELDS: &[Field] = &[
    field("name", Ty::Str, "a string: the model's name"),
    field("layers", Ty::U32, "an integer: transformer layers"),
    field("kv_heads", Ty::U32, "an integer: KV heads per layer"),
    field("head_dim", Ty::U32, "an integer: elements per head"),
    field(
        "dtype",
        Ty::Str,
        "a string: the KV dtype, e.g. \"bfloat16\"",
    ),
    field("block_size", Ty::U32, "an integer: tokens per KV block"),
    field(
        "hidden_size",
        Ty::U32,
        "an integer: the model's hidden size",
    ),
    field(
        "intermediate_size",
        Ty::U32,
        "an integer: the MLP's intermediate size",
    ),
    field(
        "attention_heads",
        Ty::U32,
        "an integer: query heads per layer",
    ),
];
pub(super) const GPU_FIELDS: &[Field] = &[
    field("name", Ty::Str, "a string: the GPU's name"),
    field("sms", Ty::U32, "an integer: streaming multiprocessors"),
    field("bf16_tflops", Ty::Num, "a number: dense bf16 peak TFLOPS"),
    field("hbm_gbs", Ty::Num, "a number: HBM bandwidth in GB/s"),
];
pub(super) const STORAGE_FIELDS: &[Field] = &[
    field("read_gbs", Ty::Num, "a number: read bandwidth in GB/s"),
    field("write_gbs", Ty::Num, "a number: write bandwidth in GB/s"),
    field(
        "iocb_service_us",
        Ty::Num,
        "a number: one IOCB's service time in µs",
    ),
    field(
        "source",
        Ty::Str,
        "a string: \"measured on <dir> ...\" or \"assumed: ...\"",
    ),
];
pub(super) const PROVENANCE_FIELDS: &[Field] = &[
    field("machine", Ty::Str, "a string: the profiling machine"),
    field("kernel", Ty::Str, "a string: its kernel release"),
    field("kvtier_version", Ty::Str, "a string: the kvtier version"),
    field("date", Ty::Str, "a string: YYYY-MM-DD"),
    field("command", Ty::Str, "a string: the profiler command line"),
    field("method", Ty::Str, "a string: how the times were obtained"),
];
pub(super) const LAYER_FIELDS: &[Field] = &[
    field(
        "compute_us",
        Ty::Num,
        "a number: the layer's compute window in µs",
    ),
    field(
        "read_us",
        Ty::Num,
        "a number: the layer's prefix read time in µs",
    ),
    field("slack_us", Ty::Num, "a number: compute_us - read_us"),
    field(
        "sm_budget",
        Ty::U32,
        "an integer: SMs the I/O kernel may use",
    ),
    field(
        "read_iocbs",
        Ty::U32,
        "an integer: IOCBs the layer's reads need",
    ),
    field(
        "write_iocbs",
        Ty::U32,
        "an integer: new-KV write IOCBs that fit in the slack",
    ),
];
pub(super) const LAYER_TY: Ty = Ty::Obj(LAYER_FIELDS);
pub(super) const ENTRY_FIELDS: &[Field] = &[
    field(
        "input",
        Ty::U64,
        "an integer: the grid point's input length",
    ),
    field(
        "prefix",
        Ty::U64,
        "an integer: the grid point's prefix length",
    ),
    field("layers", Ty::Arr(&LAYER_TY), "an array: one row per layer"),
];
pub(super) const ENTRY_TY: Ty = Ty::Obj(ENTRY_FIELDS);
pub(super) const DECODE_FIELDS: &[Field] = &[
    field("context", Ty::U64, "an integer: tokens in context"),
    field("step_us", Ty::Num, "a number: one decode step in µs"),
    field(
        "slack_us",
        Ty::Num,
        "a number: the step's write window in µs",
    ),
    field(
        "sm_budget",
        Ty::U32,
        "an integer: SMs the I/O kernel may use",
    ),
    field(
        "write_iocbs",
        Ty::U32,
        "an integer: full write IOCBs that fit",
    ),
];
pub(super) const DECODE_TY: Ty = Ty::Obj(DECODE_FIELDS);
pub(super) const U64_TY: Ty = Ty::U64;
pub(super) const TABLE_FIELDS: &[Field] = &[
    field("schema", Ty::Str, "the string \"kvtier-slack/1\""),
    field("model", Ty::Obj(MODEL_FIELDS), "an object: the model"),
    field("gpu", Ty::Obj(GPU_FIELDS), "an object: the GPU"),
    field("storage", Ty::Obj(STORAGE_FIELDS), "an object: the SSDs"),
    field(
        "mode",
        Ty::OneOf(&["analytic", "trace", "torch"]),
        "one of \"analytic\", \"trace\", \"torch\"",
    ),
    field(
        "estimated",
        Ty::Bool,
        "true or false: are the compute times estimates",
    ),
    field(
        "provenance",
        Ty::Obj(PROVENANCE_FIELDS),
        "an object: machine, kernel, kvtier_version, date, command, method",
    ),
    field(
        "input_lengths",
        Ty::Arr(&U64_TY),
        "an array of integers: the grid's input lengths",
    ),
    field(
        "prefix_lengths",
        Ty::Arr(&U64_TY),
        "an array of integers: the grid's prefix lengths",
    ),
    field(
        "entries",
        Ty::Arr(&ENTRY_TY),
        "an array: one entry per grid point",
    ),
    field(
        "decode",
        Ty::Arr(&DECODE_TY),
        "an array: one row per decode context",
    ),
];
pub(super) const TABLE_TY: Ty = Ty::Obj(TABLE_FIELDS);

/// `v` shortened for an error message.
pub(super) fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

pub(super) fn check_shape(v: &Value, ty: Ty, path: &str, src: &str) -> Result<()> {
    let wrong = |expected: &str| {
        Error::invalid(format!(
            "{src}: {} is {} ({}); it must be {expected}",
            if path.is_empty() {
                "the top level"
            } else {
                path
            },
            shown(v),
            json_kind(v)
        ))
    };
    match ty {
        Ty::Str => v.is_string().then_some(()).ok_or_else(|| wrong("a string")),
        Ty::Num => v.is_number().then_some(()).ok_or_else(|| wrong("a number")),
        Ty::Bool => v
            .is_boolean()
            .then_some(())
            .ok_or_else(|| wrong("true or false")),
        Ty::U32 | Ty::U64 => {
            let max = if matches!(ty, Ty::U32) {
                u64::from(u32::MAX)
            } else {
                u64::MAX
            };
            match v.as_u64() {
                Some(n) if n <= max => Ok(()),
                Some(_) => Err(wrong(&format!("an integer of at most {max}"))),
                None if v.as_i64().is_some() => Err(Error::invalid(format!(
                    "{src}: {path} is negative ({v}); it must be an integer ≥ 0"
                ))),
                None => Err(wrong("a non-negative integer")),
            }
        }
        Ty::OneOf(choices) => match v.as_str() {
            Some(s) if choices.contains(&s) => Ok(()),
            _ => Err(wrong(&format!(
                "one of {}",
                choices
                    .iter()
                    .map(|c| format!("\"{c}\""))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        },
        Ty::Arr(inner) => {
            let Value::Array(items) = v else {
                return Err(wrong("an array"));
            };
            for (k, item) in items.iter().enumerate() {
                check_shape(item, *inner, &format!("{path}[{k}]"), src)?;
            }
            Ok(())
        }
        Ty::Obj(fields) => {
            let Value::Object(map) = v else {
                return Err(wrong("an object"));
            };
            let join = |key: &str| {
                if path.is_empty() {
                    key.to_string()
                } else {
                    format!("{path}.{key}")
                }
            };
            for key in map.keys() {
                if !fields.iter().any(|f| f.name == key) {
                    return Err(Error::invalid(format!(
                        "{src}: {} is not a field of a {SCHEMA} table; remove it or correct its name (the fields here are {})",
                        crate::json::excerpt(&join(key), 80),
                        fields.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
                    )));
                }
            }
            for f in fields {
                match map.get(f.name) {
                    None => {
                        return Err(Error::invalid(format!(
                            "{src}: {} is missing ({}); add it",
                            join(f.name),
                            f.about
                        )))
                    }
                    Some(x) => check_shape(x, f.ty, &join(f.name), src)?,
                }
            }
            Ok(())
        }
    }
}
