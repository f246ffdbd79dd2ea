//! Tree speculation on tiny random LLaMA models (fast): greedy output equals AR for every
//! drafter and for adversarial trees (deep, wide, accepted paths on any branch); sampling keeps
//! the AR distribution; the cache after a round holds only the accepted path; context limits
//! and stop tokens end generation as in AR.

mod common;

use std::ops::ControlFlow;

use common::{
    assert_rows_match, assert_same_distribution, on_flex, sampled_histogram, tiny, tiny_quantized,
};
use eesd_core::drafters::{DrafterSpec, HeadDrafter};
use eesd_core::{
    DraftTree, Drafter, GenerationConfig, GenerationOutput, Generator, LayeredModel, Mode,
    SamplingParams, StopReason,
};
use eesd_models::{HeadKind, LayerHead, Llama};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const PROMPT: [u32; 6] = [257, 72, 101, 108, 108, 111];

/// Random trees that hide the true continuation (when known) on a random branch, sometimes
/// with a wrong token part-way: accepted paths of every length, on every row order.
struct Adversary {
    truth: Vec<u32>,
    vocab: u32,
    rng: StdRng,
}

impl Drafter for Adversary {
    fn name(&self) -> String {
        "adversary".into()
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut tree = DraftTree::new();
        let n = context.len();
        let truth: Vec<u32> = self.truth.get(n..).unwrap_or(&[]).to_vec();
        let depth = self.rng.random_range(0..=6usize);
        let mut nodes: Vec<Option<usize>> = vec![None];
        while tree.len() < budget {
            // A random sibling somewhere, then (once) the true path under the root.
            let parent = nodes[self.rng.random_range(0..nodes.len())];
            let node = tree.push(self.rng.random_range(0..self.vocab), parent);
            nodes.push(Some(node));
            if tree.len() == budget / 2 {
                let mut at = None;
                for (i, &t) in truth.iter().take(depth).enumerate() {
                    let t = if i == 3 && self.rng.random_bool(0.3) {
                        (t + 1) % self.vocab
                    } else {
                        t
                    };
                    if tree.len() >= budget {
                        break;
                    }
                    at = Some(tree.push(t, at));
                    nodes.push(at);
                }
            }
        }
        tree
    }
}

fn generate<'a>(
    model: &'a Llama,
    drafter: Option<Box<dyn Drafter + 'a>>,
    prompt: &[u32],
    config: &GenerationConfig,
) -> GenerationOutput {
    let mut g = Generator::new(model);
    if let Some(d) = drafter {
        g = g.with_drafter(d);
    }
    g.generate(prompt, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn greedy_tree_speculation_equals_ar_for_every_drafter() {
    // Seeds 0..3 with f32 weights, 3..5 with Q4_1/Q8_0 weights run natively.
    for seed in 0..5 {
        let model = match seed {
            0..3 => tiny(seed),
            _ => tiny_quantized(seed),
        };
        let vocab = model.config().vocab_size;
        let ar_config = GenerationConfig {
            max_new_tokens: 40,
            ..Default::default()
        };
        let ar = generate(&model, None, &PROMPT, &ar_config);
        let truth: Vec<u32> = PROMPT.iter().chain(&ar.tokens).copied().collect();
        for budget in [1, 4, 16, 40] {
            let config = GenerationConfig {
                mode: Mode::Tree,
                tree_budget: budget,
                ..ar_config.clone()
            };
            // `opt:auto` sizes its trees by the rounds' times; `ts:` picks a drafter a round.
            let specs = ["recycle@B", "lookup@B", "fused@B", "opt@B", "opt@B:auto"];
            let choice = "ts:opt@B:auto|lookup@B|fused@B".to_string();
            let mut drafters: Vec<Box<dyn Drafter>> = specs
                .iter()
                .map(|s| s.to_string())
                .chain([choice])
                .map(|s| {
                    let spec: DrafterSpec = s.replace('B', &budget.to_string()).parse().unwrap();
                    spec.build(vocab) as Box<dyn Drafter>
                })
                .collect();
            drafters.push(Box::new(Adversary {
                truth: truth.clone(),
                vocab: vocab as u32,
                rng: StdRng::seed_from_u64(seed * 100 + budget as u64),
            }));
            for d in drafters {
                let name = d.name();
                let out = generate(&model, Some(d), &PROMPT, &config);
                assert_eq!(out.tokens, ar.tokens, "seed {seed}, {name}@{budget}");
                if name == "adversary" && budget >= 16 {
                    assert!(out.stats.accepted > 10, "{:?}", out.stats);
                }
            }
        }
    }
}

#[test]
fn after_a_round_the_cache_holds_only_the_accepted_path() {
    let model = tiny(4);
    // Verify a tree by hand, keep one path, and compare the next logits with AR over that path.
    let mut tree = DraftTree::new();
    let a = tree.push(50, None);
    tree.push(60, None);
    let b = tree.push(51, Some(a));
    tree.push(61, Some(a));
    tree.push(52, Some(b));
    let mask = tree.mask();
    let mut cache = model.new_cache();
    model.forward(&PROMPT[..5], &mut cache).unwrap();
    let rows: Vec<u32> = std::iter::once(PROMPT[5])
        .chain(tree.tokens().iter().copied())
        .collect();
    let all = 0..model.num_layers();
    let tree_logits = to_rows(
        model.logits(
            model
                .forward_tree(model.embed(&rows).unwrap(), all.clone(), &mut cache, &mask)
                .unwrap(),
        ),
    );
    // Keep root → 50 → 51 (rows 0, 1, 3).
    LayeredModel::keep_rows(&model, &mut cache, all, 5, &[0, 1, 3]).unwrap();
    assert_eq!(cache.len_of(0), 8);
    let next = to_rows(model.forward(&[77], &mut cache).unwrap());
    let mut plain = model.new_cache();
    let path = [PROMPT.as_slice(), &[50, 51, 77]].concat();
    let want = to_rows(model.forward(&path, &mut plain).unwrap());
    assert_rows_match(&next[0], &want[8], "logits after the kept path");
    // Each tree row saw exactly its path: row 3 (51 after 50) equals AR's position 7.
    assert_rows_match(&tree_logits[3], &want[7], "tree row 3");
    let want5 = {
        let mut c = model.new_cache();
        let p = [PROMPT.as_slice(), &[50, 51, 52]].concat();
        to_rows(model.forward(&p, &mut c).unwrap())[8].clone()
    };
    assert_rows_match(&tree_logits[5], &want5, "tree row 5");
    // Bad keeps are errors, not panics.
    assert!(LayeredModel::keep_rows(&model, &mut cache, 0..1, 5, &[2, 1]).is_err());
    assert!(LayeredModel::keep_rows(&model, &mut cache, 0..1, 5, &[0, 99]).is_err());
}

fn to_rows(t: burn::tensor::Tensor<2>) -> Vec<Vec<f32>> {
    let [_, n] = t.dims();
    let v = t
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    v.chunks(n).map(<[f32]>::to_vec).collect()
}

/// Counts of the tokens at `position` over many seeded generations, by AR or with a drafter.
fn histogram(model: &Llama, drafter: Option<&str>, position: usize, runs: u64) -> Vec<usize> {
    let vocab = model.config().vocab_size;
    let mut g = Generator::new(model);
    if let Some(spec) = drafter {
        g = g.with_drafter(spec.parse::<DrafterSpec>().unwrap().build(vocab));
    }
    let base = GenerationConfig {
        mode: if drafter.is_some() {
            Mode::Tree
        } else {
            Mode::Ar
        },
        tree_budget: 12,
        ..Default::default()
    };
    let salt = drafter.is_some() as u64;
    sampled_histogram(&mut g, &PROMPT, &base, vocab, position, runs, salt)
}

#[test]
fn tree_sampling_has_the_ar_distribution() {
    // Token Recycling learns the model's top candidates, so its trees (several siblings per
    // node, overlapping the sampled support) are accepted often and the walk is exercised.
    let model = tiny(5);
    for position in [0, 2] {
        let ar = histogram(&model, None, position, 3000);
        for spec in [
            "recycle@12",
            "fused@12",
            "opt@12",
            "opt@12:auto",
            "ts:opt@12:auto|recycle@12",
        ] {
            let tree = histogram(&model, Some(spec), position, 3000);
            assert_same_distribution(&ar, &tree, &format!("token {position}, {spec}"));
        }
    }
}

#[test]
fn context_limits_and_stop_tokens_end_tree_generation_as_in_ar() {
    let model = tiny(6);
    let context = model.config().context_length;
    let vocab = model.config().vocab_size;
    let recycle = || "recycle@16".parse::<DrafterSpec>().unwrap().build(vocab) as Box<dyn Drafter>;
    let prompt = vec![66u32; context - 10];
    let config = |mode| GenerationConfig {
        mode,
        max_new_tokens: 500,
        ..Default::default()
    };
    let ar = generate(&model, None, &prompt, &config(Mode::Ar));
    let tree = generate(&model, Some(recycle()), &prompt, &config(Mode::Tree));
    assert_eq!(ar.stop_reason, StopReason::ContextFull);
    assert_eq!(tree.stop_reason, StopReason::ContextFull);
    assert_eq!(tree.tokens, ar.tokens);

    let base = GenerationConfig {
        max_new_tokens: 30,
        ..Default::default()
    };
    let ar = generate(&model, None, &PROMPT, &base);
    let stop = ar.tokens[9];
    let first = ar.tokens.iter().position(|&t| t == stop).unwrap();
    let config = GenerationConfig {
        mode: Mode::Tree,
        stop_tokens: vec![stop],
        ..base.clone()
    };
    let out = generate(&model, Some(recycle()), &PROMPT, &config);
    assert_eq!(out.tokens, ar.tokens[..=first]);
    assert_eq!(out.stop_reason, StopReason::StopToken);
    // Without a drafter, tree mode is a configuration error.
    let mut g = Generator::new(&model);
    assert!(
        g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .is_err()
    );
}

/// A random lookahead head of `model` reading layer `n` (any head serves: only drafts change)
/// and the layers `mix` before it, whose columns of the fusion are random too (so that they
/// move the drafts).
fn lookahead_head(model: &Llama, n: usize, mix: &[usize]) -> LayerHead {
    let init = n.min(model.num_layers() - 1);
    let head = LayerHead::from_model(model, HeadKind::Lookahead, n, init, None)
        .unwrap()
        .with_mix_layers(model, mix)
        .unwrap();
    if mix.is_empty() {
        return head;
    }
    let mut weights = head.into_weights();
    let fuse = weights.fuse.take().unwrap().val();
    let noise = fuse.random_like(burn::tensor::Distribution::Normal(0.0, 0.05));
    weights.fuse = Some(burn::module::Param::from_tensor(fuse + noise));
    LayerHead::from_weights(model, n, weights, None).unwrap()
}

/// Lookahead heads in trees, at a middle and at the last layer, drafting one level or three,
/// weighed into the adaptive tree (which takes suggestions) or merged ahead of recycling's tree
/// (which ignores them): greedy output equals AR, with f32 and native weights, up to the
/// context's end.
#[test]
fn greedy_trees_with_a_lookahead_head_equal_ar() {
    for seed in [0, 3] {
        let model = match seed {
            0 => tiny(seed),
            _ => tiny_quantized(seed),
        };
        let (vocab, layers) = (model.config().vocab_size, model.num_layers());
        let ar_config = GenerationConfig {
            max_new_tokens: 40,
            ..Default::default()
        };
        let ar = generate(&model, None, &PROMPT, &ar_config);
        for (n, mix) in [(1, vec![]), (layers, vec![]), (layers, vec![1, layers - 1])] {
            let head = lookahead_head(&model, n, &mix);
            for budget in [1, 4, 16] {
                let config = GenerationConfig {
                    mode: Mode::Tree,
                    tree_budget: budget,
                    ..ar_config.clone()
                };
                for (inner, levels) in [("opt", 1), ("opt", 3), ("recycle", 1), ("recycle", 3)] {
                    let spec: DrafterSpec = format!("{inner}@{budget}").parse().unwrap();
                    let d = HeadDrafter::new(&model, &head, spec.build(vocab)).with_levels(levels);
                    let out = generate(&model, Some(Box::new(d)), &PROMPT, &config);
                    assert_eq!(
                        out.tokens, ar.tokens,
                        "seed {seed}, layer {n} mixing {mix:?}, {inner}@{budget}, {levels} levels"
                    );
                }
            }
        }
        // The context's end stops both alike.
        let context = model.config().context_length;
        let prompt = vec![66u32; context - 10];
        let long = GenerationConfig {
            max_new_tokens: 500,
            ..Default::default()
        };
        let ar = generate(&model, None, &prompt, &long);
        let head = lookahead_head(&model, layers, &[2]);
        let d = HeadDrafter::new(
            &model,
            &head,
            "opt@16".parse::<DrafterSpec>().unwrap().build(vocab),
        )
        .with_levels(3);
        let tree = GenerationConfig {
            mode: Mode::Tree,
            tree_budget: 16,
            ..long
        };
        let out = generate(&model, Some(Box::new(d)), &prompt, &tree);
        assert_eq!(out.stop_reason, StopReason::ContextFull);
        assert_eq!(out.tokens, ar.tokens);
    }
}

/// States (as host rows) and next tokens shown to a drafter, in order.
type Shown = std::rc::Rc<std::cell::RefCell<(Vec<Vec<f32>>, Vec<u32>)>>;

/// Each sampled round's draws, as a drafter is shown them: the tree, the rows drawn from and
/// their distributions.
type Draws = std::rc::Rc<std::cell::RefCell<Vec<(DraftTree, Vec<usize>, Vec<Vec<f32>>)>>>;

/// A drafter that records the states ([`Drafter::features`]) and the draws
/// ([`Drafter::drawn`]) it was shown.
struct Recorder<D> {
    inner: D,
    seen: Shown,
    draws: Draws,
}

impl<D: Drafter> Drafter for Recorder<D> {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        self.inner.propose(context, budget)
    }
    fn candidates_wanted(&self) -> usize {
        self.inner.candidates_wanted()
    }
    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        self.inner.observe(token, candidates, logits)
    }
    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        self.inner.verified(tree, best)
    }
    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        let round = (tree.clone(), rows.to_vec(), distributions.to_vec());
        self.draws.borrow_mut().push(round);
        self.inner.drawn(tree, rows, distributions)
    }
    fn feature_layers(&self) -> Vec<usize> {
        self.inner.feature_layers()
    }
    fn features(
        &mut self,
        position: usize,
        hidden: burn::tensor::Tensor<2>,
        next: &[u32],
    ) -> eesd_core::Result<()> {
        let mut seen = self.seen.borrow_mut();
        assert_eq!(position, seen.1.len(), "positions in order, none skipped");
        seen.0.extend(to_rows(hidden.clone()));
        seen.1.extend_from_slice(next);
        drop(seen);
        self.inner.features(position, hidden, next)
    }
}

/// The tree loop shows a lookahead head every committed position once, in order, with the
/// state a plain forward pass gives it (bit for bit: the kernels are batch-invariant) and the
/// token that follows it; so the head's cache is what teacher forcing would build.
#[test]
fn a_lookahead_head_sees_every_committed_position_once_in_order() {
    let model = tiny_quantized(4);
    let (vocab, layers) = (model.config().vocab_size, model.num_layers());
    for (n, mix) in [(1, vec![]), (layers, vec![]), (layers, vec![1, 2])] {
        let head = lookahead_head(&model, n, &mix);
        let seen = std::rc::Rc::default();
        let recorder = Recorder {
            inner: HeadDrafter::new(
                &model,
                &head,
                "opt@8".parse::<DrafterSpec>().unwrap().build(vocab),
            ),
            seen: std::rc::Rc::clone(&seen),
            draws: Draws::default(),
        };
        let config = GenerationConfig {
            mode: Mode::Tree,
            tree_budget: 8,
            max_new_tokens: 30,
            ..Default::default()
        };
        let out = generate(&model, Some(Box::new(recorder)), &PROMPT, &config);
        let sequence: Vec<u32> = PROMPT.iter().chain(&out.tokens).copied().collect();
        let (states, next) = seen.take();
        assert!(next.len() > PROMPT.len(), "{} positions", next.len());
        assert_eq!(next[..], sequence[1..=next.len()], "layer {n}");
        // The states after each layer read, side by side.
        let mut cache = model.new_cache();
        let mut x = model.embed(&sequence[..next.len()]).unwrap();
        let (mut done, mut kept) = (0, Vec::new());
        for &l in mix.iter().chain([&n]) {
            x = model.forward_layers(x, done..l, &mut cache).unwrap();
            kept.push(x.clone());
            done = l;
        }
        let expected = to_rows(burn::tensor::Tensor::cat(kept, 1));
        assert_eq!(states.len(), expected.len(), "layer {n}");
        for (i, (seen, want)) in states.iter().zip(&expected).enumerate() {
            assert_rows_match(seen, want, &format!("layer {n}, position {i}"));
        }
    }
}

/// When sampling, the drafter is shown every draw of a round: the root's row, then the row of
/// each node the draws accepted (a path, each node carrying the token drawn at the row before
/// it, which its distribution allows), each with a distribution over the vocabulary; one draw
/// per emitted token. Greedy rounds show none.
#[test]
fn sampled_rounds_show_the_drafter_each_draw() {
    let model = tiny(5);
    let vocab = model.config().vocab_size;
    for temperature in [0.0, 1.2] {
        let draws = Draws::default();
        let recorder = Recorder {
            inner: "opt@12".parse::<DrafterSpec>().unwrap().build(vocab),
            seen: Shown::default(),
            draws: std::rc::Rc::clone(&draws),
        };
        let config = GenerationConfig {
            mode: Mode::Tree,
            tree_budget: 12,
            max_new_tokens: 40,
            sampling: SamplingParams {
                temperature,
                top_k: 12,
                top_p: 1.0,
            },
            seed: 3,
            ..Default::default()
        };
        let out = generate(&model, Some(Box::new(recorder)), &PROMPT, &config);
        let rounds = draws.take();
        if temperature == 0.0 {
            assert!(rounds.is_empty());
            continue;
        }
        assert_eq!(rounds.len(), out.stats.rounds);
        let (mut total, mut accepted) = (0, 0);
        for (tree, rows, distributions) in &rounds {
            assert_eq!(rows.len(), distributions.len());
            assert_eq!(rows[0], 0, "the root's row first");
            for (i, d) in distributions.iter().enumerate() {
                assert_eq!(d.len(), vocab);
                let sum: f32 = d.iter().sum();
                assert!((sum - 1.0).abs() < 1e-4, "{sum}");
                if let Some(&next) = rows.get(i + 1) {
                    let node = next - 1;
                    let parent = tree.parents()[node].map_or(0, |p| p + 1);
                    assert_eq!(parent, rows[i], "the drawn rows are a path");
                    assert!(d[tree.tokens()[node] as usize] > 0.0);
                }
            }
            total += rows.len();
            accepted += rows.len() - 1;
        }
        assert_eq!(total, out.tokens.len(), "one draw per emitted token");
        assert_eq!(accepted, out.stats.accepted);
        assert!(accepted > 0, "no draft accepted");
    }
}

/// Sampling with a lookahead head's trees keeps the AR distribution.
#[test]
fn tree_sampling_with_a_lookahead_head_has_the_ar_distribution() {
    let model = tiny(5);
    let vocab = model.config().vocab_size;
    let head = lookahead_head(&model, model.num_layers(), &[1]);
    let base = GenerationConfig {
        tree_budget: 12,
        ..Default::default()
    };
    for position in [0, 2] {
        let ar = histogram(&model, None, position, 3000);
        let drafter = HeadDrafter::new(
            &model,
            &head,
            "opt@12".parse::<DrafterSpec>().unwrap().build(vocab),
        );
        let mut g = Generator::new(&model).with_drafter(drafter);
        let tree_config = GenerationConfig {
            mode: Mode::Tree,
            ..base.clone()
        };
        let tree = sampled_histogram(&mut g, &PROMPT, &tree_config, vocab, position, 3000, 1);
        assert_same_distribution(&ar, &tree, &format!("token {position}, opt@12+head"));
    }
}

/// On a dense f32 model a head can draft from Q8_0 copies of its matrices and projection rows
/// (as a native model's heads always do): it then holds the blocks, drafts nearly the dense
/// head's logits, and tree decoding with it stays AR's output.
#[test]
fn a_head_drafting_from_q8_0_copies_keeps_trees_lossless() {
    let model = tiny(0);
    let vocab = model.config().vocab_size;
    let layers = model.num_layers();
    let dense = lookahead_head(&model, layers, &[]);
    assert_eq!(dense.weights().layer.native.bytes(), 0);
    let q8 = lookahead_head(&model, layers, &[])
        .with_q8_0_drafts()
        .unwrap();
    // Other backends keep drafting from the dense weights (documented); trees stay lossless.
    assert_eq!(q8.weights().layer.native.bytes() > 0, on_flex());
    // Same draft, up to Q8_0 rounding, from the same states.
    let mut cache = model.new_cache();
    let h = model
        .forward_layers(model.embed(&PROMPT).unwrap(), 0..layers, &mut cache)
        .unwrap();
    let logits = |head: &LayerHead| -> Vec<f32> {
        let mut hc = eesd_core::LookaheadHead::new_cache(head, &model);
        let draft = eesd_core::LookaheadHead::lookahead(
            head,
            &model,
            h.clone().narrow(0, 0, PROMPT.len() - 1),
            &PROMPT[1..],
            &mut hc,
        )
        .unwrap();
        draft
            .draft
            .logits
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    };
    let (a, b) = (logits(&dense), logits(&q8));
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        (diff > 0.0 || !on_flex()) && diff < 0.05 * scale,
        "diff {diff} of {scale}"
    );
    let ar_config = GenerationConfig {
        max_new_tokens: 40,
        ..Default::default()
    };
    let ar = generate(&model, None, &PROMPT, &ar_config);
    let config = GenerationConfig {
        mode: Mode::Tree,
        tree_budget: 8,
        ..ar_config
    };
    let d = HeadDrafter::new(
        &model,
        &q8,
        "opt@8".parse::<DrafterSpec>().unwrap().build(vocab),
    );
    let out = generate(&model, Some(Box::new(d)), &PROMPT, &config);
    assert_eq!(out.tokens, ar.tokens);
}
