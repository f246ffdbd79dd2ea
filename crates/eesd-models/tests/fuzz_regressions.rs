//! Replays, through the fuzz targets' entry points, every input the fuzz campaigns kept
//! (`fuzz/regressions/<target>/`: each once crashed a target, now an error) and the seed
//! corpora (small generated files of every kind, and the real model's metadata when it is in
//! the cache). Each must come back without a panic.

use std::path::PathBuf;

use eesd_models::fuzz;

fn regressions(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_kept_input_and_seed_is_handled_without_a_panic() {
    let real = std::fs::read(eesd_models::fetch::cached_smollm2()).ok();
    let mut replayed = 0;
    for target in fuzz::TARGETS {
        for (path, bytes) in regressions(target) {
            eprintln!("{target}: {}", path.display());
            assert!(fuzz::run(target, &bytes));
            replayed += 1;
        }
        let seeds = fuzz::seeds(target, real.as_deref()).unwrap();
        assert!(!seeds.is_empty(), "{target} has seeds");
        for (name, bytes) in seeds {
            eprintln!("{target}: seed {name}");
            assert!(fuzz::run(target, &bytes));
        }
    }
    assert!(replayed >= 1, "the kept inputs are found");
}

#[test]
fn multi_file_inputs_split_where_they_were_joined() {
    let joined = fuzz::join_parts(&[b"a", b"", b"c\n--8<"]);
    assert_eq!(
        fuzz::split_parts(&joined, 3),
        vec![&b"a"[..], b"", b"c\n--8<"]
    );
    assert_eq!(fuzz::split_parts(b"abc", 3), vec![&b"abc"[..], b"", b""]);
    assert_eq!(
        fuzz::split_parts(&joined, 2)[1],
        &joined[1 + fuzz::PART_SEPARATOR.len()..]
    );
}

/// The seeds are real inputs, not parse failures: each loads a model (or a tokenizer, or
/// renders), so the fuzzer starts from deep inside the parsers.
#[test]
fn seeds_load() {
    let device = eesd_models::testing::test_device().unwrap();
    for (name, bytes) in fuzz::seeds("gguf", None).unwrap() {
        let file = eesd_models::GgufFile::from_bytes(bytes).unwrap();
        let loaded = eesd_models::LoadedModel::from_gguf(file, &name, &device, &Default::default());
        assert!(loaded.is_ok(), "{name}: {:?}", loaded.err());
    }
    for (name, bytes) in fuzz::seeds("tokenizer_json", None).unwrap() {
        assert!(
            eesd_models::Tokenizer::from_bytes(&bytes, None, None).is_ok(),
            "{name}"
        );
    }
    for (name, bytes) in fuzz::seeds("chat_template", None).unwrap() {
        let source = String::from_utf8(bytes).unwrap();
        assert!(
            eesd_models::ChatTemplate::new(source, "", "").is_ok(),
            "{name}"
        );
    }
}
