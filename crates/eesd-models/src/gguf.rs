//! A reader for GGUF v2/v3 files: metadata, tensor directory and tensor data.
//!
//! The whole file is read into memory (model files for this crate are small) and every read is
//! bounds-checked, so a truncated or corrupt file yields [`ModelError`] rather than a panic.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{ModelError, Result};
use crate::file_bytes::FileBytes;
use crate::quant::GgmlType;

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bound for counts read from the header; a larger value means a corrupt file, and
/// refusing it early keeps us from trying to allocate absurd amounts of memory.
const MAX_COUNT: u64 = 1 << 24;
/// Upper bound for the elements of one tensor (2^40: far beyond any model this crate runs), so
/// that element counts and byte sizes are computed without overflow.
const MAX_ELEMENTS: u64 = 1 << 40;

/// A metadata value of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Unsigned integer (u8, u16, u32 or u64 in the file).
    U64(u64),
    /// Signed integer (i8, i16, i32 or i64 in the file).
    I64(i64),
    /// Floating point (f32 or f64 in the file).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Homogeneous array.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U64(v) => Some(v),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in GGUF order: `dims[0]` is the fastest-varying (row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub kind: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        // Saturating: a parsed file's tensors have at most 2^40 elements; a hand-made info
        // with more gets a count that no byte size fits.
        self.dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// The shape in row-major order (outermost first), as PyTorch would print it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed GGUF file: its directory parsed, its tensor data mapped from disk (or held in memory).
pub struct GgufFile {
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: BTreeMap<String, GgufTensorInfo>,
    data: FileBytes,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file (see [`FileBytes::map`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::parse(FileBytes::map(path.as_ref())?)
    }

    /// Parses a GGUF file from its bytes.
    pub fn from_bytes(data: Vec<u8>) -> Result<Self> {
        Self::parse(data.into())
    }

    fn parse(data: FileBytes) -> Result<Self> {
        let mut r = Reader {
            data: &data[..],
            pos: 0,
            values_left: MAX_COUNT,
        };
        let magic: [u8; 4] = r.bytes(4)?.try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(ModelError::BadMagic { found: magic });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::UnsupportedVersion(version));
        }
        let n_tensors = r.count("tensor count")?;
        let n_kv = r.count("metadata count")?;

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(ModelError::Malformed(format!(
                    "metadata key `{key}` is listed twice"
                )));
            }
        }

        let mut tensors = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(ModelError::Malformed(format!(
                    "tensor `{name}` has {n_dims} dimensions"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = r.u64()?;
                if d == 0 || d > u32::MAX as u64 {
                    return Err(ModelError::Malformed(format!(
                        "tensor `{name}` has dimension {d}"
                    )));
                }
                dims.push(d as usize);
            }
            if dims
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .is_none_or(|n| n as u64 > MAX_ELEMENTS)
            {
                return Err(ModelError::Malformed(format!(
                    "tensor `{name}` has dimensions {dims:?}, more than {MAX_ELEMENTS} elements"
                )));
            }
            let kind_id = r.u32()?;
            let kind =
                GgmlType::from_id(kind_id).ok_or_else(|| ModelError::UnsupportedTensorType {
                    name: name.clone(),
                    kind: format!("ggml type id {kind_id}"),
                })?;
            let offset = r.u64()?;
            if tensors.contains_key(&name) {
                return Err(ModelError::Malformed(format!(
                    "tensor `{name}` is listed twice"
                )));
            }
            let info = GgufTensorInfo {
                name: name.clone(),
                dims,
                kind,
                offset,
            };
            tensors.insert(name, info);
        }

        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or_else(|| {
                    ModelError::Malformed("general.alignment must be a power of two".into())
                })?,
            None => DEFAULT_ALIGNMENT,
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file = GgufFile {
            version,
            metadata,
            tensors,
            data,
            data_start,
        };
        for info in file.tensors.values() {
            file.check_tensor_bounds(info)?;
        }
        Ok(file)
    }

    fn check_tensor_bounds(&self, info: &GgufTensorInfo) -> Result<()> {
        self.tensor_range(info).map(|_| ())
    }

    /// Where a tensor's bytes lie in the file, checked to be inside it.
    fn tensor_range(&self, info: &GgufTensorInfo) -> Result<std::ops::Range<usize>> {
        let size = info.kind.byte_size(&info.name, info.num_elements())? as u64;
        let len = self.data.len() as u64;
        let truncated = |offset: u64| ModelError::Truncated {
            offset,
            needed: size,
            len,
        };
        let start = self
            .data_start
            .checked_add(info.offset)
            .ok_or(truncated(u64::MAX))?;
        match start.checked_add(size) {
            Some(end) if end <= len => Ok(start as usize..end as usize),
            _ => Err(truncated(start)),
        }
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A required unsigned integer metadata value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self
            .get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.into()))?;
        v.as_u64().ok_or(ModelError::MetadataType {
            key: key.into(),
            expected: "an unsigned integer",
        })
    }

    /// A required float metadata value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self
            .get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.into()))?;
        v.as_f64().ok_or(ModelError::MetadataType {
            key: key.into(),
            expected: "a number",
        })
    }

    /// A required string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self
            .get(key)
            .ok_or_else(|| ModelError::MissingMetadata(key.into()))?;
        v.as_str().ok_or(ModelError::MetadataType {
            key: key.into(),
            expected: "a string",
        })
    }

    /// The tensor directory, by name.
    pub fn tensors(&self) -> &BTreeMap<String, GgufTensorInfo> {
        &self.tensors
    }

    /// The raw bytes of a tensor.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> Result<&[u8]> {
        Ok(&self.data[self.tensor_range(info)?])
    }

    /// A tensor dequantized to f32, with its row-major shape.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        let bytes = self.tensor_bytes(info)?;
        let values = info
            .kind
            .dequantize(&info.name, bytes, info.num_elements())?;
        Ok((values, info.shape()))
    }
}

/// Bounds-checked little-endian cursor.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
    /// Array elements the metadata may still hold.
    values_left: u64,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.data.len())
            .ok_or(ModelError::Truncated {
                offset: self.pos as u64,
                needed: n as u64,
                len: self.data.len() as u64,
            })?;
        let out = &self.data[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.bytes(N)?.try_into().expect("exact length"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn count(&mut self, what: &str) -> Result<u64> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(ModelError::Malformed(format!(
                "{what} {n} is implausibly large"
            )));
        }
        Ok(n)
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > self.data.len() as u64 {
            return Err(ModelError::Truncated {
                offset: self.pos as u64,
                needed: len,
                len: self.data.len() as u64,
            });
        }
        let bytes = self.bytes(len as usize)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            ModelError::Malformed(format!("invalid UTF-8 string at offset {}", self.pos))
        })
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U64(self.array::<1>()?[0] as u64),
            1 => GgufValue::I64(self.array::<1>()?[0] as i8 as i64),
            2 => GgufValue::U64(u16::from_le_bytes(self.array()?) as u64),
            3 => GgufValue::I64(i16::from_le_bytes(self.array()?) as i64),
            4 => GgufValue::U64(self.u32()? as u64),
            5 => GgufValue::I64(i32::from_le_bytes(self.array()?) as i64),
            6 => GgufValue::F64(f32::from_le_bytes(self.array()?) as f64),
            7 => GgufValue::Bool(self.array::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(ModelError::Malformed(
                        "metadata arrays nested too deeply".into(),
                    ));
                }
                let elem_ty = self.u32()?;
                let n = self.count("array length")?;
                // Every element takes at least one byte of the file (an empty nested array 12),
                // so a longer array is truncated: refusing it bounds the values built per byte.
                if n > (self.data.len() - self.pos) as u64 {
                    return Err(ModelError::Truncated {
                        offset: self.pos as u64,
                        needed: n,
                        len: self.data.len() as u64,
                    });
                }
                // And the values of all metadata together are bounded (a tokenizer of 128k
                // tokens needs about 400k), whatever the file's size.
                self.values_left = self.values_left.checked_sub(n).ok_or_else(|| {
                    ModelError::Malformed(format!(
                        "metadata holds more than {MAX_COUNT} values in arrays"
                    ))
                })?;
                let mut items = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            other => {
                return Err(ModelError::Malformed(format!(
                    "unknown metadata value type {other}"
                )));
            }
        })
    }
}

/// Writes GGUF v3 files: metadata and tensors (raw bytes in any [`GgmlType`]).
///
/// Used by tests (small models written on the fly) and by tools that export weights.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a metadata entry (replacing an earlier value of the key: a file lists each key once).
    pub fn metadata(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        let key = key.into();
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Adds a tensor; `shape` is row-major (outermost first), `bytes` its encoded data.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        kind: GgmlType,
        bytes: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push((
            name.into(),
            shape.iter().rev().copied().collect(),
            kind,
            bytes,
        ));
        self
    }

    /// Adds an f32 tensor.
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: &[f32],
    ) -> &mut Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, shape, GgmlType::F32, bytes)
    }

    /// Encodes the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }
        fn type_id(v: &GgufValue) -> u32 {
            match v {
                GgufValue::U64(_) => 10,
                GgufValue::I64(_) => 11,
                GgufValue::F64(_) => 12,
                GgufValue::Bool(_) => 7,
                GgufValue::String(_) => 8,
                GgufValue::Array(_) => 9,
            }
        }
        fn value(out: &mut Vec<u8>, v: &GgufValue) {
            match v {
                GgufValue::U64(x) => out.extend(x.to_le_bytes()),
                GgufValue::I64(x) => out.extend(x.to_le_bytes()),
                GgufValue::F64(x) => out.extend(x.to_le_bytes()),
                GgufValue::Bool(x) => out.push(*x as u8),
                GgufValue::String(s) => string(out, s),
                GgufValue::Array(items) => {
                    out.extend(items.first().map_or(8, type_id).to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|i| value(out, i));
                }
            }
        }
        let mut out = Vec::new();
        out.extend(MAGIC);
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            string(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            value(&mut out, v);
        }
        let align = |n: usize| n.div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize;
        let mut offset = 0;
        for (name, dims, kind, bytes) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter()
                .for_each(|d| out.extend((*d as u64).to_le_bytes()));
            out.extend(kind.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = align(offset + bytes.len());
        }
        out.resize(align(out.len()), 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(align(out.len()), 0);
        }
        out
    }
}
