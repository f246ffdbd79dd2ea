//! The real SmolLM2-135M-Instruct model against the independent reference: tokenization, top-5
//! logits after the prompt, and greedy continuations.

mod common;

use common::*;

#[test]
fn tokenization_matches_reference() {
    let m = model();
    for g in golden() {
        let ids = m.tokenizer.encode(&g.text).unwrap();
        assert_eq!(ids, g.prompt_ids, "prompt {:?}", g.text);
    }
}

#[test]
fn chat_template_renders_reference_prompts() {
    let m = model();
    let template = m.chat_template.as_ref().expect("chat template");
    let mut chat_prompts = 0;
    for g in golden() {
        let Some(rest) = g.text.strip_prefix(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n",
        ) else {
            continue;
        };
        let question = rest
            .strip_suffix("<|im_end|>\n<|im_start|>assistant\n")
            .unwrap();
        let rendered = template
            .render(&[eesd_models::ChatMessage::user(question)], true)
            .unwrap();
        assert_eq!(rendered, g.text);
        chat_prompts += 1;
    }
    assert!(chat_prompts > 0);
}

#[test]
fn top5_logits_match_reference() {
    let m = model();
    for g in golden() {
        let mut cache = m.model.new_cache();
        let logits = m.model.forward(&g.prompt_ids, &mut cache).unwrap();
        let last = row(&logits, g.prompt_ids.len() - 1);
        let ours = top_k(&last, 5);
        for (i, ((id, val), (rid, rval))) in ours.iter().zip(&g.last_logits_top5).enumerate() {
            assert!(
                (val - rval).abs() < 0.05,
                "prompt {:?}: logit {i} {val} vs {rval}",
                g.text
            );
            let gap_ok = i == 0 || (g.last_logits_top5[i - 1].1 - rval).abs() > 0.02;
            let next_gap_ok = g
                .last_logits_top5
                .get(i + 1)
                .is_none_or(|n| (rval - n.1).abs() > 0.02);
            if gap_ok && next_gap_ok {
                assert_eq!(id, rid, "prompt {:?}: top-{i} id", g.text);
            }
        }
        // The reference's ids carry the reference's logits.
        for (rid, rval) in &g.last_logits_top5 {
            assert!(
                (last[*rid as usize] - rval).abs() < 0.05,
                "id {rid}: {} vs {rval}",
                last[*rid as usize]
            );
        }
    }
}

#[test]
fn greedy_continuations_match_reference() {
    let m = model();
    let eos = m.tokenizer.eos_token_id().unwrap();
    for g in golden() {
        // Compare up to the first step whose reference margin is tiny (order may flip there).
        let n = g.reliable_len();
        let mut cache = m.model.new_cache();
        let mut logits = m.model.forward_last(&g.prompt_ids, &mut cache).unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            let v = logits
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap();
            let next = argmax(&v);
            out.push(next);
            if next == eos {
                break;
            }
            logits = m.model.forward_last(&[next], &mut cache).unwrap();
        }
        assert_eq!(out, g.greedy_ids[..n], "prompt {:?}", g.text);
        if n == g.greedy_ids.len() {
            let text = m.tokenizer.decode(&out, true).unwrap();
            assert_eq!(text.trim(), g.greedy_text.trim());
        }
    }
}

#[test]
fn block_token_by_token_and_truncation_give_the_same_logits() {
    let m = model();
    let g = &golden()[1];
    let ids = &g.prompt_ids;
    let n = ids.len();
    let block = m.model.forward(ids, &mut m.model.new_cache()).unwrap();
    let reference = row(&block, n - 1);

    let mut cache = m.model.new_cache();
    let mut last = None;
    for &t in ids {
        last = Some(m.model.forward(&[t], &mut cache).unwrap());
    }
    let stepwise = row(&last.unwrap(), 0);

    // Half the prompt, then a wrong continuation, rolled back, then the true rest.
    let mut cache = m.model.new_cache();
    m.model.forward(&ids[..n / 2], &mut cache).unwrap();
    m.model
        .forward(&[504, 3575, 282, 4649], &mut cache)
        .unwrap();
    cache.truncate(n / 2);
    let rerun = row(
        &m.model.forward(&ids[n / 2..], &mut cache).unwrap(),
        n - n / 2 - 1,
    );

    for (name, v) in [
        ("token by token", &stepwise),
        ("truncate and re-run", &rerun),
    ] {
        let diff = reference
            .iter()
            .zip(v.iter())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 2e-3, "{name}: max logit difference {diff}");
        assert_eq!(argmax(&reference), argmax(v));
    }
}

#[test]
fn batched_greedy_decoding_of_all_prompts_matches_one_at_a_time() {
    let m = model();
    let goldens = golden();
    let steps = 24;
    // One at a time.
    let mut single = Vec::new();
    for g in &goldens {
        let mut cache = m.model.new_cache();
        let mut logits = m.model.forward_last(&g.prompt_ids, &mut cache).unwrap();
        let mut out = Vec::new();
        for _ in 0..steps {
            let v = logits.into_data().try_into_vec::<f32>().unwrap();
            out.push(argmax(&v));
            logits = m
                .model
                .forward_last(&out[out.len() - 1..], &mut cache)
                .unwrap();
        }
        single.push(out);
    }
    // All prompts (different lengths) in one batch.
    let mut caches: Vec<_> = goldens.iter().map(|_| m.model.new_cache()).collect();
    let mut next: Vec<u32> = Vec::new();
    for (g, cache) in goldens.iter().zip(caches.iter_mut()) {
        let v = m.model.forward_last(&g.prompt_ids, cache).unwrap();
        next.push(argmax(&v.into_data().try_into_vec::<f32>().unwrap()));
    }
    let mut batched: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    let vocab = m.model.config().vocab_size;
    for _ in 1..steps {
        let logits = m.model.decode_batch(&next, &mut caches).unwrap();
        let v = logits.into_data().try_into_vec::<f32>().unwrap();
        for (s, row) in v.chunks(vocab).enumerate() {
            next[s] = argmax(row);
            batched[s].push(next[s]);
        }
    }
    assert_eq!(batched, single);
    // Bad input is an error, not a panic.
    assert!(m.model.decode_batch(&[1, 2], &mut caches[..1]).is_err());
}
