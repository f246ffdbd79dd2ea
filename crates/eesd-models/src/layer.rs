//! One LLaMA decoder layer: RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU MLP.
//!
//! Weights are stored `[out, in]` (see [`linear`]) and fused where one matmul can
//! replace several: q/k/v share one projection and gate/up another, so a decode step issues two
//! large matmuls instead of five small ones.

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use std::ops::Range;

use std::sync::Arc;

use burn::tensor::{Bool, DType, Device, FloatDType, Tensor, TensorData};
use eesd_core::TreeMask;

use crate::cache::LayerCache;
use crate::config::LlamaConfig;
use crate::cpu::PackedCache;
use crate::cpu::attention::KvDtype;
use crate::error::{ModelError, Result};
use crate::native::{NativeWeights, quant_linear};
use crate::rope::Rope;

/// RMSNorm: `x / sqrt(mean(x²) + ε) · γ` over the last dimension.
pub fn rms_norm(x: Tensor<2>, gamma: Tensor<1>, eps: f64) -> Tensor<2> {
    rms_normalize(x, eps).mul(gamma.unsqueeze_dim(0))
}

/// RMSNorm without a gain: `x / sqrt(mean(x²) + ε)` over the last dimension.
pub fn rms_normalize(x: Tensor<2>, eps: f64) -> Tensor<2> {
    let rms = x.clone().square().mean_dim(1).add_scalar(eps).sqrt();
    x.div(rms)
}

/// `x · wᵀ` for a weight stored `[out, in]`, with `x` cast to the weight's dtype and the result
/// back to f32 (half-precision weights halve memory traffic while norms, softmax and the residual
/// stream stay in f32).
///
/// The product is computed as `(w · xᵀ)ᵀ`: the CPU gemm then vectorises along the long `out`
/// dimension and streams each weight row once, so a block of a few tokens costs little more than
/// one. With `x · w[in, out]` it vectorises along the block's few rows instead, and verifying 8
/// tokens would cost 5× one token (measured: `cargo run --release --example block_cost`).
///
/// On flex (outside autodiff) every block goes through the packed CPU kernel of
/// [`crate::cpu`] instead, with f32 activations against f32, f16 or bf16 weights: memory-bound
/// for a few rows, FMA-bound for many, and batch-invariant (a block's rows equal the rows run
/// one at a time, bit for bit). `cache` keeps the weight's packed copy.
pub fn linear(x: Tensor<2>, w: &Tensor<2>, cache: &PackedCache) -> Tensor<2> {
    #[cfg(feature = "flex")]
    if let Some(y) = crate::cpu::packed_linear(&x, w, cache) {
        return y;
    }
    #[cfg(not(feature = "flex"))]
    let _ = cache;
    let dtype = w.dtype();
    let y = w.clone().matmul(cast_to(x, dtype).transpose()).transpose();
    cast_to(y, DType::F32)
}

/// Casts a float tensor unless it already has `dtype`.
pub fn cast_to<const D: usize>(t: Tensor<D>, dtype: DType) -> Tensor<D> {
    if t.dtype() == dtype {
        return t;
    }
    let target = match dtype {
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        DType::F64 => FloatDType::F64,
        _ => FloatDType::F32,
    };
    t.cast(target)
}

/// Position-dependent inputs shared by all layers of one forward call.
#[derive(Debug, Clone)]
pub struct AttentionContext {
    /// RoPE cos rows for the new positions, `[1, t, head_dim]`.
    pub cos: Tensor<3>,
    /// RoPE sin rows for the new positions, `[1, t, head_dim]`.
    pub sin: Tensor<3>,
    /// The independent sequences of the block, in row order: one for an ordinary call, several
    /// for a packed training block (see [`AttentionContext::packed`]).
    pub segments: Vec<Segment>,
}

/// One sequence's rows of a block and its causal mask.
#[derive(Debug, Clone)]
pub struct Segment {
    /// The block rows holding this sequence's new tokens.
    pub rows: Range<usize>,
    /// Causal mask for its grouped scores `[kv_heads, group·len, past + len]` (`true` =
    /// masked); `None` when a single new token may attend to everything.
    pub mask: Option<Tensor<3, Bool>>,
    /// The rows' tree layout (positions by depth, attention to ancestors); `None` for causal
    /// rows.
    pub tree: Option<Arc<TreeMask>>,
}

impl AttentionContext {
    /// Builds the context for `t` new tokens after `past` cached positions.
    pub fn new(rope: &Rope, past: usize, t: usize, kv_heads: usize, group: usize) -> Self {
        let (cos, sin) = rope.slice(past, t);
        let mask = causal_mask(t, past, kv_heads, group, &cos.device());
        AttentionContext {
            cos,
            sin,
            segments: vec![Segment {
                rows: 0..t,
                mask,
                tree: None,
            }],
        }
    }

    /// The context of a tree block after `past` cached positions: row `r` sits at position
    /// `past + depth(r)` and attends to the cache and to its ancestors (itself included).
    pub fn tree(rope: &Rope, config: &LlamaConfig, past: usize, tree: Arc<TreeMask>) -> Self {
        let positions: Vec<usize> = tree.depths().iter().map(|d| past + d).collect();
        let (cos, sin) = rope.gather(&positions);
        let mask = tree_mask(&tree, past, config, &cos.device());
        AttentionContext {
            cos,
            sin,
            segments: vec![Segment {
                rows: 0..tree.rows(),
                mask,
                tree: Some(tree),
            }],
        }
    }

    /// Several independent trees packed one after another, each from position 0 and without a
    /// cache (a lookahead head trained on its own states: each sequence's rows form a tree).
    pub fn packed_trees(
        rope: &Rope,
        config: &LlamaConfig,
        trees: &[Arc<TreeMask>],
    ) -> Result<Self> {
        if trees.is_empty() {
            return Err(ModelError::InvalidArgument(
                "a packed block of trees needs at least one tree".into(),
            ));
        }
        let positions: Vec<usize> = trees
            .iter()
            .flat_map(|t| t.depths().iter().copied())
            .collect();
        if let Some(&deepest) = positions.iter().max()
            && deepest >= rope.len()
        {
            return Err(ModelError::ContextOverflow {
                needed: deepest + 1,
                limit: rope.len(),
            });
        }
        let (cos, sin) = rope.gather(&positions);
        let mut start = 0;
        let segments = trees
            .iter()
            .map(|tree| {
                let rows = start..start + tree.rows();
                start = rows.end;
                Segment {
                    rows,
                    mask: tree_mask(tree, 0, config, &cos.device()),
                    tree: Some(tree.clone()),
                }
            })
            .collect();
        Ok(AttentionContext { cos, sin, segments })
    }

    /// [`AttentionContext::new`] with the head counts of `config`.
    pub fn for_config(rope: &Rope, config: &LlamaConfig, past: usize, t: usize) -> Self {
        let (kv_heads, group) = head_groups(config);
        Self::new(rope, past, t, kv_heads, group)
    }

    /// A block of several independent sequences packed one after another (`lengths`, in
    /// order), each starting at position 0 and attending only to itself. Training runs many
    /// short sequences as one block this way: the projections see one large matrix, attention
    /// stays per sequence. Packed blocks run without a KV cache.
    pub fn packed(rope: &Rope, config: &LlamaConfig, lengths: &[usize]) -> Result<Self> {
        if lengths.is_empty() || lengths.contains(&0) {
            return Err(ModelError::InvalidArgument(format!(
                "packed block of sequence lengths {lengths:?}: needs at least one non-empty sequence"
            )));
        }
        if let Some(&needed) = lengths.iter().find(|&&n| n > rope.len()) {
            return Err(ModelError::ContextOverflow {
                needed,
                limit: rope.len(),
            });
        }
        let (kv_heads, group) = head_groups(config);
        let (mut cos, mut sin, mut segments) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for &len in lengths {
            let (c, s) = rope.slice(0, len);
            let mask = causal_mask(len, 0, kv_heads, group, &c.device());
            cos.push(c);
            sin.push(s);
            segments.push(Segment {
                rows: start..start + len,
                mask,
                tree: None,
            });
            start += len;
        }
        Ok(AttentionContext {
            cos: Tensor::cat(cos, 1),
            sin: Tensor::cat(sin, 1),
            segments,
        })
    }

    /// Rows of the block.
    pub fn rows(&self) -> usize {
        self.cos.dims()[1]
    }
}

/// `(kv_heads, query heads per kv head)` of a model.
fn head_groups(config: &LlamaConfig) -> (usize, usize) {
    (
        config.num_kv_heads,
        config.num_heads / config.num_kv_heads.max(1),
    )
}

/// The grouped mask of a tree's rows after `past` cached positions (each row sees the cache
/// and its ancestors); `None` for one row.
fn tree_mask(
    tree: &TreeMask,
    past: usize,
    config: &LlamaConfig,
    device: &Device,
) -> Option<Tensor<3, Bool>> {
    let t = tree.rows();
    let (kv_heads, group) = head_groups(config);
    (t > 1).then(|| {
        let mut masked = vec![false; t * (past + t)];
        for r in 0..t {
            let row = &mut masked[r * (past + t) + past..(r + 1) * (past + t)];
            row.fill(true);
            for &a in tree.ancestors(r) {
                row[a] = false;
            }
        }
        Tensor::<2, Bool>::from_data(TensorData::new(masked, [t, past + t]), device)
            .repeat_dim(0, group)
            .unsqueeze_dim::<3>(0)
            .repeat_dim(0, kv_heads)
    })
}

/// The grouped causal mask of `t` new rows after `past` positions; `None` for one row.
fn causal_mask(
    t: usize,
    past: usize,
    kv_heads: usize,
    group: usize,
    device: &Device,
) -> Option<Tensor<3, Bool>> {
    (t > 1).then(|| {
        Tensor::<2, Bool>::tril_mask([t, past + t], past as i64, device)
            .repeat_dim(0, group)
            .unsqueeze_dim::<3>(0)
            .repeat_dim(0, kv_heads)
    })
}

/// A LLaMA decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Pre-attention RMSNorm gain `[hidden]`.
    pub attn_norm: Param<Tensor<1>>,
    /// Fused q/k/v projection `[(heads + 2·kv_heads)·head_dim, hidden]`.
    pub wqkv: Param<Tensor<2>>,
    /// Output projection `[hidden, heads·head_dim]`.
    pub wo: Param<Tensor<2>>,
    /// Pre-MLP RMSNorm gain `[hidden]`.
    pub mlp_norm: Param<Tensor<1>>,
    /// Fused gate/up projection `[2·ffn, hidden]`.
    pub w_gate_up: Param<Tensor<2>>,
    /// Down projection `[hidden, ffn]`.
    pub w_down: Param<Tensor<2>>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Inner MLP width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// Packed copies of the four weight matrices for the flex CPU kernel (filled on first use).
    #[module(skip)]
    pub packed: PackedCache,
    /// The weight matrices kept in their file's block format ([`crate::WeightDType::Native`]);
    /// empty otherwise, and in clones.
    #[module(skip)]
    pub native: NativeWeights,
}

impl DecoderLayer {
    /// How the CPU layer stores this layer's keys and values: f32 beside f32 weights (an f32
    /// model stays exact), else f16, half the bytes a step reads from a long cache.
    pub fn kv_dtype(&self) -> KvDtype {
        match self.native.get(&self.wqkv).is_none() && self.wqkv.dtype() == DType::F32 {
            true => KvDtype::F32,
            false => KvDtype::F16,
        }
    }

    /// Runs the layer on `x: [t, hidden]`. With a cache, the new keys/values are appended and
    /// attention covers every cached position; without one, attention covers `x` alone.
    ///
    /// On flex (outside autodiff) the whole layer runs as one fused host computation
    /// ([`crate::cpu`]); elsewhere through burn's tensor operations.
    pub fn forward(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        mut cache: Option<&mut LayerCache>,
        limit: usize,
    ) -> Result<Tensor<2>> {
        if let Some(y) = self.fused(&x, rope, ctx, cache.as_deref_mut(), limit, true) {
            return y;
        }
        let x = self.attention_residual(x, rope, ctx, cache, limit)?;
        Ok(self.mlp_residual(x))
    }

    /// The attention half alone, `x + attention(norm(x))`: the block of a Kangaroo-style
    /// adapter head (the MLP weights are not touched).
    pub fn forward_attention_only(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        mut cache: Option<&mut LayerCache>,
        limit: usize,
    ) -> Result<Tensor<2>> {
        if let Some(y) = self.fused(&x, rope, ctx, cache.as_deref_mut(), limit, false) {
            return y;
        }
        self.attention_residual(x, rope, ctx, cache, limit)
    }

    /// The fused flex path for a block described by `ctx` (`None` when it does not apply).
    fn fused(
        &self,
        x: &Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        cache: Option<&mut LayerCache>,
        limit: usize,
        mlp: bool,
    ) -> Option<Result<Tensor<2>>> {
        #[cfg(feature = "flex")]
        {
            use crate::cpu::decoder::{SeqRows, forward};
            let mut seqs: Vec<SeqRows<'_>> = match (ctx.segments.as_slice(), cache) {
                ([seg], cache) => vec![SeqRows {
                    rows: seg.rows.clone(),
                    cache,
                    tree: seg.tree.as_deref(),
                }],
                (segs, None) => segs
                    .iter()
                    .map(|seg| SeqRows {
                        rows: seg.rows.clone(),
                        cache: None,
                        tree: seg.tree.as_deref(),
                    })
                    .collect(),
                // A packed block with a cache: burn's path reports the error.
                (_, Some(_)) => return None,
            };
            forward(self, x, rope, &mut seqs, limit, mlp)
        }
        #[cfg(not(feature = "flex"))]
        {
            let _ = (x, rope, ctx, cache, limit, mlp);
            None
        }
    }

    /// `x + attention(norm(x))` through burn's tensor operations.
    fn attention_residual(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        cache: Option<&mut LayerCache>,
        limit: usize,
    ) -> Result<Tensor<2>> {
        let qkv = self.project(
            rms_norm(x.clone(), self.attn_norm.val(), self.eps),
            &self.wqkv,
        );
        let out = self.attend(qkv, rope, ctx, cache, limit)?;
        Ok(x + self.project(out, &self.wo))
    }

    /// Runs the layer on one new token from each of `b` independent sequences, `x: [b, hidden]`,
    /// sequence `s` at position `positions[s]` with its own cache `caches[s]`. The projections
    /// and the MLP run as one `b`-row block (a block costs little more than one row); only the
    /// attention runs per sequence.
    pub fn forward_batch(
        &self,
        x: Tensor<2>,
        rope: &Rope,
        positions: &[usize],
        caches: &mut [&mut LayerCache],
        limit: usize,
    ) -> Result<Tensor<2>> {
        if positions.len() != caches.len()
            || caches.iter().zip(positions).any(|(c, &p)| c.len() != p)
        {
            return Err(ModelError::InvalidArgument(
                "forward_batch: each sequence's position must be its cache length".into(),
            ));
        }
        #[cfg(feature = "flex")]
        {
            use crate::cpu::decoder::{SeqRows, forward};
            let mut seqs: Vec<SeqRows<'_>> = caches
                .iter_mut()
                .enumerate()
                .map(|(s, cache)| SeqRows {
                    rows: s..s + 1,
                    cache: Some(&mut **cache),
                    tree: None,
                })
                .collect();
            if let Some(y) = forward(self, &x, rope, &mut seqs, limit, true) {
                return y;
            }
        }
        let qkv = self.project(
            rms_norm(x.clone(), self.attn_norm.val(), self.eps),
            &self.wqkv,
        );
        let mut outs = Vec::with_capacity(caches.len());
        for (s, (cache, &past)) in caches.iter_mut().zip(positions).enumerate() {
            let ctx = AttentionContext::new(rope, past, 1, self.num_kv_heads, self.group());
            outs.push(self.attend(qkv.clone().narrow(0, s, 1), rope, &ctx, Some(cache), limit)?);
        }
        let h = self.project(Tensor::cat(outs, 0), &self.wo);
        Ok(self.mlp_residual(x + h))
    }

    /// `x · wᵀ` for one of this layer's weights.
    pub(crate) fn project(&self, x: Tensor<2>, w: &Param<Tensor<2>>) -> Tensor<2> {
        if let Some(y) = self.native.get(w).and_then(|q| quant_linear(&x, q)) {
            return y;
        }
        linear(x, &w.val(), &self.packed)
    }

    /// Packs the weight matrices for the flex CPU kernel now rather than on first use (no-op on
    /// other backends and for native weights, which the kernel reads as they are).
    pub fn prepare(&self) {
        #[cfg(feature = "flex")]
        for w in [&self.wqkv, &self.wo, &self.w_gate_up, &self.w_down] {
            if self.native.get(w).is_none() {
                self.packed.get(&w.val());
            }
        }
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Attention of one sequence's new rows given their fused projections `qkv: [t, …]`;
    /// returns the heads' outputs `[t, heads·head_dim]` before the output projection.
    fn attend(
        &self,
        qkv: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        cache: Option<&mut LayerCache>,
        limit: usize,
    ) -> Result<Tensor<2>> {
        let [t, _] = qkv.dims();
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let group = self.group();
        let heads = |start: usize, n: usize| {
            qkv.clone()
                .narrow(1, start * d, n * d)
                .reshape([t, n, d])
                .swap_dims(0, 1)
        };
        // Queries and keys rotate together, in one pass over their heads: the same elementwise
        // arithmetic, half the operations (a GPU step is bound by their count, not their size).
        let qk = rope.apply(heads(0, nh + nkv), &ctx.cos, &ctx.sin);
        let q = qk.clone().narrow(0, 0, nh);
        let k = qk.narrow(0, nh, nkv);
        let v = heads(nh + nkv, nkv);
        let packed = ctx.segments.len() > 1;
        if packed && cache.is_some() {
            return Err(ModelError::InvalidArgument(
                "a packed block of several sequences runs without a KV cache".into(),
            ));
        }
        let (k, v) = match cache {
            Some(cache) => cache.append(k, v, limit)?,
            None => (k, v),
        };
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::with_capacity(ctx.segments.len());
        for seg in &ctx.segments {
            let len = seg.rows.len();
            let rows = |x: &Tensor<3>| match packed {
                true => x.clone().narrow(1, seg.rows.start, len),
                false => x.clone(),
            };
            // Group query heads by their kv head: [nh, len, d] → [nkv, group·len, d]; no K/V
            // copies.
            let q = rows(&q).reshape([nkv, group * len, d]);
            let scores = q.matmul(rows(&k).swap_dims(1, 2)).mul_scalar(scale);
            let scores = match &seg.mask {
                Some(mask) => scores.mask_fill(mask.clone(), f32::NEG_INFINITY),
                None => scores,
            };
            let out = softmax(scores, 2).matmul(rows(&v));
            outs.push(
                out.reshape([nh, len, d])
                    .swap_dims(0, 1)
                    .reshape([len, nh * d]),
            );
        }
        Ok(match outs.len() {
            1 => outs.remove(0),
            _ => Tensor::cat(outs, 0),
        })
    }

    /// The MLP half, `x + mlp(norm(x))`.
    fn mlp_residual(&self, x: Tensor<2>) -> Tensor<2> {
        let gu = self.project(
            rms_norm(x.clone(), self.mlp_norm.val(), self.eps),
            &self.w_gate_up,
        );
        let gate = gu.clone().narrow(1, 0, self.ffn);
        let up = gu.narrow(1, self.ffn, self.ffn);
        x + self.project(silu(gate) * up, &self.w_down)
    }
}
