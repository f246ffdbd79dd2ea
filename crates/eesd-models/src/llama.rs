//! The LLaMA model with an early-exit seam: embed, run any range of layers, project to logits.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use eesd_core::TreeMask;

use crate::cache::{KvCache, LayerCache};
use crate::config::LlamaConfig;
use crate::cpu::attention::KvDtype;
use crate::cpu::matmul::ShapeError;
use crate::cpu::{PackedCache, QuantMatrix};
use crate::error::{ModelError, Result};
use crate::layer::{AttentionContext, DecoderLayer, cast_to, linear, rms_norm};
use crate::native::{NativeWeights, lazy_param, quant_linear};
use crate::quant::GgmlType;
use crate::rope::Rope;
use crate::weights::{Checkpoint, WeightName};

/// Numeric precision of the weights on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum WeightDType {
    /// The file's own types: quantized matrices of a GGUF file stay in their block format
    /// (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) and run through the quantized CPU kernel, with activations
    /// quantized per row to 8 bits as llama.cpp does; float tensors keep their precision. On
    /// backends other than flex the matrices are dequantized to f32 when first used.
    #[default]
    Native,
    /// 32-bit floats (exact reference numerics).
    F32,
    /// IEEE half precision (half the memory traffic).
    F16,
    /// bfloat16 (half the memory traffic, f32 range).
    Bf16,
}

/// What one forward pass must move and compute: the basis of its roofline time
/// ([`crate::cpu::roofline::Roofline::seconds`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ForwardCost {
    /// Bytes of weight matrices streamed (every matrix once, in its stored dtype).
    pub weight_bytes: f64,
    /// Bytes of cached keys and values read by attention (each once).
    pub cache_bytes: f64,
    /// Floating-point operations: `2 · params · rows` for the float matrices, plus attention's
    /// `4 · layers · heads · head_dim` per row and attended position.
    pub flops: f64,
    /// 8-bit integer operations of the natively quantized matrices: `2 · params · rows`.
    pub int8_ops: f64,
}

impl ForwardCost {
    /// All bytes that must come from memory.
    pub fn bytes(&self) -> f64 {
        self.weight_bytes + self.cache_bytes
    }
}

/// A LLaMA decoder whose layers can be run in ranges, for early exit and speculative decoding.
#[derive(Debug)]
pub struct Llama {
    config: LlamaConfig,
    device: Device,
    /// Token embedding `[vocab, hidden]` (lazy with native weights).
    embedding: Param<Tensor<2>>,
    layers: Vec<DecoderLayer>,
    final_norm: Tensor<1>,
    /// LM head `[vocab, hidden]` (the embedding itself when tied).
    lm_head: Param<Tensor<2>>,
    /// The LM head's packed copy for the flex CPU kernel.
    lm_head_packed: PackedCache,
    /// The embedding and LM head in their file's block format (native weights).
    native_embedding: Option<Arc<QuantMatrix>>,
    native_lm_head: Option<Arc<QuantMatrix>>,
    rope: Rope,
}

/// Some rows of a model's LM head ([`Llama::lm_head_rows`]): logits for a subset of the
/// vocabulary, e.g. the distillation targets of a head with a draft vocabulary.
#[derive(Debug, Clone)]
pub struct LmHeadRows {
    rows: HeadRows,
    packed: PackedCache,
}

/// The rows themselves: in the file's block format (native weights, with a dense copy made
/// only if a backend without the quantized kernel asks) or dense.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // one per model; a burn tensor's size depends on the backends built
enum HeadRows {
    Native(Arc<QuantMatrix>, Param<Tensor<2>>),
    Dense(Tensor<2>),
}

impl LmHeadRows {
    /// Number of rows (tokens).
    pub fn len(&self) -> usize {
        match &self.rows {
            HeadRows::Native(q, _) => q.out(),
            HeadRows::Dense(w) => w.dims()[0],
        }
    }

    /// Whether it has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rows in the file's block format (native weights) and as a dense parameter (lazily
    /// dequantized from those blocks, or the dense rows themselves): a head's projection.
    pub(crate) fn into_parts(self) -> (Option<Arc<QuantMatrix>>, Param<Tensor<2>>) {
        match self.rows {
            HeadRows::Native(q, dense) => (Some(q), dense),
            HeadRows::Dense(w) => (None, Param::from_tensor(w)),
        }
    }
}

/// Position-table values any model may have (16 MiB of f32), whatever its embedding's size.
const MIN_TABLE_VALUES: u128 = 1 << 22;

impl Llama {
    /// Builds the model from a checkpoint, checking every tensor's shape against `config`.
    pub fn from_checkpoint(
        config: LlamaConfig,
        checkpoint: &Checkpoint,
        device: &Device,
        dtype: WeightDType,
    ) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let (h, d) = (c.hidden_size, c.head_dim());
        let native = dtype == WeightDType::Native;
        let vector = |name: WeightName| -> Result<Tensor<1>> {
            let t = checkpoint.read(name, 0)?.expect_shape(name, &[h])?;
            Ok(Tensor::from_data(TensorData::new(t.values, [h]), device))
        };
        // A matrix `[Σ out, inn]` from file tensors `[out, inn]` fused along `out`: in its block
        // format when native and every part is quantized, else dense.
        let matrix = |parts: &[(WeightName, usize, usize)], inn: usize| -> Result<Matrix> {
            if native {
                let mut quantized = Vec::with_capacity(parts.len());
                for &(name, out, heads) in parts {
                    match checkpoint.read_quantized(name, heads)? {
                        Some(t) if t.shape == [out, inn] => quantized.push(t),
                        Some(t) => {
                            return Err(ModelError::ShapeMismatch {
                                name: name.hf(),
                                expected: vec![out, inn],
                                found: t.shape.to_vec(),
                            });
                        }
                        None => break,
                    }
                }
                let mut quantized = quantized.into_iter();
                if quantized.len() == parts.len()
                    && let Some(first) = quantized.next()
                {
                    let bad = |e: ShapeError| ModelError::Malformed(e.to_string());
                    let mut m = QuantMatrix::new(first.format, first.bytes, first.shape[0], inn)
                        .map_err(bad)?;
                    for t in quantized {
                        m.push(t.format, t.bytes, t.shape[0]).map_err(bad)?;
                    }
                    let m = Arc::new(m);
                    return Ok(Matrix {
                        param: lazy_param(m.clone(), device),
                        native: Some(m),
                    });
                }
            }
            let dense = match dtype {
                WeightDType::Native => {
                    let types = parts
                        .iter()
                        .map(|&(name, _, _)| checkpoint.stored_type(name))
                        .collect::<Result<Vec<_>>>()?;
                    dense_dtype(&types)
                }
                other => other,
            };
            let mut rows = Vec::new();
            let mut n_out = 0;
            for &(name, out, heads) in parts {
                let t = checkpoint
                    .read(name, heads)?
                    .expect_shape(name, &[out, inn])?;
                rows.extend(t.values);
                n_out += out;
            }
            let t = Tensor::from_data(TensorData::new(rows, [n_out, inn]), device);
            Ok(Matrix {
                param: Param::from_tensor(cast(t, dense)),
                native: None,
            })
        };

        let embedding_shape = checkpoint.read_shape(WeightName::Embedding)?;
        if embedding_shape.len() != 2 || embedding_shape[1] != h {
            return Err(ModelError::ShapeMismatch {
                name: WeightName::Embedding.hf(),
                expected: vec![c.vocab_size, h],
                found: embedding_shape,
            });
        }
        if embedding_shape[0] != c.vocab_size {
            return Err(ModelError::VocabMismatch {
                tokenizer: c.vocab_size,
                embedding: embedding_shape[0],
            });
        }
        let embedding = matrix(&[(WeightName::Embedding, c.vocab_size, 0)], h)?;
        let lm_head = match c.tie_word_embeddings {
            true => Matrix {
                param: embedding.param.clone(),
                native: embedding.native.clone(),
            },
            false => matrix(&[(WeightName::LmHead, c.vocab_size, 0)], h)?,
        };

        // The position tables (`2 × context × head_dim` floats) are the one allocation the
        // weights do not bound; tables larger than both the embedding and 16 MiB are refused
        // rather than allocated (the caller can shorten the context with
        // `LoadOptions::context_length`).
        let table_values = 2 * d as u128 * c.context_length as u128;
        let allowed = (c.vocab_size as u128 * h as u128).max(MIN_TABLE_VALUES);
        if table_values > allowed {
            return Err(ModelError::InvalidConfig(format!(
                "context length {} needs {table_values} position-table values, more than the \
                 {allowed} the model's size allows; load it with a shorter context",
                c.context_length
            )));
        }
        // Layers are pushed as they load: the count comes from the file's metadata.
        let mut layers = Vec::new();
        for i in 0..c.num_layers {
            let wqkv = matrix(
                &[
                    (WeightName::Q(i), c.num_heads * d, c.num_heads),
                    (WeightName::K(i), c.num_kv_heads * d, c.num_kv_heads),
                    (WeightName::V(i), c.num_kv_heads * d, 0),
                ],
                h,
            )?;
            let wo = matrix(&[(WeightName::O(i), h, 0)], c.num_heads * d)?;
            let w_gate_up = matrix(
                &[
                    (WeightName::Gate(i), c.intermediate_size, 0),
                    (WeightName::Up(i), c.intermediate_size, 0),
                ],
                h,
            )?;
            let w_down = matrix(&[(WeightName::Down(i), h, 0)], c.intermediate_size)?;
            let mut native = NativeWeights::default();
            for m in [&wqkv, &wo, &w_gate_up, &w_down] {
                if let Some(q) = &m.native {
                    native.insert(&m.param, q.clone());
                }
            }
            layers.push(DecoderLayer {
                attn_norm: Param::from_tensor(vector(WeightName::AttnNorm(i))?),
                wqkv: wqkv.param,
                wo: wo.param,
                mlp_norm: Param::from_tensor(vector(WeightName::MlpNorm(i))?),
                w_gate_up: w_gate_up.param,
                w_down: w_down.param,
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: d,
                ffn: c.intermediate_size,
                eps: c.rms_norm_eps,
                packed: PackedCache::default(),
                native,
            });
        }
        let final_norm = vector(WeightName::FinalNorm)?;
        let rope = Rope::new(c, device);
        let model = Llama {
            config,
            device: device.clone(),
            embedding: embedding.param,
            layers,
            final_norm,
            lm_head: lm_head.param,
            lm_head_packed: PackedCache::default(),
            native_embedding: embedding.native,
            native_lm_head: lm_head.native,
            rope,
        };
        model.prepare();
        Ok(model)
    }

    /// Packs every weight matrix for the flex CPU kernel (done once at load; a no-op on other
    /// backends), so that the first forward pass is not slowed by it.
    fn prepare(&self) {
        self.layers.iter().for_each(DecoderLayer::prepare);
        #[cfg(feature = "flex")]
        if self.native_lm_head.is_none() {
            self.lm_head_packed.get(&self.lm_head.val());
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The decoder layers (e.g. to initialise an exit head from a copy of one).
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// The RoPE tables.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The final RMSNorm gain.
    pub fn final_norm(&self) -> &Tensor<1> {
        &self.final_norm
    }

    /// The LM head `[vocab, hidden]` as a dense tensor. With native weights it is made (in
    /// f32) on the first call and kept; [`Llama::native_lm_head`] avoids that.
    pub fn lm_head(&self) -> &Tensor<2> {
        &self.lm_head
    }

    /// The LM head in its file's block format, when the model holds native weights.
    pub fn native_lm_head(&self) -> Option<&Arc<QuantMatrix>> {
        self.native_lm_head.as_ref()
    }

    /// Bytes of weights the model holds now: quantized blocks, dense tensors, and dense copies
    /// of native weights made on demand (the flex kernels' packed copies not included).
    pub fn weight_bytes(&self) -> usize {
        let matrix = |p: &Param<Tensor<2>>, native: Option<&Arc<QuantMatrix>>| {
            let dense = match (native, p.is_initialized()) {
                (Some(_), false) => 0,
                _ => {
                    let t = p.val();
                    t.shape().num_elements() * t.dtype().size()
                }
            };
            dense + native.map_or(0, |q| q.bytes())
        };
        let mut bytes = matrix(&self.embedding, self.native_embedding.as_ref());
        if !self.config.tie_word_embeddings {
            bytes += matrix(&self.lm_head, self.native_lm_head.as_ref());
        }
        for layer in &self.layers {
            for w in [&layer.wqkv, &layer.wo, &layer.w_gate_up, &layer.w_down] {
                bytes += matrix(w, layer.native.get(w));
            }
            bytes += 2 * self.config.hidden_size * 4;
        }
        bytes + self.config.hidden_size * 4
    }

    /// The cost of a full forward pass (all layers and the LM head) over `rows` new tokens
    /// after `past` cached positions.
    pub fn forward_cost(&self, rows: usize, past: usize) -> ForwardCost {
        let c = &self.config;
        // (float params, quantized params, bytes) of one matrix.
        let matrix = |w: &Param<Tensor<2>>, native: Option<&Arc<QuantMatrix>>| match native {
            Some(q) => (0.0, (q.out() * q.k()) as f64, q.bytes() as f64),
            None => {
                let [o, k] = w.dims();
                ((o * k) as f64, 0.0, (o * k * w.dtype().size()) as f64)
            }
        };
        let (mut params, mut quantized, mut bytes) = (0f64, 0f64, 0f64);
        let mut add = |(p, q, b): (f64, f64, f64)| {
            params += p;
            quantized += q;
            bytes += b;
        };
        for layer in &self.layers {
            for w in [&layer.wqkv, &layer.wo, &layer.w_gate_up, &layer.w_down] {
                add(matrix(w, layer.native.get(w)));
            }
        }
        add(matrix(&self.lm_head, self.native_lm_head.as_ref()));
        let layers = self.layers.len() as f64;
        let d = c.head_dim() as f64;
        // Row r attends to past + r + 1 positions.
        let attended: f64 = (0..rows).map(|r| (past + r + 1) as f64).sum();
        let attention = 4.0 * layers * c.num_heads as f64 * d * attended;
        // Cached keys and values as the CPU layer stores them.
        let element = self.kv_dtype().bytes() as f64;
        ForwardCost {
            weight_bytes: bytes,
            cache_bytes: 2.0 * layers * (past + rows) as f64 * c.num_kv_heads as f64 * d * element,
            flops: 2.0 * params * rows as f64 + attention,
            int8_ops: 2.0 * quantized * rows as f64,
        }
    }

    /// How the CPU layer stores this model's cached keys and values
    /// ([`DecoderLayer::kv_dtype`]).
    pub fn kv_dtype(&self) -> KvDtype {
        self.layers
            .first()
            .map_or(KvDtype::F32, DecoderLayer::kv_dtype)
    }

    /// An empty KV cache sized for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// Refuses any id outside the vocabulary.
    pub(crate) fn check_token_ids(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&id| id as usize >= vocab) {
            Some(&id) => Err(ModelError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// Embeds token ids into hidden states `[t, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor<2>> {
        if tokens.is_empty() {
            return Err(ModelError::InvalidArgument("empty token block".into()));
        }
        self.check_token_ids(tokens)?;
        if let Some(q) = &self.native_embedding {
            let h = self.config.hidden_size;
            let mut rows = vec![0f32; tokens.len() * h];
            for (row, &id) in rows.chunks_exact_mut(h).zip(tokens) {
                q.dequantize_row(id as usize, row)
                    .map_err(|e| ModelError::InvalidArgument(e.to_string()))?;
            }
            return Ok(Tensor::from_data(
                TensorData::new(rows, [tokens.len(), h]),
                &self.device,
            ));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &self.device);
        Ok(cast(self.embedding.val().select(0, ids), WeightDType::F32))
    }

    /// Runs layers `range` on `hidden: [t, hidden]`, appending to those layers' caches.
    ///
    /// All layers in the range must hold the same number of cached positions; the new tokens take
    /// the positions after them. This is the early-exit seam: `[0, N)` then `[N, L)` equals `[0, L)`.
    pub fn forward_layers(
        &self,
        hidden: Tensor<2>,
        range: Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor<2>> {
        let [t, _] = hidden.dims();
        let past = self.check_block(&range, cache, t)?;
        let ctx = AttentionContext::for_config(&self.rope, &self.config, past, t);
        self.run_layers(hidden, range, cache, &ctx)
    }

    /// Runs layers `range` on a tree block `hidden: [tree.rows(), hidden]` (row 0 the root):
    /// row `r` takes position `cached + depth(r)` and attends to the cached positions and its
    /// ancestors only. Every row is appended to the caches (slot `cached + r`); keep the
    /// accepted path with [`KvCache::keep_layers`]. Each row's output equals, bit for bit on
    /// flex, what a causal block holding only its path would give.
    pub fn forward_tree(
        &self,
        hidden: Tensor<2>,
        range: Range<usize>,
        cache: &mut KvCache,
        tree: &TreeMask,
    ) -> Result<Tensor<2>> {
        let [t, _] = hidden.dims();
        if tree.rows() != t {
            return Err(ModelError::InvalidArgument(format!(
                "a tree of {} rows for a block of {t}",
                tree.rows()
            )));
        }
        if tree.is_chain() {
            return self.forward_layers(hidden, range, cache);
        }
        let past = self.check_block(&range, cache, t)?;
        let ctx = AttentionContext::tree(&self.rope, &self.config, past, Arc::new(tree.clone()));
        self.run_layers(hidden, range, cache, &ctx)
    }

    /// Checks a block of `t` rows for layers `range` and returns the cached length they share.
    fn check_block(&self, range: &Range<usize>, cache: &KvCache, t: usize) -> Result<usize> {
        if range.start >= range.end
            || range.end > self.layers.len()
            || cache.num_layers() != self.layers.len()
        {
            return Err(ModelError::InvalidArgument(format!(
                "layer range {range:?} for a model of {} layers (cache of {})",
                self.layers.len(),
                cache.num_layers()
            )));
        }
        let past = cache.len_of(range.start);
        if let Some(i) = range.clone().find(|&i| cache.len_of(i) != past) {
            return Err(ModelError::InvalidArgument(format!(
                "layer {i} caches {} positions but layer {} caches {past}",
                cache.len_of(i),
                range.start
            )));
        }
        let limit = self.config.context_length;
        if past + t > limit {
            return Err(ModelError::ContextOverflow {
                needed: past + t,
                limit,
            });
        }
        Ok(past)
    }

    fn run_layers(
        &self,
        hidden: Tensor<2>,
        range: Range<usize>,
        cache: &mut KvCache,
        ctx: &AttentionContext,
    ) -> Result<Tensor<2>> {
        let limit = self.config.context_length;
        let mut x = hidden;
        for i in range {
            let layer_cache = cache.layer_mut(i);
            x = self.layers[i].forward(x, &self.rope, ctx, layer_cache, limit)?;
        }
        Ok(x)
    }

    /// Runs layers `range` on a packed block of whole sequences (`ctx` from
    /// [`AttentionContext::packed`]), without a KV cache: each sequence attends only to itself,
    /// from position 0. Self-distillation runs its teacher this way, many sequences per pass.
    pub fn forward_packed(
        &self,
        hidden: Tensor<2>,
        range: Range<usize>,
        ctx: &AttentionContext,
    ) -> Result<Tensor<2>> {
        if range.start >= range.end || range.end > self.layers.len() {
            return Err(ModelError::InvalidArgument(format!(
                "layer range {range:?} for a model of {} layers",
                self.layers.len()
            )));
        }
        let [t, _] = hidden.dims();
        if ctx.rows() != t {
            return Err(ModelError::InvalidArgument(format!(
                "a context for {} rows given a block of {t}",
                ctx.rows()
            )));
        }
        let limit = self.config.context_length;
        let mut x = hidden;
        for layer in &self.layers[range] {
            x = layer.forward(x, &self.rope, ctx, None, limit)?;
        }
        Ok(x)
    }

    /// Decodes one new token for each of several independent sequences at once and returns
    /// their logits `[b, vocab]`; `caches[s]` holds sequence `s` (any lengths) and grows by one.
    ///
    /// The weights are streamed once for all `b` rows, so a batch of `b` sequences costs far
    /// less than `b` separate steps — this is how training data is generated quickly. Each row
    /// is computed exactly as [`Llama::forward`] would compute it alone.
    pub fn decode_batch(&self, tokens: &[u32], caches: &mut [KvCache]) -> Result<Tensor<2>> {
        if tokens.len() != caches.len() {
            return Err(ModelError::InvalidArgument(format!(
                "{} tokens for {} caches",
                tokens.len(),
                caches.len()
            )));
        }
        let layers = self.layers.len();
        let limit = self.config.context_length;
        let mut positions = Vec::with_capacity(caches.len());
        for cache in caches.iter() {
            let past = cache.len_of(0);
            if cache.num_layers() != layers || (0..layers).any(|i| cache.len_of(i) != past) {
                return Err(ModelError::InvalidArgument(
                    "decode_batch needs full-model caches with every layer at the same length"
                        .into(),
                ));
            }
            if past + 1 > limit {
                return Err(ModelError::ContextOverflow {
                    needed: past + 1,
                    limit,
                });
            }
            positions.push(past);
        }
        let mut x = self.embed(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut LayerCache> =
                caches.iter_mut().filter_map(|c| c.layer_mut(i)).collect();
            x = layer.forward_batch(x, &self.rope, &positions, &mut layer_caches, limit)?;
        }
        Ok(self.logits(x))
    }

    /// The LM head restricted to the tokens `ids` (in that order), for
    /// [`Llama::logits_of`]: with native weights the head's own quantized rows, else its dense
    /// rows. An id outside the vocabulary is an error.
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<LmHeadRows> {
        let vocab = self.config.vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::InvalidArgument(format!(
                "token {id} is outside the vocabulary of {vocab}"
            )));
        }
        if let Some(q) = &self.native_lm_head {
            let rows = q
                .select_rows(ids)
                .map_err(|e| ModelError::InvalidArgument(e.to_string()))?;
            let rows = Arc::new(rows);
            return Ok(LmHeadRows {
                rows: HeadRows::Native(rows.clone(), lazy_param(rows, &self.device)),
                packed: PackedCache::default(),
            });
        }
        let index: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let index = Tensor::<1, Int>::from_data(TensorData::new(index, [ids.len()]), &self.device);
        Ok(LmHeadRows {
            rows: HeadRows::Dense(self.lm_head.val().select(0, index)),
            packed: PackedCache::default(),
        })
    }

    /// Final RMSNorm + the LM head's `rows`: `[t, hidden]` → logits `[t, rows]`, the model's
    /// logits for those tokens alone (a fraction of [`Llama::logits`]' work for a small set).
    /// On the flex CPU kernels each is the same bits as its column of [`Llama::logits`] (every
    /// output is its own fixed chain of products); other backends may round differently.
    pub fn logits_of(&self, hidden: Tensor<2>, rows: &LmHeadRows) -> Tensor<2> {
        let x = rms_norm(hidden, self.final_norm.clone(), self.config.rms_norm_eps);
        match &rows.rows {
            HeadRows::Dense(w) => linear(x, w, &rows.packed),
            HeadRows::Native(q, dense) => match quant_linear(&x, q) {
                Some(y) => y,
                // Where the quantized kernel does not apply (another backend): dequantized on
                // first use and kept.
                None => linear(x, &dense.val(), &rows.packed),
            },
        }
    }

    /// Final RMSNorm + LM head: `[t, hidden]` → logits `[t, vocab]`.
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        let x = rms_norm(hidden, self.final_norm.clone(), self.config.rms_norm_eps);
        if let Some(y) = self
            .native_lm_head
            .as_ref()
            .and_then(|q| quant_linear(&x, q))
        {
            return y;
        }
        linear(x, &self.lm_head.val(), &self.lm_head_packed)
    }

    /// Runs the whole model on new tokens and returns logits for each, `[t, vocab]`.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<2>> {
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, 0..self.layers.len(), cache)?;
        Ok(self.logits(h))
    }

    /// Like [`Llama::forward`] but only the last position's logits, `[vocab]` (cheaper LM head).
    pub fn forward_last(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor<1>> {
        let h = self.embed(tokens)?;
        let h = self.forward_layers(h, 0..self.layers.len(), cache)?;
        let t = tokens.len();
        Ok(self
            .logits(h.narrow(0, t - 1, 1))
            .reshape([self.config.vocab_size]))
    }
}

impl WeightDType {
    /// Every dtype, in the order they are listed to users.
    pub const ALL: [WeightDType; 4] = [
        WeightDType::Native,
        WeightDType::F32,
        WeightDType::F16,
        WeightDType::Bf16,
    ];

    /// The name used on command lines and in reports.
    pub fn name(self) -> &'static str {
        match self {
            WeightDType::Native => "native",
            WeightDType::F32 => "f32",
            WeightDType::F16 => "f16",
            WeightDType::Bf16 => "bf16",
        }
    }

    /// The burn dtype of dense weights (f32 for [`WeightDType::Native`], whose dense form is
    /// f32).
    pub fn dtype(self) -> DType {
        match self {
            WeightDType::Native | WeightDType::F32 => DType::F32,
            WeightDType::F16 => DType::F16,
            WeightDType::Bf16 => DType::BF16,
        }
    }
}

impl std::str::FromStr for WeightDType {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        WeightDType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                ModelError::InvalidArgument(format!(
                    "unknown dtype `{s}` (expected native, f32, f16 or bf16)"
                ))
            })
    }
}

impl std::fmt::Display for WeightDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A weight matrix being built: its parameter and, with native weights, its block form.
struct Matrix {
    param: Param<Tensor<2>>,
    native: Option<Arc<QuantMatrix>>,
}

/// The dense dtype that keeps float tensors of these stored types exactly (f16 or bf16 when
/// all are; f32 otherwise, quantized types included).
fn dense_dtype(types: &[GgmlType]) -> WeightDType {
    if types.iter().all(|t| *t == GgmlType::F16) {
        WeightDType::F16
    } else if types.iter().all(|t| *t == GgmlType::Bf16) {
        WeightDType::Bf16
    } else {
        WeightDType::F32
    }
}

fn cast<const D: usize>(t: Tensor<D>, dtype: WeightDType) -> Tensor<D> {
    cast_to(t, dtype.dtype())
}
