//! The model's shape: kvtier's KV geometry plus what compute time depends on
//! (hidden size, MLP intermediate size, query heads), which kvtier's presets
//! do not carry.

use kvtier::model::{self, DType, KvGeometry};
use kvtier::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// Hidden size, MLP intermediate size and query heads of a preset, with the
/// Hugging Face `model_type` its decoder layers are built from by the torch
/// harness. Values from each model's config.json on the Hugging Face hub.
pub struct PresetShape {
    pub name: &'static str,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub attention_heads: u32,
    pub model_type: &'static str,
    pub rope_theta: f64,
}

pub const PRESET_SHAPES: &[PresetShape] = &[
    PresetShape {
        name: "llama3-8b",
        hidden_size: 4096,
        intermediate_size: 14336,
        attention_heads: 32,
        model_type: "llama",
        rope_theta: 500000.0,
    },
    PresetShape {
        name: "llama3.1-8b",
        hidden_size: 4096,
        intermediate_size: 14336,
        attention_heads: 32,
        model_type: "llama",
        rope_theta: 500000.0,
    },
    PresetShape {
        name: "llama3-70b",
        hidden_size: 8192,
        intermediate_size: 28672,
        attention_heads: 64,
        model_type: "llama",
        rope_theta: 500000.0,
    },
    PresetShape {
        name: "llama3.1-70b",
        hidden_size: 8192,
        intermediate_size: 28672,
        attention_heads: 64,
        model_type: "llama",
        rope_theta: 500000.0,
    },
    PresetShape {
        name: "qwen3-8b",
        hidden_size: 4096,
        intermediate_size: 12288,
        attention_heads: 32,
        model_type: "qwen3",
        rope_theta: 1000000.0,
    },
    PresetShape {
        name: "qwen3-14b",
        hidden_size: 5120,
        intermediate_size: 17408,
        attention_heads: 40,
        model_type: "qwen3",
        rope_theta: 1000000.0,
    },
    PresetShape {
        name: "qwen3-32b",
        hidden_size: 5120,
        intermediate_size: 25600,
        attention_heads: 64,
        model_type: "qwen3",
        rope_theta: 1000000.0,
    },
    // GLM-4-9B as transformers builds it natively (THUDM/glm-4-9b-hf, model_type "glm").
    PresetShape {
        name: "glm4-9b",
        hidden_size: 4096,
        intermediate_size: 13696,
        attention_heads: 32,
        model_type: "glm",
        rope_theta: 10000.0,
    },
];

/// Everything the profiler needs to know about the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Preset name, or the name given for a config.json.
    pub name: String,
    pub geometry: KvGeometry,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub attention_heads: u32,
    /// Bytes per weight element (the weights' dtype; 2 for bf16).
    pub weight_bytes: u32,
    /// The config.json it came from, if any (the torch harness builds from it).
    pub config_path: Option<PathBuf>,
}

/// Overrides of the compute shape (flags), applied after the preset or config.
#[derive(Clone, Debug, Default)]
pub struct ShapeOverrides {
    pub hidden_size: Option<u32>,
    pub intermediate_size: Option<u32>,
    pub attention_heads: Option<u32>,
}

impl Shape {
    /// `spec` is a preset name or a config.json path (as `kvtier::model::resolve` decides).
    pub fn resolve(
        spec: &str,
        block_size: u32,
        dtype: Option<DType>,
        name: Option<&str>,
        overrides: &ShapeOverrides,
    ) -> Result<Shape> {
        let geometry = model::resolve(spec, block_size, dtype)?;
        let preset = PRESET_SHAPES
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(spec.trim()));
        let is_path = spec.ends_with(".json") || spec.contains('/') || Path::new(spec).is_file();
        let mut shape = if let (Some(p), false) = (preset, is_path) {
            Shape {
                name: p.name.to_string(),
                geometry,
                hidden_size: p.hidden_size,
                intermediate_size: p.intermediate_size,
                attention_heads: p.attention_heads,
                weight_bytes: 2,
                config_path: None,
            }
        } else if is_path {
            from_config_file(Path::new(spec), geometry, overrides)?
        } else {
            return Err(Error::ModelConfig {
                source_name: spec.to_string(),
                reason: format!(
                    "kvtier knows its KV geometry but the profiler has no hidden/intermediate/head sizes for it; known: {}; pass its config.json instead",
                    PRESET_SHAPES.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
                ),
            });
        };
        if let Some(v) = overrides.hidden_size {
            shape.hidden_size = v;
        }
        if let Some(v) = overrides.intermediate_size {
            shape.intermediate_size = v;
        }
        if let Some(v) = overrides.attention_heads {
            shape.attention_heads = v;
        }
        if let Some(n) = name {
            shape.name = n.to_string();
        }
        for (what, v) in [
            ("hidden size", shape.hidden_size),
            ("intermediate size", shape.intermediate_size),
            ("attention heads", shape.attention_heads),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!(
                    "model {}: {what} is 0; it must be positive",
                    shape.name
                )));
            }
        }
        Ok(shape)
    }

    /// Elements of the query projection's output: `attention_heads × head_dim`
    /// (equals the hidden size for Llama; not for Qwen3-32B, 64 × 128 = 8192 ≠ 5120).
    pub fn q_dim(&self) -> f64 {
        f64::from(self.attention_heads) * f64::from(self.geometry.head_dim)
    }

    /// Elements of one token's K (or V) for one layer.
    pub fn kv_dim(&self) -> f64 {
        f64::from(self.geometry.kv_heads) * f64::from(self.geometry.head_dim)
    }

    /// The `model` section of a slack table.
    pub fn model_info(&self) -> kvtier::slack::ModelInfo {
        let g = &self.geometry;
        kvtier::slack::ModelInfo {
            name: self.name.clone(),
            layers: g.layers,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            dtype: g.dtype.name().to_string(),
            block_size: g.block_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            attention_heads: self.attention_heads,
        }
    }

    /// A Hugging Face config for the torch harness: the model's own
    /// config.json when it came from one, else one written from the preset.
    pub fn hf_config(&self) -> Result<Value> {
        if let Some(path) = &self.config_path {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            return serde_json::from_str(&text)
                .map_err(|e| Error::invalid(format!("{}: not valid JSON: {e}", path.display())));
        }
        let p = PRESET_SHAPES
            .iter()
            .find(|p| p.name == self.name)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "model {}: no Hugging Face config to build its layers from; pass --model config.json",
                    self.name
                ))
            })?;
        let g = &self.geometry;
        let mut c = json!({
            "model_type": p.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.attention_heads,
            "num_key_value_heads": g.kv_heads,
            "head_dim": g.head_dim,
            "num_hidden_layers": g.layers,
            "torch_dtype": "bfloat16",
            "vocab_size": 1024,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-5,
            "rope_theta": p.rope_theta,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
        });
        if p.model_type == "glm" {
            let m = c.as_object_mut().expect("object");
            m.insert("partial_rotary_factor".into(), json!(0.5));
            m.insert("attention_bias".into(), json!(true));
        }
        Ok(c)
    }
}

/// The section holding the language model (multimodal configs nest it under
/// `text_config`), as kvtier's geometry parser does.
fn section(root: &Map<String, Value>) -> (&Map<String, Value>, &'static str) {
    let has_layers = root.contains_key("num_hidden_layers") || root.contains_key("num_layers");
    match root.get("text_config") {
        Some(Value::Object(t)) if !has_layers => (t, "text_config."),
        _ => (root, ""),
    }
}

fn from_config_file(path: &Path, geometry: KvGeometry, o: &ShapeOverrides) -> Result<Shape> {
    let path = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let src = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|e| Error::ModelConfig {
        source_name: src.clone(),
        reason: format!("cannot read it ({e})"),
    })?;
    let root: Value = serde_json::from_str(&text).map_err(|e| Error::ModelConfig {
        source_name: src.clone(),
        reason: format!("not valid JSON: {e}"),
    })?;
    let Value::Object(root) = &root else {
        return Err(Error::ModelConfig {
            source_name: src,
            reason: "the top level is not a JSON object".into(),
        });
    };
    let (sec, prefix) = section(root);
    let get = |keys: &[&str], flag: &str, over: Option<u32>| -> Result<u32> {
        if let Some(v) = over {
            return Ok(v);
        }
        for k in keys {
            if let Some(v) = sec.get(*k).and_then(Value::as_u64) {
                return u32::try_from(v).map_err(|_| Error::ModelConfig {
                    source_name: src.clone(),
                    reason: format!("\"{prefix}{k}\" is {v}, too large"),
                });
            }
        }
        Err(Error::ModelConfig {
            source_name: src.clone(),
            reason: format!(
                "missing {} (a positive integer the compute time depends on); add it or pass {flag}",
                keys.iter()
                    .map(|k| format!("\"{prefix}{k}\""))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        })
    };
    let hidden_size = get(&["hidden_size"], "--hidden-size", o.hidden_size)?;
    let intermediate_size = get(
        &["intermediate_size", "ffn_hidden_size"],
        "--intermediate-size",
        o.intermediate_size,
    )?;
    let attention_heads = get(
        &["num_attention_heads"],
        "--attention-heads",
        o.attention_heads,
    )?;
    // The weights' dtype: the config's, else bf16 (only weight bytes depend on it).
    let weight_dtype = ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| {
            sec.get(*k)
                .or_else(|| root.get(*k))
                .and_then(Value::as_str)
                .and_then(DType::parse)
        })
        .unwrap_or(DType::BF16);
    let name = root
        .get("_name_or_path")
        .and_then(Value::as_str)
        .and_then(|s| s.rsplit('/').next())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| {
            // .../Meta-Llama-3-8B/config.json -> Meta-Llama-3-8B
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("model");
            if stem == "config" {
                path.parent()
                    .and_then(|p| p.file_name())
                    .and_then(|s| s.to_str())
                    .unwrap_or("model")
                    .to_string()
            } else {
                stem.to_string()
            }
        });
    Ok(Shape {
        name: name.to_ascii_lowercase(),
        geometry,
        hidden_size,
        intermediate_size,
        attention_heads,
        weight_bytes: weight_dtype.bytes(),
        config_path: Some(path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_shapes() {
        for p in kvtier::model::PRESETS {
            let s = Shape::resolve(p.name, 16, None, None, &ShapeOverrides::default()).unwrap();
            assert_eq!(s.geometry.layers, p.layers);
            assert!(s.hidden_size > 0);
        }
        let q = Shape::resolve("qwen3-32b", 16, None, None, &ShapeOverrides::default()).unwrap();
        assert_eq!((q.q_dim(), q.kv_dim()), (8192.0, 1024.0));
        let c = q.hf_config().unwrap();
        assert_eq!(c["model_type"], "qwen3");
        assert_eq!(c["num_hidden_layers"], 64);
        let g = Shape::resolve("glm4-9b", 16, None, None, &ShapeOverrides::default()).unwrap();
        assert_eq!(g.hf_config().unwrap()["partial_rotary_factor"], 0.5);
    }

    #[test]
    fn config_file_and_overrides() {
        let dir =
            std::env::temp_dir().join(format!("kvtier-profiler-shape-{}", std::process::id()));
        let model_dir = dir.join("GLM-4-9B");
        std::fs::create_dir_all(&model_dir).unwrap();
        let path = model_dir.join("config.json");
        std::fs::write(
            &path,
            r#"{"num_layers": 40, "hidden_size": 4096, "ffn_hidden_size": 13696,
                "num_attention_heads": 32, "multi_query_attention": true,
                "multi_query_group_num": 2, "kv_channels": 128, "torch_dtype": "bfloat16"}"#,
        )
        .unwrap();
        let spec = path.to_str().unwrap();
        let s = Shape::resolve(spec, 16, None, None, &ShapeOverrides::default()).unwrap();
        assert_eq!(s.name, "glm-4-9b");
        assert_eq!(
            (s.hidden_size, s.intermediate_size, s.attention_heads),
            (4096, 13696, 32)
        );
        assert_eq!(s.geometry.kv_heads, 2);
        let o = ShapeOverrides {
            intermediate_size: Some(100),
            ..Default::default()
        };
        let s = Shape::resolve(spec, 16, None, Some("glm"), &o).unwrap();
        assert_eq!((s.name.as_str(), s.intermediate_size), ("glm", 100));
        std::fs::write(
            &path,
            r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64,
                "num_key_value_heads": 2, "torch_dtype": "bfloat16"}"#,
        )
        .unwrap();
        let msg = Shape::resolve(spec, 16, None, None, &ShapeOverrides::default())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing \"hidden_size\""), "{msg}");
        assert!(msg.contains("--hidden-size"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
