//! `--compute analytic`: per-layer compute time from FLOPs and bytes against
//! the GPU's peaks. Runs anywhere; its tables say `"estimated": true`.
//!
//! For a prefill of `L_in` new tokens over `L_p` cached ones, one decoder
//! layer of hidden size `h`, `H` query heads and `kvH` KV heads of `d`
//! elements (`q = H·d`, `kv = kvH·d`), MLP intermediate size `I`:
//!
//! - projections: QKV `2·L_in·h·(q + 2·kv)` + O `2·L_in·q·h` FLOPs;
//! - MLP (gate, up, down): `2·3·L_in·h·I` FLOPs;
//! - attention (QKᵀ and PV, causal): `2·2·L_in·(L_p + L_in/2)·H·d` FLOPs: each
//!   new token attends to the whole prefix and, on average, half the new tokens;
//! - bytes through HBM: the layer's weights, the KV of the whole context read
//!   once (`2·kv·(L_p + L_in)` elements), the new KV written (`2·kv·L_in`),
//!   and the matmuls' activations in and out (`L_in·(4h + 2q + 2kv + 3I)`).
//!
//! time = max(matmul FLOPs / (peak × matmul efficiency) + attention FLOPs /
//! (peak × attention efficiency), bytes / HBM bandwidth) + a fixed per-layer
//! overhead (kernel launches and tails of the ~10 kernels of a layer).
//! Defaults: 60% of peak for matmuls, 40% for attention, 20 µs per layer.
//! A decode step is the same with `L_in = 1` over `context − 1` cached tokens,
//! batch 1, summed over the layers (the LM head and sampling are not counted).
//! Every layer of a model has the same shape, so every layer gets the same time.

use crate::shape::Shape;

/// The GPU's peaks.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// The preset key (`h100`, `h200`) used in file names.
    pub key: String,
    pub name: String,
    pub sms: u32,
    /// Dense bf16 TFLOPS.
    pub bf16_tflops: f64,
    /// GB/s.
    pub hbm_gbs: f64,
}

/// GPU presets: (key, name, SMs, dense bf16 TFLOPS, HBM GB/s).
pub const GPU_PRESETS: &[(&str, &str, u32, f64, f64)] = &[
    ("h100", "H100-SXM", 132, 989.0, 3350.0),
    ("h200", "H200", 132, 989.0, 4800.0),
];

impl Gpu {
    pub fn preset(key: &str) -> Option<Gpu> {
        GPU_PRESETS
            .iter()
            .find(|p| p.0.eq_ignore_ascii_case(key.trim()))
            .map(|&(key, name, sms, tflops, hbm)| Gpu {
                key: key.to_string(),
                name: name.to_string(),
                sms,
                bf16_tflops: tflops,
                hbm_gbs: hbm,
            })
    }

    pub fn info(&self) -> kvtier::slack::GpuInfo {
        kvtier::slack::GpuInfo {
            name: self.name.clone(),
            sms: self.sms,
            bf16_tflops: self.bf16_tflops,
            hbm_gbs: self.hbm_gbs,
        }
    }
}

/// The constants of the analytic model.
#[derive(Clone, Debug, PartialEq)]
pub struct Analytic {
    pub matmul_efficiency: f64,
    pub attention_efficiency: f64,
    pub layer_overhead_us: f64,
}

impl Default for Analytic {
    fn default() -> Self {
        Analytic {
            matmul_efficiency: 0.6,
            attention_efficiency: 0.4,
            layer_overhead_us: 20.0,
        }
    }
}

/// FLOPs and HBM bytes of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerCost {
    pub matmul_flops: f64,
    pub attention_flops: f64,
    pub bytes: f64,
}

/// One layer of a prefill of `input` new tokens over `prefix` cached ones.
pub fn layer_cost(shape: &Shape, input: u64, prefix: u64) -> LayerCost {
    let (h, i) = (
        f64::from(shape.hidden_size),
        f64::from(shape.intermediate_size),
    );
    let (q, kv) = (shape.q_dim(), shape.kv_dim());
    let (n, p) = (input as f64, prefix as f64);
    let matmul_flops = 2.0 * n * h * (q + 2.0 * kv) + 2.0 * n * q * h + 2.0 * 3.0 * n * h * i;
    let attention_flops = 2.0 * 2.0 * n * (p + n / 2.0) * q;
    let wb = f64::from(shape.weight_bytes);
    let kvb = f64::from(shape.geometry.dtype.bytes());
    let weights = wb * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let kv_bytes = kvb * 2.0 * kv * (p + n) + kvb * 2.0 * kv * n;
    let activations = wb * n * (4.0 * h + 2.0 * q + 2.0 * kv + 3.0 * i);
    LayerCost {
        matmul_flops,
        attention_flops,
        bytes: weights + kv_bytes + activations,
    }
}

impl Analytic {
    /// Microseconds for a layer of the given cost.
    pub fn time_us(&self, gpu: &Gpu, c: &LayerCost) -> f64 {
        let peak = gpu.bf16_tflops * 1e12;
        let compute_s = c.matmul_flops / (peak * self.matmul_efficiency)
            + c.attention_flops / (peak * self.attention_efficiency);
        let memory_s = c.bytes / (gpu.hbm_gbs * 1e9);
        compute_s.max(memory_s) * 1e6 + self.layer_overhead_us
    }

    /// One layer of a prefill, µs.
    pub fn prefill_layer_us(&self, shape: &Shape, gpu: &Gpu, input: u64, prefix: u64) -> f64 {
        self.time_us(gpu, &layer_cost(shape, input, prefix))
    }

    /// One decode step (one new token, batch 1, every layer) at `context` tokens, µs.
    pub fn decode_step_us(&self, shape: &Shape, gpu: &Gpu, context: u64) -> f64 {
        let per_layer = self.time_us(gpu, &layer_cost(shape, 1, context.saturating_sub(1)));
        per_layer * f64::from(shape.geometry.layers)
    }

    /// The method line of the table's provenance.
    pub fn describe(&self, gpu: &Gpu) -> String {
        format!(
            "analytic: per layer max(matmul FLOPs at {:.0}% and attention FLOPs at {:.0}% of {} dense bf16 TFLOPS, weight+KV+activation bytes at {} GB/s HBM) + {} us overhead; decode batch 1, decoder layers only",
            self.matmul_efficiency * 100.0,
            self.attention_efficiency * 100.0,
            gpu.bf16_tflops,
            gpu.hbm_gbs,
            self.layer_overhead_us
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{Shape, ShapeOverrides};

    fn shape(name: &str) -> Shape {
        Shape::resolve(name, 16, None, None, &ShapeOverrides::default()).unwrap()
    }

    #[test]
    fn llama3_8b_flops() {
        let s = shape("llama3-8b");
        let c = layer_cost(&s, 8192, 0);
        // QKV 2·8192·4096·6144 + O 2·8192·4096² + MLP 6·8192·4096·14336.
        let want = 2.0 * 8192.0 * 4096.0 * 6144.0
            + 2.0 * 8192.0 * 4096.0 * 4096.0
            + 6.0 * 8192.0 * 4096.0 * 14336.0;
        assert_eq!(c.matmul_flops, want);
        assert_eq!(c.attention_flops, 4.0 * 8192.0 * 4096.0 * 4096.0);
        let gpu = Gpu::preset("h100").unwrap();
        let a = Analytic::default();
        let t = a.prefill_layer_us(&s, &gpu, 8192, 0);
        // ~6.0 ms of matmul + ~1.4 ms of attention per layer.
        assert!((7000.0..8000.0).contains(&t), "{t}");
        // Weights dominate a batch-1 decode step: 436 MB/layer at 3.35 TB/s.
        let d = a.decode_step_us(&s, &gpu, 1024);
        assert!((4500.0..5500.0).contains(&d), "{d}");
        let h200 = Gpu::preset("H200").unwrap();
        assert!(a.decode_step_us(&s, &h200, 1024) < d);
    }

    #[test]
    fn monotone_in_input_prefix_and_context() {
        let s = shape("qwen3-32b");
        let gpu = Gpu::preset("h100").unwrap();
        let a = Analytic::default();
        let mut last = 0.0;
        for input in [512, 1024, 4096, 65536] {
            let t = a.prefill_layer_us(&s, &gpu, input, 0);
            assert!(t > last);
            last = t;
        }
        assert!(a.prefill_layer_us(&s, &gpu, 512, 131072) > a.prefill_layer_us(&s, &gpu, 512, 0));
        assert!(a.decode_step_us(&s, &gpu, 131072) > a.decode_step_us(&s, &gpu, 1024));
        assert!(Gpu::preset("a100").is_none());
    }
}
