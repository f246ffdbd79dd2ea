//! Prompts and limits at their edges, in every decoding mode (AR, EESD, tree) on the tiny model
//! with its real byte-level tokenizer: invalid token ids, empty prompts, prompts at and over the
//! context, `max_new_tokens` of 0 and far beyond the context (`usize::MAX`), and stop strings that span
//! several tokens. Each is a typed error or a clean stop, and the modes agree token for token.

use std::ops::ControlFlow;

use eesd_bandit::Policy;
use eesd_core::drafters::DrafterSpec;
use eesd_core::{CoreError, GenerationConfig, GenerationOutput, Generator, Mode, StopReason};
use eesd_models::{GgufFile, LoadedModel, NormHead, testing};

const MODES: [Mode; 3] = [Mode::Ar, Mode::Eesd, Mode::Tree];

fn tiny() -> LoadedModel {
    let bytes = testing::tiny_gguf_bytes(&testing::tiny_config(), 21);
    let file = GgufFile::from_bytes(bytes).unwrap();
    let device = testing::test_device().unwrap();
    LoadedModel::from_gguf(file, "tiny.gguf", &device, &Default::default()).unwrap()
}

fn generate(
    loaded: &LoadedModel,
    prompt: &[u32],
    config: &GenerationConfig,
) -> Result<GenerationOutput, CoreError> {
    let model = &loaded.model;
    let head = NormHead::new();
    let drafter = "recycle@8"
        .parse::<DrafterSpec>()
        .unwrap()
        .build(model.config().vocab_size);
    let tokenizer = loaded.tokenizer.clone();
    let mut g = Generator::new(model)
        .with_head(&head)
        .with_policy(Policy::parse("fixed:3", 0).unwrap())
        .with_drafter(drafter)
        .with_detokenizer(move |ids: &[u32]| tokenizer.decode(ids, false).unwrap_or_default());
    let config = GenerationConfig {
        exit_layer: Some(2),
        ..config.clone()
    };
    g.generate(prompt, &config, |_| ControlFlow::Continue(()))
}

fn config(mode: Mode, max_new_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        mode,
        max_new_tokens,
        ..Default::default()
    }
}

#[test]
fn invalid_prompts_are_typed_errors_in_every_mode() {
    let loaded = tiny();
    let context = loaded.model.config().context_length;
    let vocab = loaded.model.config().vocab_size as u32;
    for mode in MODES {
        let c = config(mode, 8);
        for prompt in [vec![], vec![72, vocab], vec![u32::MAX]] {
            let err = generate(&loaded, &prompt, &c).unwrap_err();
            assert!(
                matches!(err, CoreError::InvalidConfig(_)),
                "{mode:?} {prompt:?}: {err}"
            );
        }
        for len in [context, context + 1, 10 * context] {
            let err = generate(&loaded, &vec![72; len], &c).unwrap_err();
            assert!(
                matches!(err, CoreError::PromptTooLong { prompt, context: n } if prompt == len && n == context),
                "{mode:?} {len}: {err}"
            );
        }
        // The last id of the vocabulary is a valid prompt.
        assert!(generate(&loaded, &[72, vocab - 1], &c).is_ok(), "{mode:?}");
    }
}

#[test]
fn limits_stop_cleanly_and_alike_in_every_mode() {
    let loaded = tiny();
    let context = loaded.model.config().context_length;
    let prompt = loaded.tokenizer.encode("Hello").unwrap();
    for mode in MODES {
        let out = generate(&loaded, &prompt, &config(mode, 0)).unwrap();
        assert!(
            out.tokens.is_empty(),
            "{mode:?}: nothing asked, nothing made"
        );
        assert_eq!(out.stop_reason, StopReason::MaxTokens, "{mode:?}");
    }
    // A prompt one short of the context, and requests far beyond it: a clean ContextFull, the
    // same tokens in every mode, and never more positions than the context holds (the last
    // token is emitted without being fed back).
    for prompt_len in [context - 1, context - 9, prompt.len()] {
        let mut prompt_ids = prompt.clone();
        prompt_ids.resize(prompt_len, 72);
        let outs: Vec<GenerationOutput> = MODES
            .iter()
            .map(|&mode| generate(&loaded, &prompt_ids, &config(mode, usize::MAX)).unwrap())
            .collect();
        for (mode, out) in MODES.iter().zip(&outs) {
            assert_eq!(
                out.stop_reason,
                StopReason::ContextFull,
                "{mode:?} {prompt_len}"
            );
            assert_eq!(out.tokens, outs[0].tokens, "{mode:?} {prompt_len}");
            assert!(prompt_len + out.tokens.len() <= context + 1, "{mode:?}");
            assert!(!out.tokens.is_empty(), "{mode:?}");
        }
    }
}

#[test]
fn stop_strings_spanning_tokens_end_every_mode_at_the_same_token() {
    let loaded = tiny();
    let prompt = loaded.tokenizer.encode("Once upon a time").unwrap();
    let plain = generate(&loaded, &prompt, &config(Mode::Ar, 24)).unwrap();
    let tokenizer = &loaded.tokenizer;
    // Three tokens' text from the middle of the answer: only the byte-level tokens whose text is
    // whole characters, so that the string is found exactly where it was taken from.
    let piece =
        |range: std::ops::Range<usize>| tokenizer.decode(&plain.tokens[range], false).unwrap();
    let start = (6..18)
        .find(|&i| {
            let s = piece(i..i + 3);
            s.chars().count() >= 2 && !s.contains('\u{fffd}')
        })
        .expect("a decodable stretch");
    let stop = piece(start..start + 3);
    let text = |n: usize| tokenizer.decode(&plain.tokens[..n], false).unwrap();
    let end = (1..=plain.tokens.len())
        .find(|&n| text(n).contains(&stop))
        .unwrap();
    for mode in MODES {
        let c = GenerationConfig {
            stop_strings: vec![stop.clone()],
            ..config(mode, 24)
        };
        let out = generate(&loaded, &prompt, &c).unwrap();
        assert_eq!(out.stop_reason, StopReason::StopString, "{mode:?} {stop:?}");
        assert_eq!(out.tokens, plain.tokens[..end], "{mode:?} {stop:?}");
        let empty = GenerationConfig {
            stop_strings: vec![String::new()],
            ..c
        };
        let err = generate(&loaded, &prompt, &empty).unwrap_err();
        assert!(
            matches!(err, CoreError::InvalidConfig(_)),
            "{mode:?}: {err}"
        );
    }
}
