//! Teacher-forced head evaluation predicts real decoding exactly: on the real model, the ranks
//! from `teacher_forced_ranks` replay greedy EESD rounds (fixed draft lengths) with the same
//! accepted counts as the generator measures, and the teacher's argmax is AR's output; with the
//! shipped head too, whose draft vocabulary grows by the tokens each question brings.

mod common;

use std::ops::ControlFlow;

use common::*;
use eesd_bandit::Policy;
use eesd_core::head_eval::{Agreement, Ranks, teacher_forced_ranks};
use eesd_core::{DraftHead, GenerationConfig, Generator, Mode};
use eesd_models::checkpoint::load_layer_head;
use eesd_models::{Llama, NormHead, WeightDType};

/// Accepted-count histogram of greedy EESD drafting `k` tokens per round from the ranks of the
/// positions from the prompt's last one on, for `max_new` new tokens (no stop token).
fn replay(ranks: &[Option<u32>], k: usize, max_new: usize) -> Vec<usize> {
    let (mut q, mut emitted, mut histogram) = (0, 0, Vec::new());
    while emitted < max_new {
        let cap = k.min(max_new - emitted - 1);
        let a = ranks[q..]
            .iter()
            .take(cap)
            .take_while(|r| **r == Some(0))
            .count();
        if histogram.len() <= a {
            histogram.resize(a + 1, 0);
        }
        histogram[a] += 1;
        emitted += a + 1;
        q += a + 1;
    }
    histogram
}

fn eesd<H: DraftHead<Llama>>(
    m: &Llama,
    head: &H,
    exit: usize,
    k: usize,
    prompt: &[u32],
    n: usize,
) -> Vec<usize> {
    let mut g = Generator::new(m)
        .with_head(head)
        .with_policy(Policy::parse(&format!("fixed:{k}"), 1).unwrap());
    let config = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: Some(exit),
        max_new_tokens: n,
        ..Default::default()
    };
    let out = g
        .generate(prompt, &config, |_| ControlFlow::Continue(()))
        .unwrap();
    out.stats.accepted_histogram
}

#[test]
fn teacher_forced_ranks_replay_greedy_eesd() {
    let lm = model();
    let m = &lm.model;
    let n = 40;
    let norm = NormHead::new();
    let random = RandomHead::new(m, 3000, 5);
    let mut hits = Agreement::default();
    for q in spec_bench(3) {
        let prompt = lm.chat_prompt(&q.turns[0]).unwrap();
        let mut ar = Generator::new(m);
        let config = GenerationConfig {
            max_new_tokens: n,
            ..Default::default()
        };
        let out = ar
            .generate(&prompt, &config, |_| ControlFlow::Continue(()))
            .unwrap();
        let p = prompt.len();
        let tokens = [prompt.clone(), out.tokens.clone()].concat();
        // Positions p-1 .. p+n-2 predict the n new tokens.
        let score = p - 1..p + n - 1;
        let ranks: Vec<Ranks> =
            teacher_forced_ranks(m, &[(&norm, 20), (&norm, 8)], &tokens, score.clone()).unwrap();
        let random_ranks = teacher_forced_ranks(m, &[(&random, 12)], &tokens, score).unwrap();
        assert_eq!(ranks[0].len(), n);
        // The head may or may not agree, but the model's greedy token is always ranked by a
        // full-vocabulary head; the random head's subset misses most of them.
        assert!(ranks.iter().flatten().all(Option::is_some));
        assert!(random_ranks[0].iter().any(Option::is_none));
        for (k, (head_ranks, exit)) in [1, 3].into_iter().zip([(&ranks[0], 20), (&ranks[1], 8)]) {
            assert_eq!(
                replay(head_ranks, k, n),
                eesd(m, &norm, exit, k, &prompt, n),
                "question {}, norm head at layer {exit}, fixed:{k}",
                q.question_id
            );
        }
        assert_eq!(
            replay(&random_ranks[0], 2, n),
            eesd(m, &random, 12, 2, &prompt, n),
            "question {}, random head",
            q.question_id
        );
        hits.push(ranks[0].clone());
    }
    // The logit lens at layer 20 agrees now and then (≈ 20% on this model): the check above
    // replayed accepted drafts, not only rejections.
    assert!(hits.top_k(1) > 0.05, "{}", hits.top_k(1));
}

/// The shipped chain head also drafts the tokens a question brings that its 8,192-token draft
/// vocabulary lacks (names, the words of a text to translate), from the position where each
/// first appears: teacher-forced ranks, which see the whole sequence at once, count such a
/// token only from there on and still replay greedy EESD exactly; and the model's token is
/// one of them, and drafted, at some positions of writing and translation answers.
#[test]
fn the_shipped_heads_context_tokens_are_drafted_and_replayed() {
    let lm = model_in(WeightDType::Native);
    let m = &lm.model;
    let path = workspace_root().join("assets/heads/smollm2-135m-instruct");
    let (head, meta) = load_layer_head(&path, m, None).unwrap();
    let subset: std::collections::HashSet<u32> =
        head.token_ids().unwrap().iter().copied().collect();
    let n = 48;
    let (mut outside, mut drafted) = (0, 0);
    let questions = spec_bench(480);
    let picked = ["writing", "translation"]
        .iter()
        .flat_map(|c| questions.iter().filter(move |q| q.category == *c).take(2));
    for q in picked {
        let prompt = lm.chat_prompt(&q.turns[0]).unwrap();
        let config = GenerationConfig {
            max_new_tokens: n,
            ..Default::default()
        };
        let out = Generator::new(m)
            .generate(&prompt, &config, |_| ControlFlow::Continue(()))
            .unwrap();
        let p = prompt.len();
        let tokens = [prompt.clone(), out.tokens].concat();
        let ranks = teacher_forced_ranks(m, &[(&head, meta.exit_layer)], &tokens, p - 1..p + n - 1)
            .unwrap()
            .remove(0);
        for k in [1, 3] {
            assert_eq!(
                replay(&ranks, k, n),
                eesd(m, &head, meta.exit_layer, k, &prompt, n),
                "question {}, fixed:{k}",
                q.question_id
            );
        }
        for (r, t) in ranks.iter().zip(&tokens[p..]) {
            if !subset.contains(t) && r.is_some() {
                outside += 1;
                drafted += usize::from(*r == Some(0));
            }
        }
    }
    assert!(
        drafted > 0,
        "{drafted} of {outside} tokens outside the subset drafted"
    );
}

#[test]
fn bad_arguments_are_errors() {
    let m = &model().model;
    let norm = NormHead::new();
    let tokens = [1u32, 2, 3];
    assert!(teacher_forced_ranks(m, &[(&norm, 0)], &tokens, 0..2).is_err());
    assert!(teacher_forced_ranks(m, &[(&norm, 30)], &tokens, 0..2).is_err());
    assert!(teacher_forced_ranks(m, &[(&norm, 6)], &tokens, 0..4).is_err());
    let empty = teacher_forced_ranks(m, &[(&norm, 6)], &tokens, 2..2).unwrap();
    assert_eq!(empty, vec![Vec::new()]);
}
