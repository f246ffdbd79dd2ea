//! Exit heads: from the hidden state after layer N to draft logits.
//!
//! - [`NormHead`]: the model's own final norm + LM head (parameter-free, any layer).
//! - [`LayerHead`]: one decoder layer of its own (initialised from a copy of a model layer),
//!   optionally more after it ([`LayerHead::deepened`]), a norm, and the model's LM head — the
//!   EESD early-exiting layer. Of kind [`HeadKind::Lookahead`] it also reads the embedding of
//!   the token that follows its input position (EAGLE-style input) and drafts the token after
//!   that, for draft trees ([`eesd_core::LookaheadHead`]).
//!
//! Any head can project onto a [`VocabSubset`] instead of the whole vocabulary: on
//! SmolLM2-135M the 49,152 × 576 LM head is 21% of all weights, so a full-vocabulary draft costs
//! a fifth of a decoding step per token. A [`LayerHead`] also projects onto the tokens of its
//! sequence that the subset lacks ([`ContextTokens`], kept in its [`LayerHeadCache`]).
//! Verification always uses the full vocabulary, so a subset changes only the draft quality,
//! never the output.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor};
use eesd_core::{DraftHead, DraftLogits, LookaheadDraft, LookaheadHead};

use crate::cache::KvCache;
use crate::config::LlamaConfig;
pub use crate::draft_vocab::{ContextTokens, VocabSubset};
use crate::draft_vocab::{Projection, q8_0_matrix};
use crate::error::{ModelError, Result};
use crate::layer::{AttentionContext, DecoderLayer, cast_to, rms_norm, rms_normalize};
use crate::llama::Llama;
use crate::native::NativeWeights;
use crate::rope::Rope;

/// The parameter-free head: the model's final RMSNorm and LM head applied to the layer-N hidden
/// state (the LayerSkip-style baseline). Works after any layer; needs no training.
#[derive(Debug, Clone, Default)]
pub struct NormHead {
    projection: Option<Box<Projection>>,
}

impl NormHead {
    /// Projects onto the full vocabulary.
    pub fn new() -> Self {
        NormHead { projection: None }
    }

    /// Projects onto `subset` only (unlike a [`LayerHead`], without the tokens its sequence
    /// brings: this head is a baseline, and keeps no state of the sequence).
    pub fn with_vocab(model: &Llama, subset: &VocabSubset) -> Result<Self> {
        Ok(NormHead {
            projection: Some(Box::new(Projection::new(model, Some(subset))?)),
        })
    }
}

impl DraftHead<Llama> for NormHead {
    type Cache = usize;

    fn exit_layer(&self) -> Option<usize> {
        None
    }

    fn new_cache(&self, _: &Llama) -> usize {
        0
    }

    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        seen: &mut usize,
    ) -> Result<DraftLogits> {
        *seen += hidden.dims()[0];
        Ok(match &self.projection {
            None => DraftLogits {
                logits: model.logits(hidden),
                token_ids: None,
                context_columns: 0,
            },
            Some(p) => p.logits(rms_norm(
                hidden,
                model.final_norm().clone(),
                model.config().rms_norm_eps,
            )),
        })
    }

    fn extend(&self, _: &Llama, hidden: Tensor<2>, seen: &mut usize) -> Result<()> {
        *seen += hidden.dims()[0];
        Ok(())
    }

    fn cached_len(&self, seen: &usize) -> usize {
        *seen
    }

    fn truncate(&self, seen: &mut usize, len: usize) {
        *seen = (*seen).min(len);
    }
}

/// The most decoder layers a [`LayerHead`] may have: a head deeper than this would cost as much
/// to draft with as the model it drafts for, and a checkpoint claiming more is refused.
pub const MAX_HEAD_LAYERS: usize = 8;

/// What the block of a [`LayerHead`] contains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadKind {
    /// EESD's early-exiting layer: a whole decoder layer (attention + SwiGLU MLP).
    #[default]
    Layer,
    /// Kangaroo's adapter: the attention half only (its norm, q/k/v and output projections),
    /// about a quarter of a layer's weights, so drafting streams less memory per token.
    Adapter,
    /// EAGLE-style input: the layer-N state of a verified position and the embedding of the
    /// token after it, each RMS-normalised and fused by a learnt `[hidden, 2·hidden]` matrix
    /// (wider for a head that also reads earlier layers, [`LayerHeadWeights::mix_layers`]),
    /// then a whole decoder layer; it drafts the token after next. Verification computes the
    /// layer-N states of every row anyway, so the first draft of a round costs only the head
    /// (no pass through layers `[0, N)` for the new root), and N may be the last layer.
    Lookahead,
}

impl HeadKind {
    /// The deepest layer a head of this kind can read in a model of `layers` layers: a chain
    /// head needs a layer after its exit to verify with, a lookahead head may read the last.
    pub fn last_exit_layer(self, layers: usize) -> usize {
        match self {
            HeadKind::Lookahead => layers,
            HeadKind::Layer | HeadKind::Adapter => layers - 1,
        }
    }

    /// Whether a head of this kind may have `depth` decoder layers: at most
    /// [`MAX_HEAD_LAYERS`], and an adapter only its one attention half. The one rule that
    /// deepening, building a head from weights and loading a checkpoint each enforce.
    pub(crate) fn allows_depth(self, depth: usize) -> bool {
        depth <= MAX_HEAD_LAYERS && (self != HeadKind::Adapter || depth <= 1)
    }

    /// The name used in checkpoints and on the command line (`layer`, `adapter`,
    /// `lookahead`).
    pub fn name(self) -> &'static str {
        match self {
            HeadKind::Layer => "layer",
            HeadKind::Adapter => "adapter",
            HeadKind::Lookahead => "lookahead",
        }
    }
}

impl std::str::FromStr for HeadKind {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "layer" => Ok(HeadKind::Layer),
            "adapter" => Ok(HeadKind::Adapter),
            "lookahead" => Ok(HeadKind::Lookahead),
            other => Err(ModelError::InvalidArgument(format!(
                "unknown head kind `{other}` (expected `layer`, `adapter` or `lookahead`)"
            ))),
        }
    }
}

/// The trainable part of a [`LayerHead`]: one decoder layer (or its attention half), any
/// further layers after it, and the output norm.
#[derive(Module, Debug)]
pub struct LayerHeadWeights {
    /// The head's own decoder layer. An adapter uses only its attention half; its MLP fields
    /// then still point at the model layer it was copied from and are neither run nor saved.
    pub layer: DecoderLayer,
    /// Whole decoder layers run after `layer` in a deeper head ([`LayerHeadWeights::deepen`]);
    /// empty for the one-layer heads of EESD, Kangaroo and EAGLE.
    pub deeper: Vec<DecoderLayer>,
    /// RMSNorm gain before the (shared, frozen) LM head.
    pub norm: Param<Tensor<1>>,
    /// A lookahead head's input fusion `[hidden, (2 + m)·hidden]`, applied to the normalised
    /// layer-N state, next-token embedding and states of the `m` [`LayerHeadWeights::mix_layers`],
    /// concatenated in that order; `None` for the other kinds.
    pub fuse: Option<Param<Tensor<2>>>,
    /// Whole layer, attention-only adapter or lookahead.
    #[module(skip)]
    pub kind: HeadKind,
    /// Earlier model layers whose states a lookahead head reads beside layer N's (ascending,
    /// each below N; EAGLE-3's mix of low, middle and high features). Verification computes
    /// them anyway; they cost the head only their columns of the fusion. Empty for the other
    /// kinds and for a lookahead head reading layer N alone.
    #[module(skip)]
    pub mix_layers: Vec<usize>,
}

impl LayerHeadWeights {
    /// The weight matrices the first layer runs for this head's kind (an adapter's MLP is
    /// neither run nor saved), and the input fusion, which that layer applies.
    pub fn matrices(&self) -> Vec<&Param<Tensor<2>>> {
        let l = &self.layer;
        let mut matrices = match self.kind {
            HeadKind::Layer | HeadKind::Lookahead => whole_layer_matrices(l),
            HeadKind::Adapter => vec![&l.wqkv, &l.wo],
        };
        matrices.extend(self.fuse.as_ref());
        matrices
    }

    /// The model layers a head of these weights at exit layer `n` reads: the mix layers, then
    /// `n` (what the tree loop hands a lookahead head and a teacher's pass must keep).
    pub fn feature_layers(&self, n: usize) -> Vec<usize> {
        let mut layers = self.mix_layers.clone();
        layers.push(n);
        layers
    }

    /// Decoder layers in the head's block: 1 + [`LayerHeadWeights::deeper`]'s.
    pub fn depth(&self) -> usize {
        1 + self.deeper.len()
    }

    /// The same head with `extra` more decoder layers after its last, each a copy of that
    /// layer with its two output projections (`wo`, `w_down`) zeroed: a layer whose residual
    /// branches add nothing, so the deeper head drafts exactly as before until training moves
    /// them. An adapter head is refused (its block is attention-only by design).
    pub fn deepen(mut self, extra: usize) -> Result<Self> {
        if !self.kind.allows_depth(self.depth().saturating_add(extra)) {
            return Err(ModelError::InvalidArgument(format!(
                "a `{}` head of {} layers deepened by {extra} (at most {MAX_HEAD_LAYERS} \
                 layers; an adapter's block is its one attention half)",
                self.kind.name(),
                self.depth()
            )));
        }
        for _ in 0..extra {
            let last = self.deeper.last().unwrap_or(&self.layer);
            let zeroed = |p: &Param<Tensor<2>>| Param::from_tensor(p.val().zeros_like());
            let layer = DecoderLayer {
                wo: zeroed(&last.wo),
                w_down: zeroed(&last.w_down),
                ..trainable_copy(last)
            };
            self.deeper.push(layer);
        }
        Ok(self)
    }

    /// A lookahead head's layer input for `hidden: [t, k·hidden]` (the states after each
    /// mix layer and layer N, side by side in that order) and `next: [t, hidden]` (embeddings of
    /// the token after each): each RMS-normalised (their scales differ by orders of magnitude
    /// across layers), concatenated and fused.
    pub fn fused_input(&self, hidden: Tensor<2>, next: Tensor<2>, eps: f64) -> Result<Tensor<2>> {
        let fuse = self.fuse.as_ref().ok_or_else(|| {
            ModelError::InvalidArgument(format!(
                "a `{}` head has no input fusion; only lookahead heads read next tokens",
                self.kind.name()
            ))
        })?;
        let d = next.dims()[1];
        let k = self.mix_layers.len() + 1;
        if hidden.dims()[1] != k * d {
            return Err(ModelError::InvalidArgument(format!(
                "a lookahead head reading {k} layers given states of width {} (expected {})",
                hidden.dims()[1],
                k * d
            )));
        }
        let state = |i: usize| rms_normalize(hidden.clone().narrow(1, i * d, d), eps);
        let mut inputs = vec![state(k - 1), rms_normalize(next, eps)];
        inputs.extend((0..k - 1).map(state));
        Ok(self.layer.project(Tensor::cat(inputs, 1), fuse))
    }

    /// The head's own output state `[t, hidden]` laid out as its input states `[t, k·hidden]`
    /// ([`LayerHeadWeights::fused_input`]), for drafting one level deeper: it stands in for
    /// layer N's state; the mix layers' states, which the head cannot approximate, are zero
    /// (their normalised rows are zero, so they add nothing through the fusion).
    pub fn own_state_input(&self, state: Tensor<2>) -> Tensor<2> {
        if self.mix_layers.is_empty() {
            return state;
        }
        let [t, d] = state.dims();
        let zeros = Tensor::<2>::zeros([t, self.mix_layers.len() * d], &state.device());
        Tensor::cat(vec![zeros, state], 1)
    }

    /// The head's hidden state for `hidden: [t, hidden]` (block, then the output norm), with
    /// the model's `rope` tables (on the weights' device) and `config`. For a lookahead head
    /// `hidden` is its fused input ([`LayerHeadWeights::fused_input`]).
    pub fn forward(
        &self,
        hidden: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        cache: Option<&mut KvCache>,
        config: &LlamaConfig,
    ) -> Result<Tensor<2>> {
        let h = self.block(hidden, rope, ctx, cache, config)?;
        Ok(rms_norm(h, self.norm.val(), config.rms_norm_eps))
    }

    /// The head's block alone ([`LayerHeadWeights::forward`] without the output norm): the
    /// residual stream a lookahead head feeds back to draft deeper.
    pub fn block(
        &self,
        hidden: Tensor<2>,
        rope: &Rope,
        ctx: &AttentionContext,
        cache: Option<&mut KvCache>,
        config: &LlamaConfig,
    ) -> Result<Tensor<2>> {
        let limit = config.context_length;
        let mut caches = match cache {
            Some(c) if c.num_layers() != self.depth() => {
                return Err(ModelError::InvalidArgument(format!(
                    "a head of {} layers with a cache of {}",
                    self.depth(),
                    c.num_layers()
                )));
            }
            Some(c) => Some(c.layers_mut().iter_mut()),
            None => None,
        };
        // Each layer's own cache, in order (none without a cache).
        let mut next_cache = || caches.as_mut().and_then(Iterator::next);
        let first = next_cache();
        let mut h = match self.kind {
            HeadKind::Layer | HeadKind::Lookahead => {
                self.layer.forward(hidden, rope, ctx, first, limit)?
            }
            HeadKind::Adapter => self
                .layer
                .forward_attention_only(hidden, rope, ctx, first, limit)?,
        };
        for layer in &self.deeper {
            h = layer.forward(h, rope, ctx, next_cache(), limit)?;
        }
        Ok(h)
    }

    /// Quantizes every matrix the head runs to Q8_0 blocks, each layer's into its own
    /// [`DecoderLayer::native`] (the drafting copies of a native model's head).
    fn quantize_q8_0(&mut self) -> Result<()> {
        self.layer.native = quantized_q8_0(self.matrices())?;
        for layer in &mut self.deeper {
            layer.native = quantized_q8_0(whole_layer_matrices(layer))?;
        }
        Ok(())
    }

    /// Drops every quantized copy (dense weights only).
    fn drop_quantized(&mut self) {
        for layer in std::iter::once(&mut self.layer).chain(&mut self.deeper) {
            layer.native = NativeWeights::default();
        }
    }
}

/// Whether `layers` may be the mix layers of a head at exit layer `n`: ascending, each in
/// `1..n`. Checked for every head built from weights and, before any allocation, for a
/// checkpoint's list.
pub(crate) fn mix_layers_fit(layers: &[usize], n: usize) -> bool {
    layers.windows(2).all(|w| w[0] < w[1]) && layers.iter().all(|&l| l > 0 && l < n)
}

/// The four weight matrices of a whole decoder layer.
fn whole_layer_matrices(l: &DecoderLayer) -> Vec<&Param<Tensor<2>>> {
    vec![&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down]
}

/// `matrices`, quantized to Q8_0 blocks.
fn quantized_q8_0(matrices: Vec<&Param<Tensor<2>>>) -> Result<NativeWeights> {
    let mut native = NativeWeights::default();
    for w in matrices {
        native.insert(w, Arc::new(q8_0_matrix(w.val())?));
    }
    Ok(native)
}

/// Whether `t` is an f32 tensor of the CPU default (flex), where the quantized kernels run.
fn on_flex(t: &Tensor<2>) -> bool {
    #[cfg(feature = "flex")]
    {
        crate::cpu::flex_f32(t).is_some()
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = t;
        false
    }
}

/// A copy of `layer` with parameters of its own: dense f32 tensors with fresh ids, that
/// autodiff tracks. A plain clone would share the model's parameters, and with native weights
/// those are lazy, frozen stand-ins for quantized blocks: a head built from one trained only
/// its norm gain.
fn trainable_copy(layer: &DecoderLayer) -> DecoderLayer {
    let own = |p: &Param<Tensor<2>>| Param::from_tensor(cast_to(p.val(), DType::F32));
    let own_vector = |p: &Param<Tensor<1>>| Param::from_tensor(cast_to(p.val(), DType::F32));
    DecoderLayer {
        attn_norm: own_vector(&layer.attn_norm),
        wqkv: own(&layer.wqkv),
        wo: own(&layer.wo),
        mlp_norm: own_vector(&layer.mlp_norm),
        w_gate_up: own(&layer.w_gate_up),
        w_down: own(&layer.w_down),
        ..layer.clone()
    }
}

/// EESD's early-exiting layer: a decoder layer of its own (with its own KV cache), an RMSNorm,
/// and the model's LM head (shared and frozen; optionally restricted to a [`VocabSubset`]).
/// With [`HeadKind::Adapter`] the block is attention-only (Kangaroo's adapter).
#[derive(Debug)]
pub struct LayerHead {
    weights: LayerHeadWeights,
    exit_layer: usize,
    projection: Projection,
    /// Whether the draft vocabulary is widened by the sequence's own tokens (the default; see
    /// [`LayerHead::without_context_tokens`]).
    context_tokens: bool,
}

impl LayerHead {
    /// A head of `kind` for exit layer `n`, initialised from a copy of model layer `init_from`
    /// and the model's final norm. The copy is the head's own: dense f32 parameters that
    /// training updates, whatever format the model holds its layer in. A lookahead head may
    /// read the last layer (`n` = L); its fusion starts as `[I | I]` (the sum of the two
    /// normalised inputs).
    pub fn from_model(
        model: &Llama,
        kind: HeadKind,
        n: usize,
        init_from: usize,
        subset: Option<&VocabSubset>,
    ) -> Result<Self> {
        // The exit layer is checked by `from_weights`.
        let layers = model.num_layers();
        if init_from >= layers {
            return Err(ModelError::InvalidArgument(format!(
                "init layer {init_from} out of range for a model of {layers} layers"
            )));
        }
        let fuse = (kind == HeadKind::Lookahead).then(|| {
            let d = model.config().hidden_size;
            let eye = Tensor::<2>::eye(d, model.device());
            Param::from_tensor(Tensor::cat(vec![eye.clone(), eye], 1))
        });
        let weights = LayerHeadWeights {
            layer: trainable_copy(&model.layers()[init_from]),
            deeper: Vec::new(),
            norm: Param::from_tensor(model.final_norm().clone()),
            fuse,
            kind,
            mix_layers: Vec::new(),
        };
        Self::from_weights(model, n, weights, subset)
    }

    /// A head from trained weights, in the model's weight format. When the model's layers are
    /// held in quantized blocks (native weights), the head's matrices are also held in Q8_0,
    /// quantized here from the weights as they are (the dense weights stay, for training and
    /// saving); with a quantized LM head it projects with that head's own rows. Drafting then
    /// streams ≈ 9 MB instead of ≈ 33 MB of f32 (SmolLM2, 8,192-token subset), a third of a
    /// native decoding step. Only the drafts can change, never the output: verification runs
    /// the model alone.
    pub fn from_weights(
        model: &Llama,
        n: usize,
        weights: LayerHeadWeights,
        subset: Option<&VocabSubset>,
    ) -> Result<Self> {
        Self::from_weights_with(model, n, weights, Projection::new(model, subset)?)
    }

    /// [`LayerHead::from_weights`] with its projection made.
    fn from_weights_with(
        model: &Llama,
        n: usize,
        mut weights: LayerHeadWeights,
        projection: Projection,
    ) -> Result<Self> {
        let d = model.config().hidden_size;
        let width = (2 + weights.mix_layers.len()) * d;
        match (weights.kind, weights.fuse.as_ref().map(|f| f.val().dims())) {
            (HeadKind::Lookahead, Some(dims)) if dims == [d, width] => {}
            (HeadKind::Layer | HeadKind::Adapter, None) if weights.mix_layers.is_empty() => {}
            (kind, dims) => {
                return Err(ModelError::InvalidArgument(format!(
                    "a `{}` head with input fusion {dims:?} and mix layers {:?} (a lookahead \
                     head needs [{d}, {width}], the others neither)",
                    kind.name(),
                    weights.mix_layers
                )));
            }
        }
        if !mix_layers_fit(&weights.mix_layers, n) {
            return Err(ModelError::InvalidArgument(format!(
                "mix layers {:?} for a head at layer {n} (ascending, each in 1..{n})",
                weights.mix_layers
            )));
        }
        if n == 0 || n > weights.kind.last_exit_layer(model.num_layers()) {
            return Err(ModelError::InvalidArgument(format!(
                "exit layer {n} out of range for a `{}` head of a model of {} layers",
                weights.kind.name(),
                model.num_layers()
            )));
        }
        if !weights.kind.allows_depth(weights.depth()) {
            return Err(ModelError::InvalidArgument(format!(
                "a `{}` head of {} layers (at most {MAX_HEAD_LAYERS}; an adapter has one)",
                weights.kind.name(),
                weights.depth()
            )));
        }
        let quantized_model = model.layers().iter().any(|l| l.native.bytes() > 0);
        match quantized_model {
            true => weights.quantize_q8_0()?,
            false => weights.drop_quantized(),
        }
        Ok(LayerHead {
            weights,
            exit_layer: n,
            projection,
            context_tokens: true,
        })
    }

    /// Drafts from Q8_0 copies of the head's matrices and of its projection rows whatever the
    /// model's weight format, as a head of a native model always does: on the CPU a draft's
    /// cost is the bytes it streams (a lookahead head with an 8,192-token projection: ≈ 36 MB
    /// in f32, ≈ 9 MB in Q8_0). Only drafts can change, never the output. Other backends keep
    /// drafting from the dense weights.
    pub fn with_q8_0_drafts(mut self) -> Result<Self> {
        if !on_flex(&self.weights.layer.wqkv.val()) {
            return Ok(self);
        }
        if self.weights.layer.native.bytes() == 0 {
            self.weights.quantize_q8_0()?;
        }
        self.projection.quantize_q8_0()?;
        Ok(self)
    }

    /// The trainable weights.
    pub fn weights(&self) -> &LayerHeadWeights {
        &self.weights
    }

    /// Takes the trainable weights out (for training): the dense ones only, so that no
    /// quantized copy can stand in for weights that training then changes.
    pub fn into_weights(mut self) -> LayerHeadWeights {
        self.weights.drop_quantized();
        self.weights
    }

    /// A copy of this head projecting onto `model`'s whole vocabulary instead of its draft
    /// vocabulary (the same dense weights; the LM head's rows are shared and frozen, so only
    /// the drafts' reach changes): what a draft vocabulary costs in agreement, measured without
    /// retraining.
    pub fn with_full_vocabulary(&self, model: &Llama) -> Result<Self> {
        let mut weights = self.weights.clone();
        weights.drop_quantized();
        Self::from_weights(model, self.exit_layer, weights, None)
    }

    /// This head drafting from its draft vocabulary alone, never from the tokens its sequence
    /// brought ([`ContextTokens`]): what widening the vocabulary gains, measured on the same
    /// weights (a head projecting onto the whole vocabulary lacks no token either way).
    pub fn without_context_tokens(mut self) -> Self {
        self.context_tokens = false;
        self
    }

    /// Whether the head drafts the tokens its sequence brought beside its draft vocabulary.
    pub fn drafts_context_tokens(&self) -> bool {
        self.context_tokens
    }

    /// This head with `extra` more decoder layers ([`LayerHeadWeights::deepen`]: it drafts as
    /// before until trained), for `model`, its exit layer and vocabulary kept.
    pub fn deepened(self, model: &Llama, extra: usize) -> Result<Self> {
        let LayerHead {
            weights,
            exit_layer,
            projection,
            context_tokens,
        } = self;
        let mut deeper =
            LayerHead::from_weights_with(model, exit_layer, weights.deepen(extra)?, projection)?;
        deeper.context_tokens = context_tokens;
        if deeper.projection.native.is_some() {
            deeper = deeper.with_q8_0_drafts()?;
        }
        Ok(deeper)
    }

    /// This lookahead head reading the states of `layers` too (ascending, each below its layer
    /// N; it must read none yet): its fusion gains a zero block of columns per layer, so it
    /// drafts exactly as before until training moves them. For training a mixed head from a
    /// trained one (`train_exit_head --init-head H --mix-layers 10,20`).
    pub fn with_mix_layers(self, model: &Llama, layers: &[usize]) -> Result<Self> {
        if layers.is_empty() {
            return Ok(self);
        }
        if self.weights.kind != HeadKind::Lookahead || !self.weights.mix_layers.is_empty() {
            return Err(ModelError::InvalidArgument(format!(
                "mix layers {layers:?} for a `{}` head reading layers {:?} (only a lookahead \
                 head reading its layer N alone takes them)",
                self.weights.kind.name(),
                LookaheadHead::feature_layers(&self)
            )));
        }
        let LayerHead {
            mut weights,
            exit_layer,
            projection,
            context_tokens,
        } = self;
        weights.drop_quantized();
        if let Some(fuse) = weights.fuse.take() {
            let fuse = fuse.val();
            let [d, _] = fuse.dims();
            let zeros = Tensor::<2>::zeros([d, layers.len() * d], &fuse.device());
            weights.fuse = Some(Param::from_tensor(Tensor::cat(vec![fuse, zeros], 1)));
        }
        weights.mix_layers = layers.to_vec();
        let quantized = projection.native.is_some();
        let mut mixed = LayerHead::from_weights_with(model, exit_layer, weights, projection)?;
        mixed.context_tokens = context_tokens;
        if quantized {
            mixed = mixed.with_q8_0_drafts()?;
        }
        Ok(mixed)
    }

    /// Whole layer or adapter.
    pub fn kind(&self) -> HeadKind {
        self.weights.kind
    }

    /// The vocabulary subset, if any.
    pub fn token_ids(&self) -> Option<&[u32]> {
        self.projection.ids.as_deref().map(Vec::as_slice)
    }

    /// Runs the head's block on `hidden: [t, hidden]` (its output before the norm), with or
    /// without a cache; positions past the model's context are an error.
    fn state(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor<2>> {
        let c = model.config();
        let (past, rows) = (cache.as_ref().map_or(0, |c| c.len_of(0)), hidden.dims()[0]);
        if past + rows > c.context_length {
            return Err(ModelError::ContextOverflow {
                needed: past + rows,
                limit: c.context_length,
            });
        }
        let ctx = AttentionContext::for_config(model.rope(), c, past, rows);
        self.weights.block(hidden, model.rope(), &ctx, cache, c)
    }

    /// The head's output norm on `state` rows ([`LayerHead::state`]).
    fn normed(&self, model: &Llama, state: Tensor<2>) -> Tensor<2> {
        rms_norm(state, self.weights.norm.val(), model.config().rms_norm_eps)
    }

    /// A chain head's refusal to run as a lookahead head and the other way round.
    fn wrong_kind(&self, wanted: &str) -> ModelError {
        ModelError::InvalidArgument(format!(
            "a `{}` head cannot draft {wanted}",
            self.weights.kind.name()
        ))
    }

    /// Refuses a lookahead head where a chain head is needed.
    fn ensure_chain(&self) -> Result<()> {
        match self.weights.kind {
            HeadKind::Lookahead => Err(self.wrong_kind("chains (it drafts trees: `opt@B+HEAD`)")),
            HeadKind::Layer | HeadKind::Adapter => Ok(()),
        }
    }
}

/// The state of a [`LayerHead`] for one sequence: its attention cache and the sequence's
/// tokens that its draft vocabulary lacks (which it drafts too, see [`crate::draft_vocab`]).
#[derive(Debug, Clone)]
pub struct LayerHeadCache {
    kv: KvCache,
    context: ContextTokens,
}

impl LayerHeadCache {
    fn new(depth: usize) -> Self {
        LayerHeadCache {
            kv: KvCache::new(depth),
            context: ContextTokens::default(),
        }
    }

    /// Positions the head's attention holds.
    pub fn len(&self) -> usize {
        self.kv.len_of(0)
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sequence's tokens the head drafts beside its draft vocabulary.
    pub fn context_tokens(&self) -> &ContextTokens {
        &self.context
    }

    fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
        self.context.truncate(len);
    }
}

impl LookaheadHead<Llama> for LayerHead {
    type Cache = LayerHeadCache;

    fn feature_layers(&self) -> Vec<usize> {
        self.weights.feature_layers(self.exit_layer)
    }

    fn new_cache(&self, _: &Llama) -> LayerHeadCache {
        LayerHeadCache::new(self.weights.depth())
    }

    /// The `next` tokens join the draft vocabulary (where it lacks them) at their rows'
    /// positions, so a token the sequence brought can be drafted from the next row on.
    fn lookahead(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        next: &[u32],
        cache: &mut LayerHeadCache,
    ) -> Result<LookaheadDraft> {
        if self.weights.kind != HeadKind::Lookahead {
            return Err(self.wrong_kind("from next tokens (a `lookahead` head does)"));
        }
        if hidden.dims()[0] != next.len() || next.is_empty() {
            return Err(ModelError::InvalidArgument(format!(
                "lookahead over {} states and {} next tokens",
                hidden.dims()[0],
                next.len()
            )));
        }
        let eps = model.config().rms_norm_eps;
        let input = self.weights.fused_input(hidden, model.embed(next)?, eps)?;
        let past = cache.len();
        let h = self.state(model, input, Some(&mut cache.kv))?;
        DraftHead::observe_tokens(self, model, cache, past, next)?;
        let state = h.narrow(0, next.len() - 1, 1);
        Ok(LookaheadDraft {
            draft: self.projection.logits_with(
                model,
                self.normed(model, state.clone()),
                &mut cache.context,
            )?,
            state: self.weights.own_state_input(state),
        })
    }

    fn cached_len(&self, cache: &LayerHeadCache) -> usize {
        cache.len()
    }

    fn truncate(&self, cache: &mut LayerHeadCache, len: usize) {
        cache.truncate(len);
    }
}

impl DraftHead<Llama> for LayerHead {
    type Cache = LayerHeadCache;

    fn exit_layer(&self) -> Option<usize> {
        Some(self.exit_layer)
    }

    fn new_cache(&self, _: &Llama) -> LayerHeadCache {
        LayerHeadCache::new(self.weights.depth())
    }

    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        cache: &mut LayerHeadCache,
    ) -> Result<DraftLogits> {
        self.ensure_chain()?;
        let normed = self.normed(model, self.state(model, hidden, Some(&mut cache.kv))?);
        self.projection
            .logits_with(model, normed, &mut cache.context)
    }

    fn extend(&self, model: &Llama, hidden: Tensor<2>, cache: &mut LayerHeadCache) -> Result<()> {
        self.ensure_chain()?;
        self.state(model, hidden, Some(&mut cache.kv)).map(drop)
    }

    fn observe_tokens(
        &self,
        model: &Llama,
        cache: &mut LayerHeadCache,
        first: usize,
        tokens: &[u32],
    ) -> Result<()> {
        // A token outside the vocabulary is an error either way.
        match self.context_tokens {
            true => cache.context.record(&self.projection, model, first, tokens),
            false => model.check_token_ids(tokens),
        }
    }

    fn cached_len(&self, cache: &LayerHeadCache) -> usize {
        cache.len()
    }

    fn truncate(&self, cache: &mut LayerHeadCache, len: usize) {
        cache.truncate(len);
    }
}

/// Any of this crate's heads, chosen at run time (e.g. from a command-line flag).
#[derive(Debug)]
pub enum AnyHead {
    /// [`NormHead`].
    Norm(NormHead),
    /// [`LayerHead`].
    Layer(Box<LayerHead>),
}

/// The state of an [`AnyHead`].
#[derive(Debug, Clone)]
pub enum AnyHeadCache {
    /// Of a [`NormHead`].
    Norm(usize),
    /// Of a [`LayerHead`].
    Layer(Box<LayerHeadCache>),
}

impl DraftHead<Llama> for AnyHead {
    type Cache = AnyHeadCache;

    fn exit_layer(&self) -> Option<usize> {
        match self {
            AnyHead::Norm(h) => h.exit_layer(),
            AnyHead::Layer(h) => h.exit_layer(),
        }
    }

    fn new_cache(&self, model: &Llama) -> AnyHeadCache {
        match self {
            AnyHead::Norm(h) => AnyHeadCache::Norm(h.new_cache(model)),
            AnyHead::Layer(h) => {
                AnyHeadCache::Layer(Box::new(DraftHead::new_cache(h.as_ref(), model)))
            }
        }
    }

    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        cache: &mut AnyHeadCache,
    ) -> Result<DraftLogits> {
        match (self, cache) {
            (AnyHead::Norm(h), AnyHeadCache::Norm(c)) => h.draft_logits(model, hidden, c),
            (AnyHead::Layer(h), AnyHeadCache::Layer(c)) => h.draft_logits(model, hidden, c),
            _ => Err(ModelError::InvalidArgument(
                "head state of another head kind".into(),
            )),
        }
    }

    fn extend(&self, model: &Llama, hidden: Tensor<2>, cache: &mut AnyHeadCache) -> Result<()> {
        match (self, cache) {
            (AnyHead::Norm(h), AnyHeadCache::Norm(c)) => h.extend(model, hidden, c),
            (AnyHead::Layer(h), AnyHeadCache::Layer(c)) => h.extend(model, hidden, c),
            _ => Err(ModelError::InvalidArgument(
                "head state of another head kind".into(),
            )),
        }
    }

    fn observe_tokens(
        &self,
        model: &Llama,
        cache: &mut AnyHeadCache,
        first: usize,
        tokens: &[u32],
    ) -> Result<()> {
        match (self, cache) {
            (AnyHead::Norm(_), AnyHeadCache::Norm(_)) => Ok(()),
            (AnyHead::Layer(h), AnyHeadCache::Layer(c)) => {
                h.observe_tokens(model, c, first, tokens)
            }
            _ => Err(ModelError::InvalidArgument(
                "head state of another head kind".into(),
            )),
        }
    }

    fn cached_len(&self, cache: &AnyHeadCache) -> usize {
        match cache {
            AnyHeadCache::Norm(c) => *c,
            AnyHeadCache::Layer(c) => c.len(),
        }
    }

    fn truncate(&self, cache: &mut AnyHeadCache, len: usize) {
        match cache {
            AnyHeadCache::Norm(c) => *c = (*c).min(len),
            AnyHeadCache::Layer(c) => c.truncate(len),
        }
    }
}
