//! Self-distillation: train an exit head to predict what the frozen full model predicts.
//!
//! Per position the student is the head on the frozen layer-N hidden state, the teacher the full
//! model's next-token distribution; the loss is KL(teacher ‖ student). With a vocabulary subset
//! the teacher is renormalised over the subset (the student has no mass elsewhere). The backbone
//! runs on the plain device (no autodiff graph, no gradients); only the head's weights live on
//! the autodiff device and are updated, by AdamW with linear warm-up, cosine decay and gradient
//! norm clipping.

use burn::module::Module;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use eesd_core::math::{exp, sum_f64};
use eesd_models::cpu::PackedCache;
use eesd_models::layer::{AttentionContext, linear, rms_norm};
use eesd_models::rope::Rope;
use eesd_models::{
    HeadKind, LayerHead, LayerHeadWeights, Llama, LlamaConfig, LmHeadRows, VocabSubset,
};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Hyper-parameters of self-distillation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistillConfig {
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Total optimisation steps (the cosine schedule ends here).
    pub total_steps: usize,
    /// AdamW weight decay.
    pub weight_decay: f32,
    /// Gradient clipping by global norm.
    pub grad_clip_norm: f32,
    /// Weight of an extra cross-entropy term on the full model's greedy token at each position
    /// (on answer positions that is the self-generated next token). 0 = pure KL. KL teaches
    /// the whole distribution (what speculative sampling accepts); CE pushes probability onto
    /// the one token greedy verification accepts. Positions whose greedy token is outside the
    /// draft vocabulary are skipped.
    #[serde(default)]
    pub ce_weight: f32,
    /// Train only on the positions that predict answer tokens (what drafting meets; evaluation
    /// scores the same ones), not on the prompts' positions, which are more than half of the
    /// model's self-generated data and follow the users' text rather than the model. The
    /// block's prompt lengths must be known ([`Teacher::with_prompt_lengths`]).
    #[serde(default)]
    pub answers_only: bool,
    /// Tree levels a lookahead head learns to draft (1: from the model's states only). Level
    /// `l > 1` reads the head's own output state of level `l − 1` in place of the model's, as
    /// drafting below the first level does ([`eesd_core::drafters::HeadDrafter::with_levels`]): each
    /// position is run once more per level, attending to the model-state rows before it and
    /// to its own chain of head states (EAGLE-3's training-time test, HASS).
    #[serde(default = "one_level")]
    pub levels: usize,
    /// Weight in the loss of each level below the first (the first weighs 1).
    #[serde(default = "half")]
    pub deep_weight: f32,
}

/// [`DistillConfig::levels`] of checkpoints saved before it existed.
fn one_level() -> usize {
    1
}

/// [`DistillConfig::deep_weight`] of checkpoints saved before it existed.
fn half() -> f32 {
    0.5
}

/// The most levels [`DistillConfig::levels`] may ask for (each costs a pass of the head over
/// a block as long as all the levels above it).
pub const MAX_LEVELS: usize = 4;

impl Default for DistillConfig {
    fn default() -> Self {
        DistillConfig {
            learning_rate: 3e-4,
            warmup_steps: 20,
            total_steps: 400,
            weight_decay: 0.01,
            grad_clip_norm: 1.0,
            ce_weight: 0.0,
            answers_only: false,
            levels: 1,
            deep_weight: 0.5,
        }
    }
}

impl DistillConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        let weight_ok = self.deep_weight >= 0.0 && self.deep_weight.is_finite();
        if !(weight_ok && (1..=MAX_LEVELS).contains(&self.levels)) {
            return Err(TrainError::InvalidConfig(format!(
                "levels {} (1 to {MAX_LEVELS}) and deep_weight {} (a non-negative number)",
                self.levels, self.deep_weight
            )));
        }
        if !(self.ce_weight >= 0.0 && self.ce_weight.is_finite()) {
            return Err(TrainError::InvalidConfig(format!(
                "ce_weight {} must be a non-negative number",
                self.ce_weight
            )));
        }
        if !(self.learning_rate > 0.0 && self.learning_rate.is_finite()) || self.total_steps == 0 {
            return Err(TrainError::InvalidConfig(format!(
                "learning rate {} and total steps {} must be positive",
                self.learning_rate, self.total_steps
            )));
        }
        Ok(())
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to 10% of the peak.
    pub fn learning_rate_at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.learning_rate * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        self.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    }
}

/// Held-out quality of a head.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    /// Mean KL(teacher ‖ student) per position (nats).
    pub kl: f64,
    /// Fraction of positions where the head's argmax equals the full model's.
    pub top1_agreement: f64,
    /// Expected tokens per verification round when drafting `k` tokens greedily: 1 + the run of
    /// consecutive agreements from each position, capped at `k`.
    pub expected_accepted: f64,
    /// The `k` used for `expected_accepted`.
    pub k: usize,
    /// Top-1 agreement of a lookahead head's deeper levels (2, 3, …; those it trains,
    /// [`DistillConfig::levels`]), each drafted from its own state of the level before, given
    /// the true tokens up to there; empty for one level.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deeper_top1: Vec<f64>,
    /// Positions evaluated (answer positions only).
    pub positions: usize,
}

/// A training or evaluation sequence: a prompt followed by the model's own answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    /// Prompt and answer token ids.
    pub tokens: Vec<u32>,
    /// Length of the prompt part; evaluation scores only the positions that predict the answer.
    pub prompt_len: usize,
}

/// AdamW with the config's weight decay and gradient clipping.
pub(crate) fn optimizer(config: &DistillConfig) -> ModuleOptimizer {
    AdamWConfig::new()
        .with_weight_decay(config.weight_decay)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(config.grad_clip_norm)))
        .init()
}

/// An index tensor of `ids` (rows or columns to select) on `device`.
fn index(ids: impl Iterator<Item = usize>, device: &Device) -> Tensor<1, Int> {
    let ids: Vec<i32> = ids.map(|i| i as i32).collect();
    let n = ids.len();
    Tensor::from_data(TensorData::new(ids, [n]), device)
}

/// Groups sequences (by their `lengths`, in order) into training batches of at most
/// `max_tokens` tokens each; a sequence longer than that gets a batch of its own. Packing keeps
/// the data order, so a run (and a resumed run) sees the same batches.
pub fn pack(lengths: &[usize], max_tokens: usize) -> Vec<Vec<usize>> {
    let mut batches: Vec<Vec<usize>> = Vec::new();
    let mut tokens = 0;
    for (i, &len) in lengths.iter().enumerate() {
        match batches.last_mut() {
            Some(batch) if tokens + len <= max_tokens => batch.push(i),
            _ => {
                batches.push(vec![i]);
                tokens = 0;
            }
        }
        tokens += len;
    }
    batches
}

/// Held-out sequences with the frozen model's pass over each kept, for repeated evaluations
/// ([`Distiller::evaluate_set`]): the full model runs once per sequence instead of once per
/// evaluation (on a CPU most of an evaluation's time). Keeps the states after the exit layers
/// asked for and the greedy tokens, not the full-vocabulary logits.
pub struct EvalSet {
    teachers: Vec<Teacher>,
}

impl EvalSet {
    /// The teacher passes over `sequences` (those of at least 2 tokens), keeping the states
    /// after each of `exit_layers`; each scores the positions that predict its answer (a
    /// prompt length beyond the sequence scores its last position).
    pub fn new(model: &Llama, sequences: &[Sequence], exit_layers: &[usize]) -> Result<Self> {
        let teachers = sequences
            .iter()
            .filter(|s| s.tokens.len() >= 2)
            .map(|seq| {
                let prompt = seq.prompt_len.min(seq.tokens.len());
                let mut teacher = Teacher::new(model, &[&seq.tokens], exit_layers)?
                    .with_prompt_lengths(vec![prompt])?;
                teacher.logits = None;
                Ok(teacher)
            })
            .collect::<Result<_>>()?;
        Ok(EvalSet { teachers })
    }

    /// Sequences in the set.
    pub fn len(&self) -> usize {
        self.teachers.len()
    }

    /// Whether the set has no sequence.
    pub fn is_empty(&self) -> bool {
        self.teachers.is_empty()
    }
}

/// A teacher's distribution over the draft vocabulary at some rows, as a distillation target.
#[derive(Clone)]
struct Target {
    /// Probabilities `[rows, vocabulary]` on the training device.
    probs: Tensor<2>,
    /// `Σ p log p` of each row (its negated entropy).
    neg_entropy: Vec<f64>,
}

impl Target {
    /// The target at `picks` (indices into its rows, ascending).
    fn rows(&self, picks: &[usize]) -> Target {
        let device = self.probs.device();
        Target {
            probs: self
                .probs
                .clone()
                .select(0, index(picks.iter().copied(), &device)),
            neg_entropy: picks.iter().map(|&i| self.neg_entropy[i]).collect(),
        }
    }
}

/// Each `width`-long row of `logits` turned into its softmax in place, and `Σ p log p` of each
/// row, on the host with the vectorisable `exp` (burn's CPU `exp` is a libm call per
/// element: with the teacher's log-softmax and its exponential that was ≈ 7% of a step).
fn softmax_rows(mut logits: Vec<f32>, width: usize) -> (Vec<f32>, Vec<f64>) {
    let mut neg_entropy = Vec::with_capacity(logits.len() / width.max(1));
    for row in logits.chunks_exact_mut(width.max(1)) {
        let max = eesd_models::cpu::rows::max(row);
        // Σ e^s and Σ e^s · s with s = l − max: Σ p log p = Σ e^s s / Σ e^s − ln Σ e^s. The
        // weighted sum in eight interleaved f64 partial sums, as `sum_f64` does.
        let mut partial = [0f64; 8];
        for chunk in row.chunks_mut(8) {
            for (p, v) in partial.iter_mut().zip(chunk) {
                let shifted = *v - max;
                *v = exp(shifted);
                *p += f64::from(*v * shifted);
            }
        }
        let weighted: f64 = partial.iter().sum();
        let sum = sum_f64(row);
        let norm = (1.0 / sum) as f32;
        row.iter_mut().for_each(|v| *v *= norm);
        neg_entropy.push(weighted / sum - sum.ln());
    }
    (logits, neg_entropy)
}

/// Where each of `rows` sits in `within` (both ascending; `rows` a subset of `within`).
fn subset_positions(within: &[usize], rows: &[usize]) -> Result<Vec<usize>> {
    rows.iter()
        .map(|r| {
            within.binary_search(r).map_err(|_| {
                TrainError::InvalidConfig(format!("row {r} outside the first level's rows"))
            })
        })
        .collect()
}

/// One level of a head's drafts on a training block: log-probabilities `[r, n]` and the
/// teacher row each of the `r` rows learns.
struct Level {
    logp: Tensor<2>,
    rows: Vec<usize>,
}

/// The passes of a lookahead head over a packed block when it learns to draft deeper
/// ([`DistillConfig::levels`]). Pass 1 reads the model's states; in pass `j > 1` the row at
/// position `k` reads the head's own output of pass `j − 1` at position `k − 1` (what drafting
/// one level deeper feeds it) and attends, as in drafting, to the pass-1 rows before position
/// `k − j + 2` and to its own chain: pass `i` at position `k − j + i` for `2 ≤ i ≤ j`. That is
/// a tree per sequence (the pass-1 rows its trunk, each deeper row the child of the row of the
/// pass before at the position before), so one packed block of trees runs every pass so far.
struct OwnStatePasses {
    /// The learnt rows of each sequence (its length minus one).
    lengths: Vec<usize>,
    /// Where each sequence's learnt rows start among all learnt rows.
    starts: Vec<usize>,
    /// Each pass's fused inputs: pass `j` (0-based) holds positions `j..` of each sequence, in
    /// (sequence, position) order.
    inputs: Vec<Tensor<2>>,
}

impl OwnStatePasses {
    /// The first pass: `input`, one row per learnt row of sequences of `lengths` learnt rows.
    fn new(lengths: Vec<usize>, input: Tensor<2>) -> Self {
        let starts = lengths
            .iter()
            .scan(0, |at, &n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        OwnStatePasses {
            lengths,
            starts,
            inputs: vec![input],
        }
    }

    /// The rows of pass `j` (0-based), as indices into all learnt rows.
    fn pass_rows(&self, j: usize) -> Vec<usize> {
        self.starts
            .iter()
            .zip(&self.lengths)
            .flat_map(|(&start, &n)| start + j.min(n)..start + n)
            .collect()
    }

    /// The rows of the last pass, as indices into all learnt rows.
    fn last_rows(&self) -> Vec<usize> {
        self.pass_rows(self.inputs.len() - 1)
    }

    /// The next pass from the last one's output `state` (before the head's norm; its rows in
    /// [`OwnStatePasses::last_rows`] order) and every learnt row's next-token embedding `next`:
    /// the block of all passes so far for the sequences the new pass reaches, its context,
    /// and where the new rows sit in the block. `None` when no sequence is long enough.
    fn deeper(
        &mut self,
        weights: &LayerHeadWeights,
        state: Tensor<2>,
        next: &Tensor<2>,
        rope: &Rope,
        config: &LlamaConfig,
    ) -> Result<Option<(Tensor<2>, AttentionContext, Vec<usize>)>> {
        let passes = self.inputs.len() + 1;
        let new = passes - 1;
        let rows = self.pass_rows(new);
        if rows.is_empty() {
            return Ok(None);
        }
        // Rows of this sequence in each pass: pass j holds positions j.., n − j of them.
        let counts = |n: usize| (0..passes).map(move |j| n.saturating_sub(j));
        // Each row of the last pass but a sequence's last feeds the new row one position on.
        let mut read = Vec::with_capacity(rows.len());
        let mut at = 0;
        for &n in &self.lengths {
            let last = n.saturating_sub(new - 1);
            read.extend(at..at + last.saturating_sub(1));
            at += last;
        }
        let device = state.device();
        let input = weights.fused_input(
            weights.own_state_input(state.select(0, index(read.into_iter(), &device))),
            next.clone()
                .select(0, index(rows.into_iter(), &next.device())),
            config.rms_norm_eps,
        )?;
        self.inputs.push(input);
        // Where each pass starts in the concatenation of all passes, and each sequence's first
        // row within each pass as the sequences go by.
        let mut pass_start: Vec<usize> = (0..passes)
            .scan(0, |at, j| {
                let start = *at;
                *at += self
                    .lengths
                    .iter()
                    .map(|&n| n.saturating_sub(j))
                    .sum::<usize>();
                Some(start)
            })
            .collect();
        let (mut block_rows, mut trees, mut pick) = (Vec::new(), Vec::new(), Vec::new());
        for &n in &self.lengths {
            if n <= new {
                // The new pass does not reach this sequence: skip its rows in every pass.
                counts(n).zip(&mut pass_start).for_each(|(c, at)| *at += c);
                continue;
            }
            let segment = block_rows.len();
            let mut parents = Vec::new();
            let (mut offset, mut previous) = (0, 0);
            for ((j, c), at) in counts(n).enumerate().zip(&mut pass_start) {
                // Position k = j + i; its parent: position k − 1 of the pass before (of this
                // pass in the trunk), none for position 0.
                parents.extend((0..c).map(|i| match (j, i) {
                    (0, 0) => None,
                    (0, _) => Some(i - 1),
                    _ => Some(previous + i),
                }));
                block_rows.extend(*at..*at + c);
                if j == new {
                    pick.extend(segment + offset..segment + offset + c);
                }
                previous = offset;
                offset += c;
                *at += c;
            }
            let tree = eesd_core::TreeMask::try_new(parents).map_err(TrainError::InvalidConfig)?;
            trees.push(std::sync::Arc::new(tree));
        }
        let all = Tensor::cat(self.inputs.clone(), 0);
        let block = all.select(0, index(block_rows.into_iter(), &device));
        let ctx = AttentionContext::packed_trees(rope, config, &trees)?;
        Ok(Some((block, ctx, pick)))
    }
}

/// The frozen model's outputs for a packed block of sequences, on the plain device: what every
/// head trained on that block needs. One [`Teacher`] serves heads at several exit layers (the
/// full forward pass, most of a step's cost, runs once for all of them).
pub struct Teacher {
    /// The block's token ids.
    tokens: Vec<u32>,
    /// Layer-N hidden states `[t, hidden]` per exit layer N asked for, by layer, the last
    /// layer's (before the final norm) always last.
    hidden: Vec<(usize, Tensor<2>)>,
    /// Full-vocabulary logits `[t, vocab]`, when they were computed for the argmax (a block
    /// read back from a [`crate::TeacherCache`] comes with its argmax and skips them).
    logits: Option<Tensor<2>>,
    /// The full model's argmax at each position.
    argmax: Vec<u32>,
    /// Lengths of the sequences packed in the block.
    lengths: Vec<usize>,
    /// Lengths of their prompts, where known ([`Teacher::with_prompt_lengths`]).
    prompt_lengths: Option<Vec<usize>>,
}

impl Teacher {
    /// Runs `model` once over `sequences` packed into one block (each attends only to itself),
    /// keeping the hidden states after each of `exit_layers` (the last layer L included, for
    /// lookahead heads: the states before the final norm).
    pub fn new(model: &Llama, sequences: &[&[u32]], exit_layers: &[usize]) -> Result<Self> {
        let (tokens, lengths) = Self::block(model, sequences, exit_layers)?;
        Self::run(model, tokens, lengths, exit_layers)
    }

    /// [`Teacher::new`] on a block [`Teacher::block`] has checked.
    pub(crate) fn run(
        model: &Llama,
        tokens: Vec<u32>,
        lengths: Vec<usize>,
        exit_layers: &[usize],
    ) -> Result<Self> {
        let layers = model.num_layers();
        let ctx = AttentionContext::packed(model.rope(), model.config(), &lengths)?;
        let mut x = model.embed(&tokens)?;
        let mut exits = exit_layers.to_vec();
        exits.sort_unstable();
        exits.dedup();
        let (mut done, mut hidden) = (0, Vec::new());
        for &n in exits.iter().filter(|&&n| n < layers) {
            x = model.forward_packed(x, done..n, &ctx)?;
            hidden.push((n, x.clone()));
            done = n;
        }
        hidden.push((layers, model.forward_packed(x, done..layers, &ctx)?));
        Self::from_states(model, tokens, lengths, hidden, None)
    }

    /// The block's tokens and sequence lengths, once `sequences` and `exit_layers` are checked.
    pub(crate) fn block(
        model: &Llama,
        sequences: &[&[u32]],
        exit_layers: &[usize],
    ) -> Result<(Vec<u32>, Vec<usize>)> {
        if sequences.is_empty() || sequences.iter().any(|s| s.len() < 2) {
            return Err(TrainError::InvalidConfig(
                "a training batch needs at least one sequence, each of at least 2 tokens".into(),
            ));
        }
        let layers = model.num_layers();
        if let Some(n) = exit_layers.iter().find(|&&n| n == 0 || n > layers) {
            return Err(TrainError::InvalidConfig(format!(
                "exit layer {n} of a model of {layers} layers"
            )));
        }
        Ok((
            sequences.concat(),
            sequences.iter().map(|s| s.len()).collect(),
        ))
    }

    /// The teacher of a block whose states after each layer kept are known (by layer, the last
    /// layer's last): the greedy tokens follow from the last layer's, as in [`Teacher::new`],
    /// bit for bit, unless they are known too (`argmax`: then the full-vocabulary LM head, a
    /// fifth of a small head's step, is not run at all).
    pub(crate) fn from_states(
        model: &Llama,
        tokens: Vec<u32>,
        lengths: Vec<usize>,
        hidden: Vec<(usize, Tensor<2>)>,
        argmax: Option<Vec<u32>>,
    ) -> Result<Self> {
        let top = match hidden.last() {
            Some((n, top)) if *n == model.num_layers() => top.clone(),
            _ => {
                return Err(TrainError::InvalidConfig(
                    "a teacher's states end with the last layer's".into(),
                ));
            }
        };
        if let Some(argmax) = &argmax
            && argmax.len() != tokens.len()
        {
            return Err(TrainError::InvalidConfig(format!(
                "{} greedy tokens for a block of {} positions",
                argmax.len(),
                tokens.len()
            )));
        }
        let (logits, argmax) = match argmax {
            Some(argmax) => (None, argmax),
            None => {
                let logits = model.logits(top);
                let argmax = logits
                    .clone()
                    .argmax(1)
                    .into_data()
                    .convert::<i64>()
                    .try_into_vec::<i64>()
                    .map_err(|e| TrainError::TensorData(format!("{e:?}")))?
                    .into_iter()
                    .map(|v| v as u32)
                    .collect();
                (Some(logits), argmax)
            }
        };
        Ok(Teacher {
            tokens,
            hidden,
            logits,
            argmax,
            lengths,
            prompt_lengths: None,
        })
    }

    /// The same block with the prompt length of each of its sequences (in order), so that a
    /// head trained with [`DistillConfig::answers_only`] learns only where answers are predicted.
    pub fn with_prompt_lengths(mut self, prompt_lengths: Vec<usize>) -> Result<Self> {
        let fits = prompt_lengths.len() == self.lengths.len()
            && prompt_lengths
                .iter()
                .zip(&self.lengths)
                .all(|(p, n)| p <= n);
        if !fits {
            return Err(TrainError::InvalidConfig(format!(
                "prompt lengths {prompt_lengths:?} for sequences of lengths {:?}",
                self.lengths
            )));
        }
        self.prompt_lengths = Some(prompt_lengths);
        Ok(self)
    }

    /// Which of the block rows `rows` (ascending) predict answer tokens: a row at position `i`
    /// of its sequence predicts token `i + 1`, an answer token from the prompt's last position on.
    /// Indices into `rows`.
    fn answer_rows(&self, rows: &[usize]) -> Result<Vec<usize>> {
        let prompts = self.prompt_lengths.as_ref().ok_or_else(|| {
            TrainError::InvalidConfig(
                "training on answers only needs the block's prompt lengths".into(),
            )
        })?;
        // The first row of each sequence that predicts an answer token, and where it ends.
        let mut spans = Vec::with_capacity(prompts.len());
        let mut start = 0;
        for (&len, &prompt) in self.lengths.iter().zip(prompts) {
            spans.push((start + prompt.saturating_sub(1), start + len));
            start += len;
        }
        Ok(rows
            .iter()
            .enumerate()
            .filter(|&(_, &r)| spans.iter().any(|&(from, end)| (from..end).contains(&r)))
            .map(|(i, _)| i)
            .collect())
    }

    /// Positions in the block.
    pub fn positions(&self) -> usize {
        self.argmax.len()
    }

    /// The block's token ids.
    pub(crate) fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Lengths of the sequences packed in the block.
    pub(crate) fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// The states after each layer kept, by layer, the last layer's last.
    pub(crate) fn states(&self) -> &[(usize, Tensor<2>)] {
        &self.hidden
    }

    /// The full model's greedy token at each position.
    pub(crate) fn argmax(&self) -> &[u32] {
        &self.argmax
    }

    /// The full model's logits over `targets`' tokens (all of them with `None`) at `rows`
    /// (ascending block positions), `[rows, tokens]`: the same bits whichever way the teacher
    /// was made (each output is its own chain of products).
    fn logits_at(
        &self,
        model: &Llama,
        targets: Option<&LmHeadRows>,
        rows: &[usize],
    ) -> Result<Tensor<2>> {
        let every = rows.len() == self.positions();
        let pick = |t: Tensor<2>| match every {
            true => t,
            false => {
                let device = t.device();
                t.select(0, index(rows.iter().copied(), &device))
            }
        };
        Ok(match (targets, &self.logits) {
            (None, Some(logits)) => pick(logits.clone()),
            (None, None) => model.logits(pick(self.top()?)),
            (Some(targets), _) => model.logits_of(pick(self.top()?), targets),
        })
    }

    /// The last layer's states (before the final norm).
    fn top(&self) -> Result<Tensor<2>> {
        self.hidden
            .last()
            .map(|(_, t)| t.clone())
            .ok_or_else(|| TrainError::InvalidConfig("a teacher without states".into()))
    }

    fn hidden(&self, exit_layer: usize) -> Result<Tensor<2>> {
        self.hidden
            .iter()
            .find(|(n, _)| *n == exit_layer)
            .map(|(_, h)| h.clone())
            .ok_or_else(|| {
                TrainError::InvalidConfig(format!(
                    "the teacher block has no states after layer {exit_layer}"
                ))
            })
    }
}

/// Trains a [`LayerHead`] by self-distillation.
pub struct Distiller<'m> {
    pub(crate) model: &'m Llama,
    pub(crate) exit_layer: usize,
    pub(crate) subset: Option<VocabSubset>,
    pub(crate) weights: LayerHeadWeights,
    pub(crate) optim: ModuleOptimizer,
    pub(crate) config: DistillConfig,
    pub(crate) step: usize,
    train_device: Device,
    rope: Rope,
    projection: Tensor<2>,
    /// The LM head's rows of the draft vocabulary: the teacher's logits over it alone.
    target_rows: Option<LmHeadRows>,
    /// Column of each full-vocabulary token in the draft vocabulary (`None`: outside it).
    column: Vec<Option<usize>>,
}

impl<'m> Distiller<'m> {
    /// Starts from `head` (e.g. [`LayerHead::from_model`]) for `model`.
    pub fn new(model: &'m Llama, head: LayerHead, config: DistillConfig) -> Result<Self> {
        config.validate()?;
        let exit_layer = eesd_core::DraftHead::exit_layer(&head)
            .ok_or_else(|| TrainError::InvalidConfig("a layer head has an exit layer".into()))?;
        let subset = head
            .token_ids()
            .map(|ids| VocabSubset::new(ids.to_vec(), model.config().vocab_size))
            .transpose()?;
        let train_device = model.device().clone().autodiff();
        let rope = Rope::new(model.config(), &train_device);
        let lm_head = model.lm_head().clone();
        let subset_ids = subset
            .as_ref()
            .map(|s| index(s.ids().iter().map(|&i| i as usize), model.device()));
        let projection = match &subset_ids {
            Some(ids) => lm_head.select(0, ids.clone()),
            None => lm_head,
        }
        .to_device(&train_device);
        let target_rows = subset
            .as_ref()
            .map(|s| model.lm_head_rows(s.ids()))
            .transpose()?;
        let optim = optimizer(&config);
        let vocab = model.config().vocab_size;
        let column = match &subset {
            Some(s) => {
                let mut column = vec![None; vocab];
                for (i, &id) in s.ids().iter().enumerate() {
                    column[id as usize] = Some(i);
                }
                column
            }
            None => (0..vocab).map(Some).collect(),
        };
        if config.levels > 1 && head.kind() != HeadKind::Lookahead {
            return Err(TrainError::InvalidConfig(format!(
                "{} levels for a `{}` head: only lookahead heads draft from their own states",
                config.levels,
                head.kind().name()
            )));
        }
        let weights = head.into_weights().fork(&train_device).train();
        // A layer shared with a model holding native weights has lazy, frozen parameters:
        // training would silently update nothing but the norm gain.
        if weights
            .matrices()
            .iter()
            .any(|w| !w.val().is_require_grad())
        {
            return Err(TrainError::InvalidConfig(
                "the head's weights are frozen (parameters shared with the model?); build it \
                 with LayerHead::from_model or load it from a checkpoint"
                    .into(),
            ));
        }
        Ok(Distiller {
            model,
            exit_layer,
            subset,
            weights,
            optim,
            config,
            step: 0,
            train_device,
            rope,
            projection,
            target_rows,
            column,
        })
    }

    /// The layers whose states the head reads, so the frozen model's pass must keep them: its
    /// exit layer, after the earlier layers a mixing lookahead head reads too.
    pub fn teacher_layers(&self) -> Vec<usize> {
        self.weights.feature_layers(self.exit_layer)
    }

    /// Steps taken so far.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The configuration in force (for a resumed run: the saved one).
    pub fn config(&self) -> &DistillConfig {
        &self.config
    }

    /// Re-plans the run to end at step `total` (a resumed run cut short, or lengthened): the
    /// cosine decay runs from here on toward the new end. `total` must lie beyond the steps
    /// taken and the warm-up.
    pub fn set_total_steps(&mut self, total: usize) -> Result<()> {
        self.set_schedule(total, self.config.warmup_steps)
    }

    /// Re-plans the run on the fly (`train_exit_head --time-budget`): it ends at step `total`,
    /// after a warm-up of `warmup` steps (a shortened run keeps its warm-up a small part of its
    /// length). Steps already taken keep the rates they had; `total` must lie beyond them.
    pub fn set_schedule(&mut self, total: usize, warmup: usize) -> Result<()> {
        if total <= self.step || warmup >= total {
            return Err(TrainError::InvalidConfig(format!(
                "a run at step {} cannot end at step {total} after a warm-up of {warmup}",
                self.step
            )));
        }
        self.config.total_steps = total;
        self.config.warmup_steps = warmup;
        Ok(())
    }

    /// Student log-probabilities `[r, n]` on the training device for the teacher's block, and
    /// for each student row the teacher row whose distribution it learns: the same row for a
    /// chain head; for a lookahead head, which reads a position's state and the token after
    /// it, the next row (the last position of each sequence has no such row and is left out).
    /// A lookahead head gives one such pair per level up to `levels` (see
    /// [`DistillConfig::levels`]). With `answers_only`, only the rows that predict answer tokens.
    fn students(&self, teacher: &Teacher, answers_only: bool, levels: usize) -> Result<Vec<Level>> {
        let c = self.model.config();
        let hidden = match self.weights.mix_layers.is_empty() {
            true => teacher.hidden(self.exit_layer)?,
            false => {
                let layers = self.teacher_layers();
                let states = layers.iter().map(|&l| teacher.hidden(l));
                Tensor::cat(states.collect::<Result<_>>()?, 1)
            }
        };
        let mut out = Vec::with_capacity(levels);
        match self.weights.kind {
            HeadKind::Lookahead => {
                let (mut learn, mut lengths) = (Vec::new(), Vec::new());
                let mut start = 0;
                for &len in &teacher.lengths {
                    learn.extend(start + 1..start + len);
                    lengths.push(len - 1);
                    start += len;
                }
                // Each learnt row reads the state of the row before it.
                let read = index(learn.iter().map(|&r| r - 1), &hidden.device());
                let next: Vec<u32> = learn.iter().map(|&r| teacher.tokens[r]).collect();
                let next = self.model.embed(&next)?.to_device(&self.train_device);
                let input = self.weights.fused_input(
                    hidden.select(0, read).to_device(&self.train_device),
                    next.clone(),
                    c.rms_norm_eps,
                )?;
                let ctx = AttentionContext::packed(&self.rope, c, &lengths)?;
                let mut state = self
                    .weights
                    .block(input.clone(), &self.rope, &ctx, None, c)?;
                out.push(self.level(teacher, state.clone(), learn.clone(), answers_only)?);
                let mut passes = OwnStatePasses::new(lengths, input);
                for _ in 1..levels {
                    let deeper = passes.deeper(&self.weights, state, &next, &self.rope, c)?;
                    let Some((block, ctx, pick)) = deeper else {
                        break;
                    };
                    let h = self.weights.block(block, &self.rope, &ctx, None, c)?;
                    state = h.select(0, index(pick.iter().copied(), &self.train_device));
                    let rows = passes.last_rows().into_iter().map(|k| learn[k]).collect();
                    out.push(self.level(teacher, state.clone(), rows, answers_only)?);
                }
            }
            HeadKind::Layer | HeadKind::Adapter => {
                let ctx = AttentionContext::packed(&self.rope, c, &teacher.lengths)?;
                let hidden = hidden.to_device(&self.train_device);
                let state = self.weights.block(hidden, &self.rope, &ctx, None, c)?;
                let rows = (0..teacher.positions()).collect();
                out.push(self.level(teacher, state, rows, answers_only)?);
            }
        }
        Ok(out)
    }

    /// The head's log-probabilities over its draft vocabulary `[r, n]` at every level it trains
    /// ([`DistillConfig::levels`]) on `teacher`'s block, each row with the block row whose
    /// distribution it learns (prompt rows included): what a training step scores, detached
    /// and on the model's device.
    pub fn level_log_probs(&self, teacher: &Teacher) -> Result<Vec<(Tensor<2>, Vec<usize>)>> {
        let device = self.model.device();
        Ok(self
            .students(teacher, false, self.config.levels)?
            .into_iter()
            .map(|l| (l.logp.detach().to_device(device), l.rows))
            .collect())
    }

    /// One level's log-probabilities from the head's block outputs `state` (before its norm)
    /// learning the teacher rows `rows`; with `answers_only`, at the answer rows alone. Every
    /// row ran the head's layer (the answers attend to their prompts); only those scored go
    /// through the projection.
    fn level(
        &self,
        teacher: &Teacher,
        state: Tensor<2>,
        rows: Vec<usize>,
        answers_only: bool,
    ) -> Result<Level> {
        let keep = match answers_only {
            true => Some(teacher.answer_rows(&rows)?).filter(|keep| keep.len() < rows.len()),
            false => None,
        };
        let (state, rows) = match keep {
            Some(keep) => {
                let picked = index(keep.iter().copied(), &state.device());
                (
                    state.select(0, picked),
                    keep.iter().map(|&k| rows[k]).collect(),
                )
            }
            None => (state, rows),
        };
        let normed = rms_norm(
            state,
            self.weights.norm.val(),
            self.model.config().rms_norm_eps,
        );
        // Autodiff tensors: burn's matmul (the packed kernel is for inference on flex).
        let no_packing = PackedCache::default();
        Ok(Level {
            logp: log_softmax(linear(normed, &self.projection, &no_packing), 1),
            rows,
        })
    }

    /// The teacher's distribution over the draft vocabulary at `rows`, on the training device.
    fn targets(&self, teacher: &Teacher, rows: &[usize]) -> Result<Target> {
        let logits = teacher.logits_at(self.model, self.target_rows.as_ref(), rows)?;
        let [r, n] = logits.dims();
        let values = logits
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| TrainError::TensorData(format!("{e:?}")))?;
        let (probs, neg_entropy) = softmax_rows(values, n);
        Ok(Target {
            probs: Tensor::from_data(TensorData::new(probs, [r, n]), &self.train_device),
            neg_entropy,
        })
    }

    /// Mean −log q(greedy token) over positions whose greedy token is in the draft vocabulary.
    fn greedy_ce(&self, student: Tensor<2>, greedy: &[u32]) -> Tensor<1> {
        let (cols, mask): (Vec<i32>, Vec<f32>) = greedy
            .iter()
            .map(|&g| match self.column.get(g as usize).copied().flatten() {
                Some(c) => (c as i32, 1.0),
                None => (0, 0.0),
            })
            .unzip();
        let t = cols.len();
        let kept = mask.iter().sum::<f32>().max(1.0) as f64;
        let device = &self.train_device;
        let cols = Tensor::<2, Int>::from_data(TensorData::new(cols, [t, 1]), device);
        let mask = Tensor::<2>::from_data(TensorData::new(mask, [t, 1]), device);
        (student.gather(1, cols) * mask)
            .sum()
            .neg()
            .div_scalar(kept)
    }

    /// Mean KL(teacher ‖ student) over the rows, from the student's log-probabilities: the
    /// teacher's `Σ p log p` is a constant (no gradient), so only `−Σ p log q` is traced.
    fn kl(target: Target, student: Tensor<2>) -> Tensor<1> {
        let t = target.probs.dims()[0].max(1) as f64;
        (target.probs * student)
            .sum()
            .neg()
            .add_scalar(target.neg_entropy.iter().sum::<f64>())
            .div_scalar(t)
    }

    /// One optimisation step on a batch of whole sequences, packed into one block (see
    /// [`pack`]); the loss is the mean over all their positions. Returns the loss.
    pub fn train_step(&mut self, batch: &[&[u32]]) -> Result<f64> {
        let teacher = Teacher::new(self.model, batch, &self.teacher_layers())?;
        self.train_step_on(&teacher)
    }

    /// [`Distiller::train_step`] on a block the frozen model has already run over, e.g. one
    /// [`Teacher`] shared by heads at several exit layers (it must hold this head's layer).
    pub fn train_step_on(&mut self, teacher: &Teacher) -> Result<f64> {
        let levels = self.students(teacher, self.config.answers_only, self.config.levels)?;
        // The teacher's distributions once, at the first level's rows: every deeper level
        // learns a subset of them.
        let first = levels.first().map(|l| l.rows.clone()).unwrap_or_default();
        let targets = self.targets(teacher, &first)?;
        let mut loss: Option<Tensor<1>> = None;
        for (depth, Level { logp, rows }) in levels.into_iter().enumerate() {
            let target = match depth {
                0 => targets.clone(),
                _ => targets.rows(&subset_positions(&first, &rows)?),
            };
            let mut term = Self::kl(target, logp.clone());
            if self.config.ce_weight > 0.0 {
                let greedy: Vec<u32> = rows.iter().map(|&r| teacher.argmax[r]).collect();
                term = term + self.greedy_ce(logp, &greedy) * self.config.ce_weight;
            }
            // The first level weighs 1, each deeper one `deep_weight`.
            let term = match depth {
                0 => term,
                _ => term * self.config.deep_weight,
            };
            loss = Some(match loss {
                Some(loss) => loss + term,
                None => term,
            });
        }
        let loss = loss.ok_or_else(|| TrainError::InvalidConfig("a block without rows".into()))?;
        let value = loss.clone().into_scalar::<f32>() as f64;
        let grads = GradientsParams::from_grads(loss.backward(), &self.weights);
        let lr = self.config.learning_rate_at(self.step);
        // Param values are shared handles: the clone is cheap, and step() returns the update.
        self.weights = self.optim.step(lr, self.weights.clone(), grads);
        self.step += 1;
        Ok(value)
    }

    /// KL, top-1 agreement and expected accepted tokens at draft length `k` on held-out sequences,
    /// over the positions that predict answer tokens (a repeated system prompt is easy to predict
    /// and would flatter the head).
    pub fn evaluate(&self, sequences: &[Sequence], k: usize) -> Result<EvalMetrics> {
        self.evaluate_set(
            &EvalSet::new(self.model, sequences, &self.teacher_layers())?,
            k,
        )
    }

    /// [`Distiller::evaluate`] on sequences whose teacher passes are kept (the set must hold
    /// this head's exit layer): what a training run evaluates every few hundred steps.
    pub fn evaluate_set(&self, set: &EvalSet, k: usize) -> Result<EvalMetrics> {
        let (mut kl, mut agree, mut accepted, mut positions) = (0.0, 0usize, 0.0, 0usize);
        let deeper = self.config.levels.saturating_sub(1);
        let (mut deeper_agree, mut deeper_rows) = (vec![0usize; deeper], vec![0usize; deeper]);
        for teacher in &set.teachers {
            let mut levels = self
                .students(teacher, true, self.config.levels)?
                .into_iter();
            let Some(Level { logp, rows: learnt }) = levels.next() else {
                continue;
            };
            let rows = learnt.len();
            if rows == 0 {
                continue;
            }
            let student = logp.detach();
            let target = self.targets(teacher, &learnt)?;
            kl += Self::kl(target, student.clone()).into_scalar::<f32>() as f64 * rows as f64;
            let ok = self.agreements(teacher, student, &learnt)?;
            agree += ok.iter().filter(|&&b| b).count();
            for s in 0..rows {
                accepted += 1.0 + ok[s..].iter().take(k).take_while(|&&b| b).count() as f64;
            }
            positions += rows;
            for (depth, level) in levels.enumerate() {
                let ok = self.agreements(teacher, level.logp.detach(), &level.rows)?;
                deeper_agree[depth] += ok.iter().filter(|&&b| b).count();
                deeper_rows[depth] += ok.len();
            }
        }
        let n = positions.max(1) as f64;
        Ok(EvalMetrics {
            kl: kl / n,
            top1_agreement: agree as f64 / n,
            expected_accepted: accepted / n,
            k,
            positions,
            deeper_top1: deeper_agree
                .iter()
                .zip(&deeper_rows)
                .map(|(&a, &r)| a as f64 / r.max(1) as f64)
                .collect(),
        })
    }

    /// Whether the student's argmax at each of its rows is the full model's greedy token at
    /// the teacher row it learns.
    fn agreements(
        &self,
        teacher: &Teacher,
        student: Tensor<2>,
        learnt: &[usize],
    ) -> Result<Vec<bool>> {
        let picks = student
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|e| TrainError::TensorData(format!("{e:?}")))?;
        Ok(picks
            .iter()
            .zip(learnt.iter().map(|&r| &teacher.argmax[r]))
            .map(|(&p, &a)| {
                self.subset
                    .as_ref()
                    .map_or(p as u32, |s| s.ids()[p as usize])
                    == a
            })
            .collect())
    }

    /// The trained head, back on the model's device.
    pub fn into_head(self) -> Result<LayerHead> {
        let weights = self.weights.to_device(self.model.device());
        Ok(LayerHead::from_weights(
            self.model,
            self.exit_layer,
            weights,
            self.subset.as_ref(),
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::softmax_rows;

    #[test]
    fn softmax_rows_match_the_f64_definition() {
        let width = 37;
        let logits: Vec<f32> = (0..3 * width)
            .map(|i| ((i * 7919) % 101) as f32 * 0.37 - 20.0)
            .collect();
        let (probs, neg_entropy) = softmax_rows(logits.clone(), width);
        let neg_entropy: f64 = neg_entropy.iter().sum();
        let mut want_entropy = 0.0;
        for (row, got) in logits.chunks(width).zip(probs.chunks(width)) {
            let max = row
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
            let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
            for (&l, &p) in row.iter().zip(got) {
                let want = (f64::from(l) - max).exp() / sum;
                assert!(
                    (f64::from(p) - want).abs() < 1e-6 * want.max(1e-3),
                    "{p} vs {want}"
                );
                want_entropy += want * want.ln();
            }
        }
        assert!(
            (neg_entropy - want_entropy).abs() < 1e-5,
            "{neg_entropy} vs {want_entropy}"
        );
    }
}
