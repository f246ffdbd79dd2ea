//! A decoder layer on flex as one host computation: RMSNorm, the packed projections, RoPE,
//! the key/value append, causal attention, SwiGLU and both residuals on plain f32 rows.
//!
//! Why: run through burn, a layer is some forty small tensor operations, and at a block of 16
//! rows they cost as much as streaming the weights. Here the only large steps are the four
//! packed products; everything else is a pass over a few kilobytes per row. Every step treats
//! each row on its own in a fixed order, so a block forward is bit-identical to its rows one at
//! a time.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use burn_flex::{Flex, FlexTensor};

use super::attention::{Heads, KvRows, attend};
use super::packed::PackedWeight;
use super::pool::Pool;
use super::rows::{rms_norm, rope, silu_mul};
use crate::cache::{HostKv, LayerCache};
use crate::error::{ModelError, Result};
use crate::layer::DecoderLayer;
use crate::rope::Rope;

/// The rows of a block that belong to one sequence, and the cache that sequence extends
/// (`None`: a sequence of a packed training block, attending within itself from position 0).
pub(crate) struct SeqRows<'a> {
    /// Block rows of the sequence.
    pub rows: Range<usize>,
    /// Its cache.
    pub cache: Option<&'a mut LayerCache>,
}

/// The flex storage of an f32 tensor, or `None` for any other tensor.
fn flex_f32<const D: usize>(t: &Tensor<D>) -> Option<FlexTensor> {
    let flex = t.clone().try_into_primitive::<Flex>().ok()?;
    (flex.dtype() == burn::tensor::DType::F32).then_some(flex)
}

/// Runs `layer` (its attention half, and the MLP half when `mlp`) on `x: [t, hidden]` for the
/// sequences `seqs`, or returns `None` when the fused path does not apply (not flex, autodiff,
/// non-float weights): the caller then runs burn's path. Nothing is modified before that
/// decision.
pub(crate) fn forward(
    layer: &DecoderLayer,
    x: &Tensor<2>,
    rope: &Rope,
    seqs: &mut [SeqRows<'_>],
    limit: usize,
    mlp: bool,
) -> Option<Result<Tensor<2>>> {
    let x_flex = flex_f32(x)?;
    let weights = Weights::of(layer, mlp)?;
    let (cos_t, sin_t) = rope.tables();
    let (cos_f, sin_f) = (flex_f32(cos_t)?, flex_f32(sin_t)?);
    let (cos, sin) = (cos_f.as_slice::<f32>()?, sin_f.as_slice::<f32>()?);
    let x_flex = match x_flex.is_contiguous() {
        true => x_flex,
        false => x_flex.to_contiguous(),
    };
    let mut rows = x_flex.as_slice::<f32>()?.to_vec();
    Some(
        run(layer, &weights, &mut rows, cos, sin, seqs, limit).map(|()| {
            let [t, h] = x.dims();
            Tensor::from_data(TensorData::new(rows, [t, h]), &x.device())
        }),
    )
}

/// The packed matrices and gains of one layer.
struct Weights {
    wqkv: Arc<PackedWeight>,
    wo: Arc<PackedWeight>,
    mlp: Option<(Arc<PackedWeight>, Arc<PackedWeight>)>,
    attn_norm: FlexTensor,
    mlp_norm: FlexTensor,
}

impl Weights {
    fn of(layer: &DecoderLayer, mlp: bool) -> Option<Self> {
        let get = |w: &burn::module::Param<Tensor<2>>| layer.packed.get(&w.val());
        Some(Weights {
            wqkv: get(&layer.wqkv)?,
            wo: get(&layer.wo)?,
            mlp: match mlp {
                true => Some((get(&layer.w_gate_up)?, get(&layer.w_down)?)),
                false => None,
            },
            attn_norm: flex_f32(&layer.attn_norm.val())?,
            mlp_norm: flex_f32(&layer.mlp_norm.val())?,
        })
    }
}

fn run(
    layer: &DecoderLayer,
    w: &Weights,
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    seqs: &mut [SeqRows<'_>],
    limit: usize,
) -> Result<()> {
    let heads = Heads {
        q: layer.num_heads,
        kv: layer.num_kv_heads,
        d: layer.head_dim,
    };
    let (nh, nkv, d) = (heads.q, heads.kv, heads.d);
    let h = w.wo.out();
    let t = x.len() / h;
    let eps = layer.eps as f32;
    let gain = |f: &FlexTensor| f.as_slice::<f32>().map(<[f32]>::to_vec);
    let (attn_norm, mlp_norm) = match (gain(&w.attn_norm), gain(&w.mlp_norm)) {
        (Some(a), Some(m)) => (a, m),
        _ => {
            return Err(ModelError::InvalidArgument(
                "norm gains are not contiguous".into(),
            ));
        }
    };
    // Check every sequence before touching any cache.
    for s in seqs.iter() {
        let past = s.cache.as_ref().map_or(0, |c| c.len());
        let end = past + s.rows.len();
        if end > limit || end > cos.len() / d {
            return Err(ModelError::ContextOverflow { needed: end, limit });
        }
        if s.rows.end > t {
            return Err(ModelError::InvalidArgument(format!(
                "rows {:?} of a block of {t}",
                s.rows
            )));
        }
    }
    let product = |m: &PackedWeight, input: &[f32], out: usize| -> Result<Vec<f32>> {
        let mut y = vec![0f32; t * out];
        m.matmul(input, &mut y)
            .map_err(|e| ModelError::InvalidArgument(e.to_string()))?;
        Ok(y)
    };

    // Attention half.
    let mut normed = vec![0f32; t * h];
    for (row, out) in x.chunks_exact(h).zip(normed.chunks_exact_mut(h)) {
        rms_norm(row, &attn_norm, eps, out);
    }
    let qkv_w = (nh + 2 * nkv) * d;
    let mut qkv = product(&w.wqkv, &normed, qkv_w)?;
    let width = nkv * d;
    let mut attended = vec![0f32; t * nh * d];
    for s in seqs.iter_mut() {
        let past = s.cache.as_ref().map_or(0, |c| c.len());
        let n = s.rows.len();
        for (i, r) in s.rows.clone().enumerate() {
            let pos = past + i;
            let (cos, sin) = (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]);
            let row = &mut qkv[r * qkv_w..(r + 1) * qkv_w];
            rope(&mut row[..(nh + nkv) * d], d, cos, sin);
        }
        let mut local = HostKv::default();
        let kv = match s.cache.as_deref_mut() {
            Some(cache) => cache.host_rows(width, past + n, limit)?,
            None => {
                local.k.resize(n * width, 0.0);
                local.v.resize(n * width, 0.0);
                &mut local
            }
        };
        for (i, r) in s.rows.clone().enumerate() {
            let row = &qkv[r * qkv_w..(r + 1) * qkv_w];
            let at = (past + i) * width;
            kv.k[at..at + width].copy_from_slice(&row[nh * d..(nh + nkv) * d]);
            kv.v[at..at + width].copy_from_slice(&row[(nh + nkv) * d..]);
        }
        let q = &qkv[s.rows.start * qkv_w..];
        let out = &mut attended[s.rows.start * nh * d..s.rows.end * nh * d];
        let rows_kv = KvRows {
            k: &kv.k[..(past + n) * width],
            v: &kv.v[..(past + n) * width],
        };
        attend(q, qkv_w, rows_kv, past, heads, out, Pool::global());
        if let Some(cache) = s.cache.as_deref_mut() {
            cache.set_len(past + n);
        }
    }
    let o = product(&w.wo, &attended, h)?;
    x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

    // MLP half.
    if let Some((gate_up, down)) = &w.mlp {
        for (row, out) in x.chunks_exact(h).zip(normed.chunks_exact_mut(h)) {
            rms_norm(row, &mlp_norm, eps, out);
        }
        let ffn = gate_up.out() / 2;
        let gu = product(gate_up, &normed, 2 * ffn)?;
        let mut act = vec![0f32; t * ffn];
        for (row, out) in gu.chunks_exact(2 * ffn).zip(act.chunks_exact_mut(ffn)) {
            silu_mul(&row[..ffn], &row[ffn..], out);
        }
        let dn = product(down, &act, h)?;
        x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
    }
    Ok(())
}
