//! Rotary position embeddings in the rotate-half convention (Hugging Face layout).
//!
//! GGUF checkpoints store q/k rows permuted for the interleaved-pair convention; the loader
//! un-permutes them (see [`crate::weights`]) so that one implementation serves both formats.
//! Rotate-half needs only two contiguous slices per call, which is cheaper than de-interleaving.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::config::LlamaConfig;

/// Precomputed cos/sin tables for every position of the context.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `[context, head_dim]`, halves duplicated.
    cos: Tensor<2>,
    /// `[context, head_dim]`, halves duplicated.
    sin: Tensor<2>,
    half: usize,
}

/// Inverse frequencies `θ^(−2i/d)`, with Llama-3 scaling applied when configured.
pub fn inverse_frequencies(config: &LlamaConfig) -> Vec<f64> {
    let dim = config.head_dim();
    (0..dim / 2)
        .map(|i| {
            let f = 1.0 / config.rope_theta.powf(2.0 * i as f64 / dim as f64);
            match &config.rope_scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / s.high_freq_factor {
                        f
                    } else if wavelen > old / s.low_freq_factor {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

impl Rope {
    /// Builds the tables for `config.context_length` positions.
    pub fn new(config: &LlamaConfig, device: &Device) -> Self {
        let dim = config.head_dim();
        let half = dim / 2;
        let inv = inverse_frequencies(config);
        let n = config.context_length;
        let mut cos = Vec::with_capacity(n * dim);
        let mut sin = Vec::with_capacity(n * dim);
        for p in 0..n {
            for j in 0..dim {
                let angle = p as f64 * inv[j % half];
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [n, dim]), device);
        Rope {
            cos: table(cos),
            sin: table(sin),
            half,
        }
    }

    /// The full `(cos, sin)` tables, `[context, head_dim]` each.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    pub(crate) fn tables(&self) -> (&Tensor<2>, &Tensor<2>) {
        (&self.cos, &self.sin)
    }

    /// Positions the tables cover (the context length).
    pub fn len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Whether the tables are empty (a zero context).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `(cos, sin)` rows for positions `start..start + len`, shaped `[1, len, head_dim]`.
    pub fn slice(&self, start: usize, len: usize) -> (Tensor<3>, Tensor<3>) {
        let cos = self.cos.clone().narrow(0, start, len).unsqueeze_dim(0);
        let sin = self.sin.clone().narrow(0, start, len).unsqueeze_dim(0);
        (cos, sin)
    }

    /// The `(cos, sin)` rows for arbitrary `positions` (a tree block's depths), shaped
    /// `[1, positions.len(), head_dim]`.
    pub fn gather(&self, positions: &[usize]) -> (Tensor<3>, Tensor<3>) {
        let ids: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let device = self.cos.device();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [positions.len()]), &device);
        let pick = |t: &Tensor<2>| t.clone().select(0, ids.clone()).unsqueeze_dim(0);
        (pick(&self.cos), pick(&self.sin))
    }

    /// Rotates `x: [heads, len, head_dim]` with tables from [`Rope::slice`].
    pub fn apply(&self, x: Tensor<3>, cos: &Tensor<3>, sin: &Tensor<3>) -> Tensor<3> {
        let [h, t, d] = x.dims();
        let x1 = x.clone().narrow(2, 0, self.half);
        let x2 = x.clone().narrow(2, self.half, d - self.half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 2);
        debug_assert_eq!(rotated.dims(), [h, t, d]);
        x * cos.clone() + rotated * sin.clone()
    }
}
