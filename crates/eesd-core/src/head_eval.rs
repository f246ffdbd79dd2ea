//! Teacher-forced evaluation of exit heads: how often their drafts would be accepted.
//!
//! On a sequence, the full model's argmax at each position is the token greedy verification
//! accepts there. Running layers `[0, N)` and the head on the true prefix (teacher forcing) gives
//! the *rank* of that token among the head's draft logits at every position. A correct draft
//! leaves the drafter exactly on the true prefix (blocks equal their rows bit for bit), so the
//! ranks decide how far a greedy chain, or a tree holding the head's top-`w` tokens at every
//! node, drafted from any position would be accepted: no generation needs to run per head.
//! One teacher pass serves several heads at different exit layers. Lookahead heads, which
//! draft from the last layer's state of the position before, are scored level by level
//! ([`lookahead_ranks`]).

use std::ops::Range;

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::generator::host;
use crate::model::{DraftHead, LayeredModel, LookaheadHead};

/// Per position, the rank of the full model's argmax among a head's draft logits (0 = the
/// head's own argmax); `None` when the token is outside the head's draft vocabulary.
pub type Ranks = Vec<Option<u32>>;

/// Ranks of the full model's greedy tokens under each of `heads` (head, exit layer), for the
/// positions `score` of `tokens` (the position `i` predicts the token after `tokens[i]`; e.g. the
/// last prompt position onwards for an answer). Runs the model once over `tokens` with a fresh
/// cache, stopping at every exit layer on the way, so heads at several layers share one pass.
pub fn teacher_forced_ranks<M: LayeredModel, H: DraftHead<M>>(
    model: &M,
    heads: &[(&H, usize)],
    tokens: &[u32],
    score: Range<usize>,
) -> Result<Vec<Ranks>> {
    let layers = model.num_layers();
    if score.start > score.end || score.end > tokens.len() {
        return Err(CoreError::InvalidConfig(format!(
            "scored positions {score:?} of a sequence of {} tokens",
            tokens.len()
        )));
    }
    if let Some((_, n)) = heads.iter().find(|(_, n)| *n == 0 || *n >= layers) {
        return Err(CoreError::InvalidConfig(format!(
            "exit layer {n} of a model of {layers} layers (must be in 1..{layers})"
        )));
    }
    fits_context(model, tokens)?;
    if score.is_empty() {
        return Ok(vec![Vec::new(); heads.len()]);
    }
    let mut order: Vec<usize> = (0..heads.len()).collect();
    order.sort_by_key(|&h| heads[h].1);
    let mut cache = model.new_cache();
    let mut hidden = model.embed(tokens).map_err(CoreError::model)?;
    let mut done = 0;
    let mut draft = vec![None; heads.len()];
    for &h in &order {
        let (head, exit) = heads[h];
        if exit > done {
            hidden = model
                .forward_layers(hidden, done..exit, &mut cache)
                .map_err(CoreError::model)?;
            done = exit;
        }
        // The head sees the whole sequence at once; a token the sequence brings is counted
        // only from the first row at or after its position ([`first_seen`]), as in decoding.
        let mut head_cache = head.new_cache(model);
        head.observe_tokens(model, &mut head_cache, 0, tokens)
            .map_err(CoreError::model)?;
        let out = head
            .draft_logits(model, hidden.clone(), &mut head_cache)
            .map_err(CoreError::model)?;
        let (logits, n) = rows_of(out.logits, &score)?;
        let ids = out.token_ids;
        let from = first_seen(
            ids.as_deref().map(Vec::as_slice),
            out.context_columns,
            tokens,
        );
        draft[h] = Some((logits, n, ids, from));
    }
    let top = model
        .forward_layers(hidden, done..layers, &mut cache)
        .map_err(CoreError::model)?;
    let (full, vocab) = rows_of(model.logits(top), &score)?;
    let greedy: Vec<usize> = full.chunks(vocab).map(crate::argmax).collect();
    Ok(draft
        .into_iter()
        .flatten()
        .map(|(logits, n, ids, from)| {
            let column = columns(ids.as_deref().map(Vec::as_slice), vocab, n);
            logits
                .chunks(n)
                .zip(&greedy)
                .zip(score.clone())
                .map(|((row, &g), p)| {
                    // Columns from positions after `p` are not in the draft vocabulary yet.
                    let width = from.partition_point(|&f| f <= p);
                    let row = &row[..(n.saturating_sub(from.len()) + width).min(n)];
                    column[g]
                        .filter(|&c| c < row.len())
                        .map(|c| rank_of(row, c))
                })
                .collect()
        })
        .collect())
}

/// A sequence longer than the model's context is refused before any pass.
fn fits_context<M: LayeredModel>(model: &M, tokens: &[u32]) -> Result<()> {
    if tokens.len() > model.context_length() {
        return Err(CoreError::PromptTooLong {
            prompt: tokens.len(),
            context: model.context_length(),
        });
    }
    Ok(())
}

/// For each of the last `context` columns of a head's logits (the sequence's tokens its draft
/// vocabulary lacks, in the order the sequence brings them), the position where `tokens` first
/// holds it: the row from which a decoding head can draft it.
fn first_seen(ids: Option<&[u32]>, context: usize, tokens: &[u32]) -> Vec<usize> {
    let Some(ids) = ids else {
        return Vec::new();
    };
    ids[ids.len().saturating_sub(context)..]
        .iter()
        .map(|id| tokens.iter().position(|t| t == id).unwrap_or(usize::MAX))
        .collect()
}

/// The column of each vocabulary token in a head's `n` logits: its position in `ids` when the
/// head projects onto a subset, else the token itself.
fn columns(ids: Option<&[u32]>, vocab: usize, n: usize) -> Vec<Option<usize>> {
    let mut column: Vec<Option<usize>> = vec![None; vocab];
    match ids {
        Some(ids) => ids.iter().enumerate().for_each(|(c, &t)| {
            if let Some(slot) = column.get_mut(t as usize) {
                *slot = Some(c);
            }
        }),
        None => column
            .iter_mut()
            .take(n)
            .enumerate()
            .for_each(|(c, s)| *s = Some(c)),
    }
    column
}

/// Ranks of the full model's greedy tokens under a lookahead head drafting `levels` levels,
/// teacher-forced: for each position `i` of `score` (the root `tokens[i]`, `i ≥ 1`), level 1
/// is the head's draft of the token after the root from the layer-N state of `i − 1` and
/// `tokens[i]`, and level `l > 1` its draft of the token after `tokens[i + l − 1]` from its own
/// state of the level before and that true token ([`crate::drafters::HeadDrafter::with_levels`]
/// drafts so along its best child; here the path is the true one, so each level's rank is
/// conditional on the levels above it being right). Returns one [`Ranks`] per level over the
/// positions of `score` whose level stays inside `tokens`.
pub fn lookahead_ranks<M: LayeredModel, H: LookaheadHead<M>>(
    model: &M,
    head: &H,
    tokens: &[u32],
    score: Range<usize>,
    levels: usize,
) -> Result<Vec<Ranks>> {
    let (layers, features) = (model.num_layers(), head.feature_layers());
    if score.start == 0 || score.start > score.end || score.end > tokens.len() {
        return Err(CoreError::InvalidConfig(format!(
            "scored positions {score:?} of a sequence of {} tokens (a lookahead head drafts \
             from position 1 on)",
            tokens.len()
        )));
    }
    crate::generator::check_feature_layers(&features, layers)
        .map_err(|e| CoreError::InvalidConfig(format!("a lookahead head reading {e}")))?;
    let Some(&n) = features.last() else {
        return Err(CoreError::InvalidConfig(
            "a lookahead head that reads no layer".into(),
        ));
    };
    fits_context(model, tokens)?;
    let mut ranks = vec![Ranks::new(); levels];
    if score.is_empty() || levels == 0 {
        return Ok(ranks);
    }
    let mut cache = model.new_cache();
    let x = model.embed(tokens).map_err(CoreError::model)?;
    let (states, features) =
        crate::generator::forward_features(model, x, &features, n, &mut cache, None)?;
    let features = features.unwrap_or_else(|| states.clone());
    let top = match n < layers {
        true => model
            .forward_layers(states.clone(), n..layers, &mut cache)
            .map_err(CoreError::model)?,
        false => states,
    };
    let (full, vocab) = rows_of(model.logits(top), &(0..tokens.len()))?;
    let greedy: Vec<usize> = full.chunks(vocab).map(crate::argmax).collect();
    let mut head_cache = head.new_cache(model);
    let lookahead = |hidden, next: &[u32], cache: &mut H::Cache| {
        head.lookahead(model, hidden, next, cache)
            .map_err(CoreError::model)
    };
    // Rows 0..start − 1 (state j and token j + 1) as one block; then one row per position.
    let first = score.start - 1;
    if first > 0 {
        lookahead(
            features.clone().narrow(0, 0, first),
            &tokens[1..=first],
            &mut head_cache,
        )?;
    }
    for i in score {
        let mut draft = lookahead(
            features.clone().narrow(0, i - 1, 1),
            &tokens[i..=i],
            &mut head_cache,
        )?;
        for (level, ranks) in ranks.iter_mut().enumerate() {
            // Level `level + 1` drafts the model's token after `tokens[i + level]`.
            let Some(&target) = greedy.get(i + level) else {
                break;
            };
            let [_, width] = draft.draft.logits.dims();
            let row = host(draft.draft.logits.clone())?;
            let column = columns(
                draft.draft.token_ids.as_deref().map(Vec::as_slice),
                vocab,
                width,
            );
            ranks.push(column[target].map(|c| rank_of(&row, c)));
            if level + 1 < levels && i + level + 1 < tokens.len() {
                let next = &tokens[i + level + 1..=i + level + 1];
                draft = lookahead(draft.state, next, &mut head_cache)?;
            }
        }
        head.truncate(&mut head_cache, i);
    }
    Ok(ranks)
}

/// The rows `score` of `[t, n]` logits on the host, and the row width.
fn rows_of(logits: Tensor<2>, score: &Range<usize>) -> Result<(Vec<f32>, usize)> {
    let [_, n] = logits.dims();
    let rows = logits.narrow(0, score.start, score.len());
    Ok((host(rows)?, n))
}

/// Rank of column `c` in `row` under the order greedy decoding uses: larger first, ties to the
/// lower index ([`crate::argmax`] picks rank 0).
fn rank_of(row: &[f32], c: usize) -> u32 {
    let v = row[c];
    let above = row.iter().filter(|&&x| x > v).count();
    let tied_before = row[..c].iter().filter(|&&x| x == v).count();
    (above + tied_before) as u32
}

/// Ranks collected over many sequences, and the acceptance they imply.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    sequences: Vec<Ranks>,
}

impl Agreement {
    /// Adds one sequence's ranks (consecutive positions).
    pub fn push(&mut self, ranks: Ranks) {
        self.sequences.push(ranks);
    }

    /// Adds all of `other`'s sequences.
    pub fn extend(&mut self, other: &Agreement) {
        self.sequences.extend(other.sequences.iter().cloned());
    }

    /// Positions scored.
    pub fn positions(&self) -> usize {
        self.sequences.iter().map(Vec::len).sum()
    }

    /// Fraction of positions whose greedy token is among the head's top `k` (`k = 1`: the
    /// head's first draft is accepted).
    pub fn top_k(&self, k: u32) -> f64 {
        let hits = self
            .sequences
            .iter()
            .flatten()
            .filter(|r| r.is_some_and(|r| r < k))
            .count();
        hits as f64 / self.positions().max(1) as f64
    }

    /// Mean tokens per verification round (the accepted drafts + the model's own token) of a
    /// tree holding the head's top `width` tokens at every node down to `depth` levels, drafted
    /// from each scored position in turn; `width = 1` is a chain of `depth` drafts. The run of
    /// accepted drafts also ends where the sequence does, so long drafts are slightly
    /// undercounted near the end.
    pub fn tokens_per_round(&self, width: u32, depth: usize) -> f64 {
        let mut total = 0usize;
        for ranks in &self.sequences {
            // run[i]: consecutive positions from i whose greedy token is in the top `width`.
            let mut run = 0usize;
            for r in ranks.iter().rev() {
                run = if r.is_some_and(|r| r < width) {
                    run + 1
                } else {
                    0
                };
                total += 1 + run.min(depth);
            }
        }
        total as f64 / self.positions().max(1) as f64
    }

    /// Nodes of the full tree [`Agreement::tokens_per_round`] assumes: `width + width² + …`
    /// down to `depth` levels.
    pub fn tree_nodes(width: u32, depth: usize) -> u64 {
        (1..=depth as u32)
            .map(|d| u64::from(width).saturating_pow(d))
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_orders_like_argmax() {
        let row = [0.5, 2.0, 2.0, -1.0, 3.0];
        assert_eq!(rank_of(&row, 4), 0);
        assert_eq!(rank_of(&row, 1), 1);
        assert_eq!(rank_of(&row, 2), 2);
        assert_eq!(rank_of(&row, 0), 3);
        assert_eq!(rank_of(&row, 3), 4);
        let tied = [1.0, 1.0];
        assert_eq!(rank_of(&tied, crate::argmax(&tied)), 0);
    }

    #[test]
    fn acceptance_from_ranks() {
        let mut a = Agreement::default();
        // Hits of the top 1: positions 0, 1 and 4; of the top 2 also 2.
        a.push(vec![Some(0), Some(0), Some(1), None, Some(0)]);
        assert_eq!(a.positions(), 5);
        assert!((a.top_k(1) - 0.6).abs() < 1e-12);
        assert!((a.top_k(2) - 0.8).abs() < 1e-12);
        // Chains of 1 draft: 1 + hit at each position.
        assert!((a.tokens_per_round(1, 1) - 1.6).abs() < 1e-12);
        // Chains of 4 drafts: runs 2, 1, 0, 0, 1.
        assert!((a.tokens_per_round(1, 4) - (3.0 + 2.0 + 1.0 + 1.0 + 2.0) / 5.0).abs() < 1e-12);
        // Top-2 tree of depth 2: runs 3→2, 2, 1, 0, 1.
        assert!((a.tokens_per_round(2, 2) - (3.0 + 3.0 + 2.0 + 1.0 + 2.0) / 5.0).abs() < 1e-12);
        let mut b = Agreement::default();
        b.extend(&a);
        b.push(vec![None]);
        assert_eq!(b.positions(), 6);
        assert!((b.top_k(1) - 0.5).abs() < 1e-12);
        assert_eq!(Agreement::tree_nodes(2, 3), 14);
        assert_eq!(Agreement::tree_nodes(1, 4), 4);
    }
}
