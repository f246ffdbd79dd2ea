//! A decoder layer on flex as one host computation: RMSNorm, the packed projections, RoPE,
//! the key/value append, causal attention, SwiGLU and both residuals on plain f32 rows.
//!
//! Why: run through burn, a layer is some forty small tensor operations, and at a block of 16
//! rows they cost as much as streaming the weights. Here the only large steps are the four
//! packed products; everything else is a pass over a few kilobytes per row. Every step treats
//! each row on its own in a fixed order, so a block forward is bit-identical to its rows one at
//! a time.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use burn_flex::FlexTensor;

use super::attention::{Heads, HostKv, KvStore, attend};
use super::flex::flex_f32;
use super::lanes::WeightElement;
use super::line::line_aligned;
use super::matmul::ShapeError;
use super::packed::PackedWeight;
use super::pool::{Disjoint, Pool};
use super::q8::{Q8Rows, RowWriter};
use super::qmatmul::QuantMatrix;
use super::rows::{add_assign, rms_norm, rope, silu_mul};
use super::steps::{Laps, Step};
use eesd_core::TreeMask;

use crate::cache::LayerCache;
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
    /// The rows' tree layout (positions by depth, attention to ancestors); `None`: causal.
    pub tree: Option<&'a TreeMask>,
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
    let heads = Heads {
        q: layer.num_heads,
        kv: layer.num_kv_heads,
        d: layer.head_dim,
    };
    if !heads.supported() {
        return None;
    }
    let x_flex = flex_f32(x)?;
    let weights = Weights::of(layer, mlp)?;
    let (cos_t, sin_t) = rope.tables();
    let (cos_f, sin_f) = (flex_f32(cos_t)?, flex_f32(sin_t)?);
    let (cos, sin) = (cos_f.as_slice::<f32>()?, sin_f.as_slice::<f32>()?);
    let mut rows = x_flex.as_slice::<f32>()?.to_vec();
    Some(
        run(layer, heads, &weights, &mut rows, cos, sin, seqs, limit).map(|()| {
            let [t, h] = x.dims();
            Tensor::from_data(TensorData::new(rows, [t, h]), &x.device())
        }),
    )
}

/// A weight matrix in the form a kernel reads.
enum Product {
    /// Panel-order floats.
    Packed(Arc<PackedWeight>),
    /// The file's quantized blocks.
    Quantized(Arc<QuantMatrix>),
}

impl Product {
    /// `y = x · wᵀ`; for quantized weights from `acts` where the rows of `x` were quantized
    /// as they were made.
    fn matmul(
        &self,
        x: &[f32],
        acts: Option<&Q8Rows>,
        y: &mut [f32],
    ) -> std::result::Result<(), ShapeError> {
        match (self, acts) {
            (Product::Packed(m), _) => m.matmul(x, y),
            (Product::Quantized(m), Some(acts)) => m.matmul_quantized(acts, y),
            (Product::Quantized(m), None) => m.matmul(x, y),
        }
    }

    /// Whether the product reads 8-bit activation rows.
    fn quantized(&self) -> bool {
        matches!(self, Product::Quantized(_))
    }

    fn out(&self) -> usize {
        match self {
            Product::Packed(m) => m.out(),
            Product::Quantized(m) => m.out(),
        }
    }
}

/// The matrices and gains of one layer.
struct Weights {
    wqkv: Product,
    wo: Product,
    mlp: Option<(Product, Product)>,
    attn_norm: FlexTensor,
    mlp_norm: FlexTensor,
}

impl Weights {
    fn of(layer: &DecoderLayer, mlp: bool) -> Option<Self> {
        let get = |w: &burn::module::Param<Tensor<2>>| match layer.native.get(w) {
            Some(q) => Some(Product::Quantized(q.clone())),
            None => layer.packed.get(&w.val()).map(Product::Packed),
        };
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

/// Below this many values a per-row step (norm, gating) runs on the calling thread: handing it
/// to the pool would cost more than the step (on SmolLM2: from 6 rows on, where halving the
/// SiLU and norm passes saved 1-3% of a 16-32 row forward).
const PARALLEL_ROW_WORK: usize = 1 << 13;

/// Buffers of one layer's intermediate rows, kept per thread and reused by every call (a
/// forward pass allocates nothing per layer). Each is used from its first cache line
/// ([`line_aligned`]): a product's rows (whose lengths are multiples of 16 floats on SmolLM2)
/// then start on cache lines and take whole-line stores past the caches (module `matmul`).
#[derive(Default)]
struct Scratch {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attended: Vec<f32>,
    projected: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// The 8-bit rows of the next quantized product, made beside its input rows.
    acts: Q8Rows,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// A sequence's new rows after the q/k/v product and RoPE: `qkv` rows `width` apart, the
/// first at position `past`.
struct New<'a> {
    qkv: &'a [f32],
    width: usize,
    past: usize,
    heads: Heads,
    tree: Option<&'a TreeMask>,
}

impl New<'_> {
    /// Appends the rows' keys and values to `kv` (positions `past..`) and writes their
    /// attention into `out`.
    fn store_and_attend<E: WeightElement>(
        &self,
        kv: &mut KvStore<E>,
        out: &mut [f32],
        pool: &Pool,
    ) {
        let Heads { q: nh, kv: nkv, d } = self.heads;
        for (i, row) in self.qkv.chunks_exact(self.width).enumerate() {
            kv.write(
                self.past + i,
                &row[nh * d..(nh + nkv) * d],
                &row[(nh + nkv) * d..],
            );
        }
        attend(
            self.qkv, self.width, kv, self.past, self.heads, self.tree, out, pool,
        );
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    layer: &DecoderLayer,
    heads: Heads,
    w: &Weights,
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    seqs: &mut [SeqRows<'_>],
    limit: usize,
) -> Result<()> {
    let (nh, nkv, d) = (heads.q, heads.kv, heads.d);
    let h = w.wo.out();
    let t = x.len() / h;
    let eps = layer.eps as f32;
    let (Some(attn_norm), Some(mlp_norm)) =
        (w.attn_norm.as_slice::<f32>(), w.mlp_norm.as_slice::<f32>())
    else {
        return Err(ModelError::InvalidArgument(
            "norm gains are not contiguous".into(),
        ));
    };
    // Check every sequence before touching any cache.
    for s in seqs.iter() {
        if s.tree.is_some_and(|tree| tree.rows() != s.rows.len()) {
            return Err(ModelError::InvalidArgument(format!(
                "a tree layout for {} rows given {} rows",
                s.tree.map_or(0, TreeMask::rows),
                s.rows.len()
            )));
        }
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
    let pool = Pool::global();
    // Rows per task for the cheap per-row steps: a few tasks per thread for large blocks; one
    // task (on this thread, no hand-off) when the whole step is a few microseconds.
    let per_task = match t * layer.ffn < PARALLEL_ROW_WORK {
        true => t,
        false => t.div_ceil(pool.threads() * 2).max(1),
    };
    let product = |m: &Product, input: &[f32], acts: Option<&Q8Rows>, y: &mut [f32]| {
        m.matmul(input, acts, y)
            .map_err(|e| ModelError::InvalidArgument(e.to_string()))
    };
    // Normalised rows, each also quantized into `q8` by the task that made it (where the next
    // product reads 8-bit rows): no pass over the block on one thread in between. With `add`,
    // the task first adds its rows of `add` onto `x` (a residual): the sum never waits on one
    // thread, and each row is read where it is normalised.
    let norm_rows = |x: &mut [f32],
                     add: Option<&[f32]>,
                     gain: &[f32],
                     out: &mut [f32],
                     q8: Option<&RowWriter<'_>>| {
        let x = Disjoint(x.as_mut_ptr());
        pool.for_each_chunk(out, per_task * h, &|i, rows| {
            let first = i * per_task * h;
            for (r, o) in rows.chunks_exact_mut(h).enumerate() {
                let at = first + r * h;
                // SAFETY: row `at / h` of `x` (`t` rows of `h`) is this task's alone.
                let row = unsafe { x.slice(at, h) };
                if let Some(add) = add {
                    add_assign(row, &add[at..at + h]);
                }
                rms_norm(row, gain, eps, o);
                if let Some(q8) = q8 {
                    // SAFETY: row `at / h` is this task's alone, below `t`.
                    unsafe { q8.row(at / h, o) };
                }
            }
        });
    };
    // `x += y`, rows spread over the pool like the other per-row steps.
    let add_rows = |x: &mut [f32], y: &[f32]| {
        pool.for_each_chunk(x, per_task * h, &|i, rows| {
            let first = i * per_task * h;
            add_assign(rows, &y[first..]);
        });
    };
    SCRATCH.with_borrow_mut(|scratch| {
        let Scratch {
            normed,
            qkv,
            attended,
            projected,
            gate_up,
            act,
            acts,
        } = scratch;
        let mut laps = Laps::start();
        // Attention half.
        let normed = line_aligned(normed, t * h);
        let quantized = w.wqkv.quantized();
        norm_rows(
            x,
            None,
            attn_norm,
            normed,
            quantized.then(|| acts.writer(t, h)).as_ref(),
        );
        let qkv_w = (nh + 2 * nkv) * d;
        let qkv = line_aligned(qkv, t * qkv_w);
        laps.done(Step::AttnNorm);
        product(&w.wqkv, normed, quantized.then_some(&*acts), qkv)?;
        laps.done(Step::Qkv);
        let attended = line_aligned(attended, t * nh * d);
        for s in seqs.iter_mut() {
            let past = s.cache.as_ref().map_or(0, |c| c.len());
            let n = s.rows.len();
            let rows = &mut qkv[s.rows.start * qkv_w..s.rows.end * qkv_w];
            let tree = s.tree;
            pool.for_each_chunk(rows, per_task * qkv_w, &|c, rows| {
                for (j, row) in rows.chunks_exact_mut(qkv_w).enumerate() {
                    let i = c * per_task + j;
                    let pos = past + tree.map_or(i, |t| t.depths()[i]);
                    let (cos, sin) = (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]);
                    rope(&mut row[..(nh + nkv) * d], d, cos, sin);
                }
            });
            laps.done(Step::Rope);
            let dtype = layer.kv_dtype();
            let mut local = HostKv::new(dtype, nkv, d);
            let kv = match s.cache.as_deref_mut() {
                Some(cache) => cache.host_store(nkv, d, past + n, limit, dtype)?,
                None => {
                    local.reserve(n);
                    &mut local
                }
            };
            let out = &mut attended[s.rows.start * nh * d..s.rows.end * nh * d];
            let new = New {
                qkv: &qkv[s.rows.start * qkv_w..s.rows.end * qkv_w],
                width: qkv_w,
                past,
                heads,
                tree: s.tree,
            };
            match kv {
                HostKv::F32(kv) => new.store_and_attend(kv, out, pool),
                HostKv::F16(kv) => new.store_and_attend(kv, out, pool),
            }
            if let Some(cache) = s.cache.as_deref_mut() {
                cache.set_len(past + n);
            }
            laps.done(Step::Attention);
        }
        let projected = line_aligned(projected, t * h);
        // The attended rows quantized in parallel where the output projection reads 8 bits.
        let quantized = w.wo.quantized();
        if quantized {
            let q8 = acts.writer(t, nh * d);
            pool.run(t.div_ceil(per_task), &|c| {
                for r in c * per_task..((c + 1) * per_task).min(t) {
                    // SAFETY: row `r` is this task's alone, below `t`.
                    unsafe { q8.row(r, &attended[r * nh * d..(r + 1) * nh * d]) };
                }
            });
        }
        laps.done(Step::AttendedQuant);
        product(&w.wo, attended, quantized.then_some(&*acts), projected)?;
        laps.done(Step::OutProj);

        // MLP half: its norm's tasks add the attention's residual first.
        if let Some((w_gate_up, w_down)) = &w.mlp {
            let quantized = w_gate_up.quantized();
            norm_rows(
                x,
                Some(projected),
                mlp_norm,
                normed,
                quantized.then(|| acts.writer(t, h)).as_ref(),
            );
            let ffn = w_gate_up.out() / 2;
            let gate_up = line_aligned(gate_up, t * 2 * ffn);
            laps.done(Step::MlpNorm);
            product(w_gate_up, normed, quantized.then_some(&*acts), gate_up)?;
            laps.done(Step::GateUp);
            let act = line_aligned(act, t * ffn);
            let quantized = w_down.quantized();
            let q8 = quantized.then(|| acts.writer(t, ffn));
            pool.for_each_chunk(act, per_task * ffn, &|i, rows| {
                let first = i * per_task;
                for (r, out) in rows.chunks_exact_mut(ffn).enumerate() {
                    let gu = &gate_up[(first + r) * 2 * ffn..][..2 * ffn];
                    silu_mul(&gu[..ffn], &gu[ffn..], out);
                    if let Some(q8) = &q8 {
                        // SAFETY: row `first + r` is this task's alone, below `t`.
                        unsafe { q8.row(first + r, out) };
                    }
                }
            });
            laps.done(Step::Gating);
            product(w_down, act, quantized.then_some(&*acts), projected)?;
            laps.done(Step::Down);
        }
        // The MLP's residual, or the attention's in a layer without its MLP half.
        add_rows(x, projected);
        laps.done(Step::Residual);
        Ok(())
    })
}
