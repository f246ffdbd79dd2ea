//! Hand-made hostile files, one per bound the loaders enforce (the fuzz targets search for more;
//! see docs/robustness.md): each is a typed error, before any large allocation.

use eesd_models::gguf::{GgufValue, GgufWriter};
use eesd_models::{GgufFile, LoadedModel, ModelError, testing};

/// A GGUF v3 header with the given metadata entries (already encoded) and tensor infos.
fn gguf(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, Vec<u64>, u32, u64)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv.len() as u64).to_le_bytes());
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    for (key, ty, value) in kv {
        string(&mut out, key);
        out.extend(ty.to_le_bytes());
        out.extend(value);
    }
    for (name, dims, kind, offset) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(kind.to_le_bytes());
        out.extend(offset.to_le_bytes());
    }
    out.resize(out.len().div_ceil(32) * 32 + 64, 0);
    out
}

fn malformed_or_truncated(result: Result<GgufFile, ModelError>, what: &str) {
    match result {
        Err(ModelError::Malformed(_) | ModelError::Truncated { .. }) => {}
        other => panic!("{what}: {other:?}"),
    }
}

#[test]
fn gguf_bounds() {
    // A tensor offset near 2^64 used to wrap around the bounds check.
    let far = gguf(&[], &[("t", vec![4], 0, u64::MAX - 8)]);
    malformed_or_truncated(GgufFile::from_bytes(far), "offset near 2^64");
    // Four dimensions of 2^32 - 1 overflow an element count.
    let huge = gguf(&[], &[("t", vec![u32::MAX as u64; 4], 0, 0)]);
    malformed_or_truncated(GgufFile::from_bytes(huge), "2^128 elements");
    // The same tensor twice, the same key twice.
    let twice = gguf(&[], &[("t", vec![4], 0, 0), ("t", vec![4], 0, 0)]);
    malformed_or_truncated(GgufFile::from_bytes(twice), "tensor twice");
    let u32_value = |v: u32| v.to_le_bytes().to_vec();
    let keys = gguf(&[("k", 4, u32_value(1)), ("k", 4, u32_value(2))], &[]);
    malformed_or_truncated(GgufFile::from_bytes(keys), "key twice");
    // An array that claims 2^24 u8 values from a few bytes.
    let mut claim = 0u32.to_le_bytes().to_vec(); // element type u8
    claim.extend((1u64 << 24).to_le_bytes());
    let array = gguf(&[("a", 9, claim)], &[]);
    malformed_or_truncated(GgufFile::from_bytes(array), "array longer than the file");
}

#[test]
fn a_context_the_file_does_not_justify_is_refused() {
    let device = testing::test_device().unwrap();
    let mut config = testing::tiny_config();
    config.context_length = 1 << 40;
    let mut w = GgufWriter::new();
    testing::gguf_metadata(&mut w, &config);
    for (name, t) in testing::random_weights(&config, 1) {
        w.tensor_f32(name.gguf(), &t.shape, &t.values);
    }
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let err = LoadedModel::from_gguf(file, "x.gguf", &device, &Default::default()).unwrap_err();
    assert!(matches!(err, ModelError::InvalidConfig(_)), "{err}");
    // So is a layer count from the metadata that no tensors back.
    let mut w = GgufWriter::new();
    testing::gguf_metadata(&mut w, &testing::tiny_config());
    w.metadata("llama.block_count", GgufValue::U64(u64::MAX >> 1));
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let err = LoadedModel::from_gguf(file, "x.gguf", &device, &Default::default()).unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor(_)), "{err}");
}

#[test]
fn an_index_naming_files_outside_its_folder_is_refused() {
    let device = testing::test_device().unwrap();
    let dir = tempfile::tempdir().unwrap();
    testing::write_tiny_hf_dir(dir.path(), &testing::tiny_config(), 1).unwrap();
    for shard in ["../model.safetensors", "/etc/passwd", "a/../../b", ".."] {
        let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": shard}});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let err = LoadedModel::load_hf_dir(dir.path(), &device, &Default::default()).unwrap_err();
        assert!(
            matches!(&err, ModelError::Malformed(m) if m.contains("not a file name")),
            "{shard}: {err}"
        );
    }
}

#[test]
fn devices_and_empty_files_are_refused_without_reading_them() {
    let device = testing::test_device().unwrap();
    // `/dev/zero` would be read until memory ran out; a directory where a file is expected.
    let dir = tempfile::tempdir().unwrap();
    for path in [std::path::Path::new("/dev/zero"), dir.path()] {
        // Opening a model, and hashing one (the base model's SHA-256 a head is checked against).
        for err in [
            GgufFile::open(path).err().unwrap(),
            eesd_models::file_sha256(path).unwrap_err(),
        ] {
            assert!(
                matches!(&err, ModelError::Io { source, .. } if source.kind() == std::io::ErrorKind::InvalidInput),
                "{}: {err}",
                path.display()
            );
        }
    }
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    malformed_or_truncated(GgufFile::open(&empty), "empty file");
    // A model directory whose config is a device.
    testing::write_tiny_hf_dir(dir.path(), &testing::tiny_config(), 1).unwrap();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("config.json")).unwrap();
    let err = LoadedModel::load_hf_dir(dir.path(), &device, &Default::default()).unwrap_err();
    assert!(matches!(err, ModelError::Io { .. }), "{err}");
}

#[test]
fn a_mapped_file_loads_as_its_bytes_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let bytes = testing::tiny_gguf_bytes(&testing::tiny_config(), 3);
    std::fs::write(&path, &bytes).unwrap();
    let mapped = GgufFile::open(&path).unwrap();
    let owned = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(mapped.metadata(), owned.metadata());
    for name in owned.tensors().keys() {
        assert_eq!(
            mapped.tensor_f32(name).unwrap(),
            owned.tensor_f32(name).unwrap()
        );
    }
}
