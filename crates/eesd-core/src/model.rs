//! What the decoding loop needs from a model: layers that run in ranges, and a draft head.
//!
//! The split mirrors an EESD round: layers `[0, N)` run token by token while drafting, the exit
//! head turns their hidden state into draft logits, and layers `[N, L)` run once over the whole
//! drafted block to verify it, reusing the first-N hidden states and KV cache.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::Tensor;

use crate::tree::TreeMask;

/// A decoder whose layers can be run in ranges, with a per-layer cache that truncates in O(1).
pub trait LayeredModel {
    /// Per-sequence KV cache of all layers; each layer keeps its own length.
    type Cache;
    /// The model's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Number of decoder layers L.
    fn num_layers(&self) -> usize;
    /// Maximum positions (prompt + generated).
    fn context_length(&self) -> usize;
    /// Vocabulary size.
    fn vocab_size(&self) -> usize;
    /// An empty cache.
    fn new_cache(&self) -> Self::Cache;
    /// Positions cached by `layer`.
    fn cached_len(&self, cache: &Self::Cache, layer: usize) -> usize;
    /// Token ids → hidden states `[t, hidden]`.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor<2>, Self::Error>;
    /// Runs `layers` on `hidden: [t, hidden]`, appending `t` positions to those layers' caches.
    fn forward_layers(
        &self,
        hidden: Tensor<2>,
        layers: Range<usize>,
        cache: &mut Self::Cache,
    ) -> Result<Tensor<2>, Self::Error>;
    /// Runs `layers` on a tree block `hidden: [tree.rows(), hidden]` (row 0 the root): row `r`
    /// takes position `cached + depth(r)` and attends to the cached positions and to its
    /// ancestors' rows only, so each row sees what it would see had its path been decoded.
    /// All rows are appended to those layers' caches; [`LayeredModel::keep_rows`] then keeps
    /// the accepted path.
    fn forward_tree(
        &self,
        hidden: Tensor<2>,
        layers: Range<usize>,
        cache: &mut Self::Cache,
        tree: &TreeMask,
    ) -> Result<Tensor<2>, Self::Error>;
    /// In `layers`, keeps of the positions from `first` on only `first + rows[i]` (strictly
    /// ascending), moved to `first + i`, and forgets the rest.
    fn keep_rows(
        &self,
        cache: &mut Self::Cache,
        layers: Range<usize>,
        first: usize,
        rows: &[usize],
    ) -> Result<(), Self::Error>;
    /// Final norm + LM head: `[t, hidden]` → logits `[t, vocab]`.
    fn logits(&self, hidden: Tensor<2>) -> Tensor<2>;
    /// Forgets positions `len..` in `layers`.
    fn truncate(&self, cache: &mut Self::Cache, layers: Range<usize>, len: usize);
}

/// Draft logits of an exit head, possibly over a subset of the vocabulary.
#[derive(Debug, Clone)]
pub struct DraftLogits {
    /// `[t, n]` logits; `n` is the vocabulary size, or the subset size.
    pub logits: Tensor<2>,
    /// Token id of each logit column when the head projects onto a vocabulary subset; tokens
    /// outside it have draft probability zero.
    pub token_ids: Option<Arc<Vec<u32>>>,
    /// How many of the last columns are tokens of the sequence that the head's own draft
    /// vocabulary lacks ([`DraftHead::observe_tokens`]), in the order the sequence first
    /// brought them; 0 for heads that do not add any.
    pub context_columns: usize,
}

/// An exit head: turns the hidden state after layer N into draft logits.
pub trait DraftHead<M: LayeredModel> {
    /// The head's own state (a KV cache when it has attention).
    type Cache;

    /// The layer this head was trained for; `None` if it works after any layer.
    fn exit_layer(&self) -> Option<usize>;
    /// A fresh head state.
    fn new_cache(&self, model: &M) -> Self::Cache;
    /// Draft logits for `hidden: [t, hidden]` (layer-N outputs of consecutive positions),
    /// appending `t` positions to the head's cache.
    fn draft_logits(
        &self,
        model: &M,
        hidden: Tensor<2>,
        cache: &mut Self::Cache,
    ) -> Result<DraftLogits, M::Error>;
    /// Appends `hidden` to the head's cache without computing logits (prompt positions, and the
    /// last token of a fully accepted round). The default computes and drops the logits.
    fn extend(
        &self,
        model: &M,
        hidden: Tensor<2>,
        cache: &mut Self::Cache,
    ) -> Result<(), M::Error> {
        self.draft_logits(model, hidden, cache).map(drop)
    }
    /// Tells the head the sequence's tokens at positions `first..` (the prompt, then each
    /// accepted block), so that a head projecting onto a draft vocabulary can draft the ones it
    /// lacks too, for as long as its cache holds the positions where they first appeared
    /// ([`DraftLogits::context_columns`]). The default ignores them.
    fn observe_tokens(
        &self,
        model: &M,
        cache: &mut Self::Cache,
        first: usize,
        tokens: &[u32],
    ) -> Result<(), M::Error> {
        let _ = (model, cache, first, tokens);
        Ok(())
    }
    /// Positions the head has cached.
    fn cached_len(&self, cache: &Self::Cache) -> usize;
    /// Forgets positions `len..`.
    fn truncate(&self, cache: &mut Self::Cache, len: usize);
}

/// A lookahead head's draft from its last row.
#[derive(Debug, Clone)]
pub struct LookaheadDraft {
    /// Draft logits `[1, n]` for the token after the last `next` token.
    pub draft: DraftLogits,
    /// The head's output state of that row (before its norm), laid out as the head's input
    /// states `[1, k·hidden]` ([`LookaheadHead::feature_layers`]). The head maps (state of
    /// position j, token j + 1) to a state that predicts token j + 2, the role of the layer-N
    /// state of position j + 1; fed back with a drafted token j + 2, it drafts token j + 3
    /// without the model (EAGLE-style recursion, the head's own approximation).
    pub state: Tensor<2>,
}

/// A lookahead head (EAGLE-style input): from the layer-N hidden state of a verified position
/// and the token that follows it, it drafts the token after that.
///
/// Verification computes every row's layer-N state, so when a round's target token becomes
/// the next root, the head already has what it needs to draft the root's children: its cost is
/// the head alone, with no pass through layers `[0, N)` for the root as a chain head needs. N
/// may be the last layer (the state before the final norm). A head may also read the states of
/// earlier layers beside layer N's (EAGLE-3's mix of low, middle and high features): all of
/// them come from the same verification pass.
pub trait LookaheadHead<M: LayeredModel> {
    /// The head's own state (a KV cache when it has attention).
    type Cache;

    /// The layers whose outputs the head reads, ascending, each in `1..=num_layers()`; the
    /// last is its layer N.
    fn feature_layers(&self) -> Vec<usize>;
    /// A fresh head state.
    fn new_cache(&self, model: &M) -> Self::Cache;
    /// Appends consecutive positions to the head's state: `hidden: [t, k·hidden]` their states
    /// after each of the `k` [`LookaheadHead::feature_layers`], side by side in that order, and
    /// `next[i]` the token that follows position `i`. Returns the draft of the
    /// token after `next[t - 1]`, and the head's state of that row, which stands in for the
    /// layer-N state of `next[t - 1]`'s position when the head drafts one level deeper.
    fn lookahead(
        &self,
        model: &M,
        hidden: Tensor<2>,
        next: &[u32],
        cache: &mut Self::Cache,
    ) -> Result<LookaheadDraft, M::Error>;
    /// Positions the head has cached.
    fn cached_len(&self, cache: &Self::Cache) -> usize;
    /// Forgets positions `len..`.
    fn truncate(&self, cache: &mut Self::Cache, len: usize);
}
