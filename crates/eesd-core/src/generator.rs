//! The decoding loops: plain AR, and EESD rounds (draft → verify → accept → roll back).

use std::ops::ControlFlow;
use std::time::Instant;

use burn::tensor::Tensor;
use eesd_bandit::{Decision, DraftPolicy, DraftStep, Policy, RoundOutcome};

use crate::accept::{Verdict, accept_greedy, accept_sampling, accept_tree};
use crate::drafter::{Drafter, top_k};
use crate::error::{CoreError, Result};
use crate::generate::{
    Detokenizer, Emitter, GenerationConfig, GenerationOutput, GenerationStats, Mode, StopReason,
};
use crate::math::exp;
use crate::model::{DraftHead, DraftLogits, LayeredModel};
use crate::sampling::{Sampler, SamplingParams, argmax, softmax_normaliser};
use crate::tree::{DraftTree, TreeMask};

/// The head type of a generator without an exit head (AR only). It has no values.
#[derive(Debug, Clone, Copy)]
pub enum NoHead {}

impl<M: LayeredModel> DraftHead<M> for NoHead {
    type Cache = ();
    fn exit_layer(&self) -> Option<usize> {
        match *self {}
    }
    fn new_cache(&self, _: &M) {
        match *self {}
    }
    fn draft_logits(
        &self,
        _: &M,
        _: Tensor<2>,
        _: &mut (),
    ) -> std::result::Result<DraftLogits, M::Error> {
        match *self {}
    }
    fn cached_len(&self, _: &()) -> usize {
        match *self {}
    }
    fn truncate(&self, _: &mut (), _: usize) {
        match *self {}
    }
}

/// Generates text with a model, by AR or EESD, streaming tokens as they are accepted.
///
/// The generator owns the draft-length policy, so what a learning policy (Thompson Sampling)
/// learns carries over from one prompt to the next.
pub struct Generator<'a, M: LayeredModel, H: DraftHead<M> = NoHead> {
    model: &'a M,
    head: Option<&'a H>,
    policy: Box<dyn DraftPolicy + 'a>,
    drafter: Option<Box<dyn Drafter + 'a>>,
    detokenize: Option<Box<Detokenizer<'a>>>,
}

impl<'a, M: LayeredModel> Generator<'a, M, NoHead> {
    /// A generator for plain AR decoding; add a head with [`Generator::with_head`] for EESD.
    pub fn new(model: &'a M) -> Self {
        let policy = Box::new(Policy::BetaTs(eesd_bandit::BetaTs::new(0)));
        Generator {
            model,
            head: None,
            policy,
            drafter: None,
            detokenize: None,
        }
    }
}

fn model_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> CoreError {
    CoreError::model(e)
}

/// A tensor's values on the host, as f32.
pub(crate) fn host(t: Tensor<2>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| CoreError::TensorData(format!("{e:?}")))
}

/// The rows of `[rows, n]` host data (views: a round's logits are megabytes).
fn rows(data: &[f32], n: usize) -> Vec<&[f32]> {
    data.chunks(n.max(1)).collect()
}

/// Softmax probability of `index` under `logits` at temperature 1 (the draft's confidence).
fn softmax_at(logits: &[f32], index: usize) -> f32 {
    match softmax_normaliser(logits) {
        Some((max, total)) => (f64::from(exp(logits[index] - max)) / total) as f32,
        None => f32::NAN,
    }
}

impl<'a, M: LayeredModel, H: DraftHead<M>> Generator<'a, M, H> {
    /// Adds an exit head, enabling [`Mode::Eesd`].
    pub fn with_head<H2: DraftHead<M>>(self, head: &'a H2) -> Generator<'a, M, H2> {
        Generator {
            model: self.model,
            head: Some(head),
            policy: self.policy,
            drafter: self.drafter,
            detokenize: self.detokenize,
        }
    }

    /// Sets the drafter of [`Mode::Tree`]. It lives as long as the generator, so what it learns
    /// (Token Recycling's matrix) carries over from one prompt to the next.
    pub fn with_drafter(mut self, drafter: impl Drafter + 'a) -> Self {
        self.drafter = Some(Box::new(drafter));
        self
    }

    /// The drafter of [`Mode::Tree`], if one is set.
    pub fn drafter(&self) -> Option<&(dyn Drafter + 'a)> {
        self.drafter.as_deref()
    }

    /// Sets the draft-length policy (default: Beta-TS).
    pub fn with_policy(mut self, policy: impl DraftPolicy + 'a) -> Self {
        self.policy = Box::new(policy);
        self
    }

    /// Sets a detokenizer, needed for `stop_strings`.
    pub fn with_detokenizer(mut self, decode: impl Fn(&[u32]) -> String + 'a) -> Self {
        self.detokenize = Some(Box::new(decode));
        self
    }

    /// The draft-length policy, with what it has learned so far.
    pub fn policy(&self) -> &dyn DraftPolicy {
        self.policy.as_ref()
    }

    /// Generates a continuation of `prompt`, calling `on_tokens` with each accepted block.
    ///
    /// Errors on an empty prompt, one that leaves no room in the context, an invalid config, or
    /// EESD without a usable head; stops cleanly with [`StopReason::ContextFull`] when the context
    /// fills up.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        config: &GenerationConfig,
        on_tokens: impl FnMut(&[u32]) -> ControlFlow<()>,
    ) -> Result<GenerationOutput> {
        config.validate()?;
        let context = self.model.context_length();
        if prompt.is_empty() {
            return Err(CoreError::InvalidConfig("empty prompt".into()));
        }
        if prompt.len() >= context {
            return Err(CoreError::PromptTooLong {
                prompt: prompt.len(),
                context,
            });
        }
        let vocab = self.model.vocab_size();
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(CoreError::InvalidConfig(format!(
                "prompt token {t} is outside the vocabulary of {vocab}"
            )));
        }
        // Taken out for the call so the loops can borrow `self` mutably (the policy learns).
        let detokenize = self.detokenize.take();
        let result = self.run(prompt, config, detokenize.as_deref(), on_tokens);
        self.detokenize = detokenize;
        result
    }

    fn run(
        &mut self,
        prompt: &[u32],
        config: &GenerationConfig,
        detokenize: Option<&Detokenizer<'_>>,
        on_tokens: impl FnMut(&[u32]) -> ControlFlow<()>,
    ) -> Result<GenerationOutput> {
        let emitter = Emitter::new(config, detokenize, on_tokens)?;
        let start = Instant::now();
        let mut stats = GenerationStats {
            mode: config.mode,
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let (tokens, stop_reason) = match config.mode {
            Mode::Ar => self.run_ar(prompt, config, emitter, &mut stats)?,
            Mode::Eesd => {
                let head = self
                    .head
                    .ok_or_else(|| CoreError::InvalidConfig("EESD needs an exit head".into()))?;
                let exit = match (config.exit_layer, head.exit_layer()) {
                    (Some(n), Some(h)) if n != h => {
                        return Err(CoreError::InvalidConfig(format!(
                            "exit layer {n} requested, but the head was trained for layer {h}"
                        )));
                    }
                    (Some(n), _) | (None, Some(n)) => n,
                    (None, None) => {
                        return Err(CoreError::InvalidConfig("EESD needs an exit layer".into()));
                    }
                };
                let layers = self.model.num_layers();
                if exit == 0 || exit >= layers {
                    return Err(CoreError::InvalidConfig(format!(
                        "exit layer {exit} must be in 1..{layers}"
                    )));
                }
                stats.policy = Some(self.policy.name());
                self.run_eesd(head, exit, prompt, config, emitter, &mut stats)?
            }
            Mode::Tree => {
                let drafter = self.drafter.as_deref_mut().ok_or_else(|| {
                    CoreError::InvalidConfig("tree speculation needs a drafter".into())
                })?;
                stats.policy = Some(drafter.name());
                run_tree(self.model, drafter, prompt, config, emitter, &mut stats)?
            }
        };
        stats.new_tokens = tokens.len();
        stats.finish(start.elapsed().as_secs_f64());
        Ok(GenerationOutput {
            tokens,
            stop_reason,
            stats,
        })
    }

    fn run_ar<F: FnMut(&[u32]) -> ControlFlow<()>>(
        &mut self,
        prompt: &[u32],
        config: &GenerationConfig,
        mut out: Emitter<'_, F>,
        stats: &mut GenerationStats,
    ) -> Result<(Vec<u32>, StopReason)> {
        let m = self.model;
        let layers = m.num_layers();
        let context = m.context_length();
        let mut sampler = Sampler::new(config.seed);
        let mut cache = m.new_cache();
        let mut input = prompt.to_vec();
        let start = Instant::now();
        let reason = loop {
            if out.remaining() == 0 {
                break StopReason::MaxTokens;
            }
            if m.cached_len(&cache, 0) + input.len() > context {
                break StopReason::ContextFull;
            }
            let t0 = Instant::now();
            let h = forward_tokens(m, &input, 0..layers, &mut cache)?;
            let last = h.narrow(0, input.len() - 1, 1);
            let logits = host(m.logits(last))?;
            let next = sampler.sample(&logits, &config.sampling);
            if stats.rounds == 0 {
                stats.prefill_seconds = start.elapsed().as_secs_f64();
            } else {
                stats.verify_seconds += t0.elapsed().as_secs_f64();
            }
            stats.record_round(0, 0);
            if let Some(reason) = out.emit(&[next]) {
                break reason;
            }
            input = vec![next];
        };
        Ok((out.tokens, reason))
    }

    #[allow(clippy::too_many_arguments)]
    fn run_eesd<F: FnMut(&[u32]) -> ControlFlow<()>>(
        &mut self,
        head: &H,
        exit: usize,
        prompt: &[u32],
        config: &GenerationConfig,
        mut out: Emitter<'_, F>,
        stats: &mut GenerationStats,
    ) -> Result<(Vec<u32>, StopReason)> {
        let m = self.model;
        let (lower, upper) = (0..exit, exit..m.num_layers());
        let context = m.context_length();
        let params = config.sampling;
        let mut sampler = Sampler::new(config.seed);
        let mut cache = m.new_cache();
        let mut head_cache = head.new_cache(m);

        // Prefill every prompt token but the last; the last one starts the first round. The head
        // only needs its cache filled (its logits for prompt positions are never used).
        let start = Instant::now();
        let p = prompt.len();
        // Layer-N states of committed positions the head has not seen yet (the prompt, plain AR
        // rounds, the last draft of a fully accepted round); fed to it in one block when it next
        // drafts, so an attention head's cache never has gaps.
        let mut pending_head: Vec<Tensor<2>> = Vec::new();
        head.observe_tokens(m, &mut head_cache, 0, prompt)
            .map_err(model_err)?;
        if p > 1 {
            let h = forward_tokens(m, &prompt[..p - 1], lower.clone(), &mut cache)?;
            pending_head.push(h.clone());
            m.forward_layers(h, upper.clone(), &mut cache)
                .map_err(model_err)?;
        }
        stats.prefill_seconds = start.elapsed().as_secs_f64();

        let mut t0 = prompt[p - 1];
        let reason = loop {
            // Committed length: the prompt plus what was emitted; t0 is its last token.
            let committed = p + out.tokens.len();
            if out.remaining() == 0 {
                break StopReason::MaxTokens;
            }
            if committed > context {
                break StopReason::ContextFull;
            }
            let cap = self
                .policy
                .max_draft()
                .min(out.remaining() - 1)
                .min(context - committed);

            // Draft: layers [0, N) and the head, one token at a time, while the policy says so.
            let draft_start = Instant::now();
            let h0 = forward_tokens(m, &[t0], lower.clone(), &mut cache)?;
            let mut hidden = vec![h0.clone()];
            let mut drafts: Vec<u32> = Vec::new();
            let mut draft_probs: Vec<Vec<f32>> = Vec::new();
            let mut confidences = Vec::new();
            if cap > 0 && self.policy.begin_round() == Decision::Continue {
                if !pending_head.is_empty() {
                    let rows = Tensor::cat(std::mem::take(&mut pending_head), 0);
                    head.extend(m, rows, &mut head_cache).map_err(model_err)?;
                }
                let mut head_input = h0;
                loop {
                    let draft = head
                        .draft_logits(m, head_input, &mut head_cache)
                        .map_err(model_err)?;
                    let logits = host(draft.logits)?;
                    let (token, q, confidence) = choose_draft(
                        &logits,
                        draft.token_ids.as_deref(),
                        &params,
                        m.vocab_size(),
                        &mut sampler,
                    )?;
                    drafts.push(token);
                    confidences.push(confidence);
                    if let Some(q) = q {
                        draft_probs.push(q);
                    }
                    let step = DraftStep {
                        position: drafts.len() - 1,
                        confidence,
                        entropy: None,
                    };
                    let decision = self.policy.decide(&step);
                    if decision == Decision::Discard {
                        // Dropped before paying for its layer-[0, N) pass and verification.
                        drafts.pop();
                        confidences.pop();
                        draft_probs.truncate(drafts.len());
                        stats.discarded += 1;
                        break;
                    }
                    let go_on = drafts.len() < cap && decision == Decision::Continue;
                    // The block to verify needs the layer-N state of every drafted token.
                    let h = forward_tokens(m, &[token], lower.clone(), &mut cache)?;
                    hidden.push(h.clone());
                    if !go_on {
                        break;
                    }
                    head_input = h;
                }
            }
            let draft_seconds = draft_start.elapsed().as_secs_f64();

            // Verify: layers [N, L) over the whole block at once, then the LM head.
            let verify_start = Instant::now();
            let k = drafts.len();
            let block = Tensor::cat(hidden.clone(), 0);
            let top = m
                .forward_layers(block, upper.clone(), &mut cache)
                .map_err(model_err)?;
            let logits = host(m.logits(top))?;
            let target = rows(&logits, m.vocab_size());
            let Verdict { accepted, next } = if params.is_greedy() {
                accept_greedy(&drafts, &target)
            } else {
                let p: Vec<Vec<f32>> = target.iter().map(|row| params.distribution(row)).collect();
                accept_sampling(&drafts, &draft_probs, &p, &mut sampler)
            };
            let verify_seconds = verify_start.elapsed().as_secs_f64();
            stats.draft_seconds += draft_seconds;
            stats.verify_seconds += verify_seconds;
            stats.record_round(k, accepted);

            // Roll back: keep t0 and the accepted drafts in every cache.
            let keep = committed + accepted;
            m.truncate(&mut cache, lower.clone(), keep);
            m.truncate(&mut cache, upper.clone(), keep);
            // The head must cover exactly the kept positions: cut what it saw beyond them, queue
            // the kept states it has not seen (t0 after a plain step, the last draft of a fully
            // accepted round). hidden[i] is position committed - 1 + i.
            let pending_rows: usize = pending_head.iter().map(|h| h.dims()[0]).sum();
            let covered = head.cached_len(&head_cache) + pending_rows;
            if covered > keep {
                head.truncate(&mut head_cache, keep);
            } else {
                let unseen = &hidden[covered + 1 - committed..keep + 1 - committed];
                pending_head.extend(unseen.iter().cloned());
            }
            let cost_ratio = (k > 0).then(|| (draft_seconds / k as f64) / verify_seconds.max(1e-9));
            self.policy.observe(&RoundOutcome {
                drafted: k,
                accepted,
                confidences,
                cost_ratio,
            });

            let mut block: Vec<u32> = drafts[..accepted].to_vec();
            block.push(next);
            head.observe_tokens(m, &mut head_cache, committed, &block)
                .map_err(model_err)?;
            if let Some(reason) = out.emit(&block) {
                break reason;
            }
            t0 = next;
        };
        Ok((out.tokens, reason))
    }
}

/// Prompt rows whose target candidates a drafter observes at prefill (the last ones): the LM
/// head and top-k over a long prompt cost more than they teach. Measured on Spec-Bench (native
/// weights, 13 questions): all rows of RAG and summarisation prompts cost ≈ 0.1 s per
/// question; 128 rows ≈ 10 ms per question, 3–5% of a tree method's time, for the same tokens
/// per round as 32 rows.
const PREFILL_OBSERVED_ROWS: usize = 32;

/// Tree speculation: each round the drafter proposes a tree after the last committed token
/// (the root), the whole model verifies root and tree in one pass with tree attention, the
/// accepted path stays in the cache and the drafter observes every verified row.
fn run_tree<M: LayeredModel, F: FnMut(&[u32]) -> ControlFlow<()>>(
    m: &M,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    config: &GenerationConfig,
    mut out: Emitter<'_, F>,
    stats: &mut GenerationStats,
) -> Result<(Vec<u32>, StopReason)> {
    let all = 0..m.num_layers();
    let (limit, vocab) = (m.context_length(), m.vocab_size());
    let params = config.sampling;
    let wanted = drafter.candidates_wanted();
    let mut sampler = Sampler::new(config.seed);
    let mut cache = m.new_cache();
    let start = Instant::now();
    let p = prompt.len();
    // A drafter that reads hidden states (a lookahead head) gets every committed position's
    // states after its layers: verification runs the layers up to each of them, then the
    // rest, as consecutive passes.
    let feature = drafter.feature_layers();
    check_feature_layers(&feature, all.end)
        .map_err(|e| CoreError::InvalidConfig(format!("drafter {} reads {e}", drafter.name())))?;
    let split = feature.last().copied().unwrap_or(all.end);
    if p > 1 {
        let x = m.embed(&prompt[..p - 1]).map_err(model_err)?;
        let (states, features) = forward_features(m, x, &feature, split, &mut cache, None)?;
        if let Some(features) = features {
            drafter.features(0, features, &prompt[1..])?;
        }
        let h = rest_of_layers(m, states, split, &mut cache, None)?;
        if wanted > 0 {
            // What the target expects after the last prompt tokens seeds the drafter.
            let seen = (p - 1).min(PREFILL_OBSERVED_ROWS);
            let logits = host(m.logits(h.narrow(0, p - 1 - seen, seen)))?;
            let logits = rows(&logits, vocab);
            for (&token, row) in prompt[p - 1 - seen..].iter().zip(&logits) {
                observe_row(drafter, token, row, &top_k(row, wanted));
            }
        }
    }
    stats.prefill_seconds = start.elapsed().as_secs_f64();

    let mut context = prompt.to_vec();
    let reason = loop {
        // The root (the last committed token) is not cached yet: it is row 0 of the block.
        let first = context.len() - 1;
        if out.remaining() == 0 {
            break StopReason::MaxTokens;
        }
        if first >= limit {
            break StopReason::ContextFull;
        }
        let draft_start = Instant::now();
        let budget = config.tree_budget.min(limit - first - 1);
        let mut tree = DraftTree::new();
        tree.merge(&drafter.propose(&context, budget), budget);
        // Nodes deeper than the tokens still allowed could never be emitted.
        if tree.max_depth() >= out.remaining() {
            tree = tree.limit_depth(out.remaining() - 1);
        }
        if let Some(&t) = tree.tokens().iter().find(|&&t| t as usize >= vocab) {
            return Err(CoreError::InvalidConfig(format!(
                "drafter {} proposed token {t} outside the vocabulary of {vocab}",
                drafter.name()
            )));
        }
        let draft_seconds = draft_start.elapsed().as_secs_f64();

        let verify_start = Instant::now();
        let mut tokens = vec![context[first]];
        tokens.extend_from_slice(tree.tokens());
        let mask = tree.mask();
        let x = m.embed(&tokens).map_err(model_err)?;
        let (states, features) = forward_features(m, x, &feature, split, &mut cache, Some(&mask))?;
        let h = rest_of_layers(m, states, split, &mut cache, Some(&mask))?;
        let logits = host(m.logits(h))?;
        let target = rows(&logits, vocab);
        // Sampling draws as AR does (`Sampler::draw` is `Sampler::sample`), keeping each drawn
        // row's distribution for the drafter.
        let mut drawn: (Vec<usize>, Vec<Vec<f32>>) = (Vec::new(), Vec::new());
        let verdict = match params.is_greedy() {
            true => accept_tree(&tree, |row| argmax(target[row]) as u32),
            false => accept_tree(&tree, |row| {
                let (token, distribution) = sampler.draw(target[row], &params);
                drawn.0.push(row);
                drawn.1.push(distribution);
                token
            }),
        };
        let kept: Vec<usize> = std::iter::once(0)
            .chain(verdict.path.iter().map(|n| n + 1))
            .collect();
        m.keep_rows(&mut cache, all.clone(), first, &kept)
            .map_err(model_err)?;
        let verify_seconds = verify_start.elapsed().as_secs_f64();

        let observe_start = Instant::now();
        // One ranking per row serves both: its first token is the target's choice.
        let ranked: Vec<Vec<u32>> = target.iter().map(|row| top_k(row, wanted.max(1))).collect();
        let best: Vec<u32> = ranked
            .iter()
            .zip(&target)
            .map(|(ids, row)| ids.first().copied().unwrap_or_else(|| argmax(row) as u32))
            .collect();
        if !drawn.0.is_empty() {
            drafter.drawn(&tree, &drawn.0, &drawn.1);
        }
        drafter.verified(&tree, &best);
        if wanted > 0 {
            for ((&token, row), ids) in tokens.iter().zip(&target).zip(&ranked) {
                observe_row(drafter, token, row, ids);
            }
        }
        let mut block: Vec<u32> = verdict.path.iter().map(|&n| tree.tokens()[n]).collect();
        block.push(verdict.next);
        if let Some(features) = features.filter(|_| out.remaining() > block.len()) {
            // The kept rows' states, each with the token now following it (a drafting cost:
            // counted in the round's draft time and in its time for `RoundCost`).
            let kept_states = kept.iter().map(|&r| features.clone().narrow(0, r, 1));
            drafter.features(first, Tensor::cat(kept_states.collect(), 0), &block)?;
        }
        stats.draft_seconds += draft_seconds + observe_start.elapsed().as_secs_f64();
        stats.verify_seconds += verify_seconds;
        stats.record_round(tree.len(), verdict.path.len());
        drafter.emitted(block.len());
        drafter.round_time(tree.len() + 1, draft_start.elapsed().as_secs_f64());

        if let Some(reason) = out.emit(&block) {
            break reason;
        }
        context.extend_from_slice(&block);
    };
    Ok((out.tokens, reason))
}

/// Shows the drafter the target's best next tokens `ids` (from `row`, with their logits) after
/// `token`.
fn observe_row(drafter: &mut dyn Drafter, token: u32, row: &[f32], ids: &[u32]) {
    let logits: Vec<f32> = ids.iter().map(|&t| row[t as usize]).collect();
    drafter.observe(token, ids, &logits);
}

/// Layers `[split, L)` on `states` (the output of layer `split`; unchanged when `split` is the
/// last layer), as a tree block when `mask` is given.
fn rest_of_layers<M: LayeredModel>(
    m: &M,
    states: Tensor<2>,
    split: usize,
    cache: &mut M::Cache,
    mask: Option<&TreeMask>,
) -> Result<Tensor<2>> {
    let layers = split..m.num_layers();
    if layers.is_empty() {
        return Ok(states);
    }
    match mask {
        Some(mask) => m.forward_tree(states, layers, cache, mask),
        None => m.forward_layers(states, layers, cache),
    }
    .map_err(model_err)
}

/// Refuses feature layers that are not ascending within `1..=layers` (`Err` names them).
pub(crate) fn check_feature_layers(
    features: &[usize],
    layers: usize,
) -> std::result::Result<(), String> {
    let ascending = features.windows(2).all(|w| w[0] < w[1]);
    match features.iter().all(|&n| (1..=layers).contains(&n)) && ascending {
        true => Ok(()),
        false => Err(format!(
            "layers {features:?} (ascending, each in 1..={layers}) of a model of {layers} layers"
        )),
    }
}

/// `x` through layers `[0, split)` in consecutive passes that end at each of `features`
/// (ascending, the last `split` when any), as a tree block when `mask` is given: the output of
/// layer `split`, and the feature layers' outputs side by side `[rows, k·hidden]` (`None`
/// without feature layers). Passes split anywhere compute what one pass does, bit for bit.
pub(crate) fn forward_features<M: LayeredModel>(
    m: &M,
    mut x: Tensor<2>,
    features: &[usize],
    split: usize,
    cache: &mut M::Cache,
    mask: Option<&TreeMask>,
) -> Result<(Tensor<2>, Option<Tensor<2>>)> {
    let mut pass = |x: Tensor<2>, layers: std::ops::Range<usize>| {
        match mask {
            Some(mask) => m.forward_tree(x, layers, cache, mask),
            None => m.forward_layers(x, layers, cache),
        }
        .map_err(model_err)
    };
    let (mut done, mut kept) = (0, Vec::with_capacity(features.len()));
    for &n in features {
        x = pass(x, done..n)?;
        kept.push(x.clone());
        done = n;
    }
    if split > done {
        x = pass(x, done..split)?;
    }
    let features = match kept.len() {
        0 => None,
        1 => kept.pop(),
        _ => Some(Tensor::cat(kept, 1)),
    };
    Ok((x, features))
}

/// Token ids through `layers`: their hidden states after the last of them, with those layers'
/// caches advanced.
fn forward_tokens<M: LayeredModel>(
    m: &M,
    tokens: &[u32],
    layers: std::ops::Range<usize>,
    cache: &mut M::Cache,
) -> Result<Tensor<2>> {
    m.forward_layers(m.embed(tokens).map_err(model_err)?, layers, cache)
        .map_err(model_err)
}

/// Picks the draft token from head logits (over the full vocabulary or a subset); returns the
/// token, its full-vocabulary draft distribution (sampling only) and its confidence. A head whose
/// logits and token ids disagree, or that names tokens outside the vocabulary, is an error.
fn choose_draft(
    logits: &[f32],
    token_ids: Option<&Vec<u32>>,
    params: &SamplingParams,
    vocab: usize,
    sampler: &mut Sampler,
) -> Result<(u32, Option<Vec<f32>>, f32)> {
    let width = token_ids.map_or(vocab, Vec::len);
    let out_of_range = token_ids.is_some_and(|ids| ids.iter().any(|&t| t as usize >= vocab));
    if logits.len() != width || logits.is_empty() || out_of_range {
        return Err(CoreError::InvalidConfig(format!(
            "exit head returned {} logits for {width} token ids (vocabulary {vocab})",
            logits.len()
        )));
    }
    let to_token = |i: usize| token_ids.map_or(i as u32, |ids| ids[i]);
    if params.is_greedy() {
        let i = argmax(logits);
        return Ok((to_token(i), None, softmax_at(logits, i)));
    }
    let local = params.distribution(logits);
    let i = sampler.categorical(&local);
    let mut q = vec![0f32; vocab];
    for (j, &pj) in local.iter().enumerate() {
        q[to_token(j) as usize] += pj;
    }
    Ok((to_token(i), Some(q), softmax_at(logits, i)))
}
