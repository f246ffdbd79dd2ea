//! GGML tensor element types and their dequantization to f32.
//!
//! Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K. Block layouts follow ggml's
//! `ggml-quants.c`; each block stores one or two f16 scales followed by packed integers.

use half::{bf16, f16};

use crate::error::{ModelError, Result};

/// A GGML element type as stored in GGUF tensor infos.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// Blocks of 32: f16 scale, 32 × 4-bit, value = (q − 8)·d.
    Q4_0,
    /// Blocks of 32: f16 scale and min, 32 × 4-bit, value = q·d + m.
    Q4_1,
    /// Blocks of 32: f16 scale, 32 × i8, value = q·d.
    Q8_0,
    /// Super-blocks of 256 with 6-bit sub-block scales and mins, 4-bit values.
    Q4K,
    /// Super-blocks of 256 with 8-bit sub-block scales, 6-bit values.
    Q6K,
    /// A type GGUF knows that this crate cannot dequantize (kept to give a precise error).
    Other(u32),
}

impl GgmlType {
    /// Maps a GGUF type id; `None` for ids no ggml version defines.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            4..=41 => Self::Other(id),
            _ => return None,
        })
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q6K => 14,
            Self::Bf16 => 30,
            Self::Other(id) => id,
        }
    }

    /// (elements per block, bytes per block), or `None` for unsupported types.
    fn block(self) -> Option<(usize, usize)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (256, 144),
            Self::Q6K => (256, 210),
            Self::Other(_) => return None,
        })
    }

    fn unsupported(self, name: &str) -> ModelError {
        ModelError::UnsupportedTensorType {
            name: name.into(),
            kind: format!("{self:?}"),
        }
    }

    /// Bytes occupied by `n` elements; an error for unsupported types or partial blocks.
    pub fn byte_size(self, name: &str, n: usize) -> Result<usize> {
        let (per_block, bytes) = self.block().ok_or_else(|| self.unsupported(name))?;
        if !n.is_multiple_of(per_block) {
            return Err(ModelError::Malformed(format!(
                "tensor `{name}` has {n} elements, not a multiple of the {self:?} block size {per_block}"
            )));
        }
        (n / per_block).checked_mul(bytes).ok_or_else(|| {
            ModelError::Malformed(format!("tensor `{name}` has {n} elements, too many"))
        })
    }

    /// Dequantizes `n` elements from `bytes` to f32.
    pub fn dequantize(self, name: &str, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
        let size = self.byte_size(name, n)?;
        if bytes.len() != size {
            return Err(ModelError::Malformed(format!(
                "tensor `{name}`: {} bytes for {n} {self:?} elements, expected {size}",
                bytes.len()
            )));
        }
        let mut out = Vec::with_capacity(n);
        match self {
            Self::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
            Self::F16 => out.extend(bytes.chunks_exact(2).map(|b| f16_at(b, 0))),
            Self::Bf16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            ),
            Self::Q4_0 => bytes
                .chunks_exact(18)
                .for_each(|b| dequant_q4_0(b, &mut out)),
            Self::Q4_1 => bytes
                .chunks_exact(20)
                .for_each(|b| dequant_q4_1(b, &mut out)),
            Self::Q8_0 => bytes
                .chunks_exact(34)
                .for_each(|b| dequant_q8_0(b, &mut out)),
            Self::Q4K => bytes
                .chunks_exact(144)
                .for_each(|b| dequant_q4_k(b, &mut out)),
            Self::Q6K => bytes
                .chunks_exact(210)
                .for_each(|b| dequant_q6_k(b, &mut out)),
            Self::Other(_) => return Err(self.unsupported(name)),
        }
        Ok(out)
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn dequant_q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|q| ((q & 0x0f) as i32 - 8) as f32 * d));
    out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
}

fn dequant_q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|q| (q & 0x0f) as f32 * d + m));
    out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
}

fn dequant_q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    out.extend(b[2..34].iter().map(|q| *q as i8 as f32 * d));
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K super-block (ggml's `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn dequant_q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        out.extend(q.iter().map(|q| d1 * (q & 0x0f) as f32 - m1));
        out.extend(q.iter().map(|q| d2 * (q >> 4) as f32 - m2));
    }
}

fn dequant_q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let mut y = [0f32; 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
        out.extend_from_slice(&y);
    }
}

/// Quantizes f32 values into Q8_0 blocks (used by tests and tools that write GGUF files).
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(
            (0..32).map(|i| (block.get(i).copied().unwrap_or(0.0) * inv).round() as i8 as u8),
        );
    }
    out
}

/// Quantizes f32 values into Q4_1 blocks (used by tests and tools that write GGUF files).
pub fn quantize_q4_1(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 20);
    for block in values.chunks(32) {
        let min = block.iter().copied().fold(f32::INFINITY, f32::min);
        let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        let q = |i: usize| {
            ((block.get(i).copied().unwrap_or(min) - min) * inv)
                .round()
                .clamp(0.0, 15.0) as u8
        };
        out.extend((0..16).map(|i| q(i) | (q(i + 16) << 4)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_roundtrip_is_close() {
        let v: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        let back = GgmlType::Q8_0
            .dequantize("t", &quantize_q8_0(&v), 64)
            .unwrap();
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() < 0.05, "{a} vs {b}");
        }
    }

    #[test]
    fn q4_1_roundtrip_is_close() {
        let v: Vec<f32> = (0..64).map(|i| (i as f32).sin()).collect();
        let back = GgmlType::Q4_1
            .dequantize("t", &quantize_q4_1(&v), 64)
            .unwrap();
        for (a, b) in v.iter().zip(&back) {
            assert!((a - b).abs() < 0.08, "{a} vs {b}");
        }
    }

    #[test]
    fn q4_0_known_block() {
        // d = 0.5, nibbles 0..15 in the low half and 15..0 in the high half.
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let out = GgmlType::Q4_0.dequantize("t", &b, 32).unwrap();
        assert_eq!(out[0], -4.0);
        assert_eq!(out[15], 3.5);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[31], -4.0);
    }

    #[test]
    fn q4_k_and_q6_k_constant_blocks() {
        // Q4_K: d = 1, dmin = 0, all sub-block scales = 1, all nibbles = 3 → every value is 3.
        let mut b = f16::from_f32(1.0).to_le_bytes().to_vec();
        b.extend(f16::from_f32(0.0).to_le_bytes());
        b.extend([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]);
        b.extend([0x33u8; 128]);
        let out = GgmlType::Q4K.dequantize("t", &b, 256).unwrap();
        assert!(out.iter().all(|v| *v == 3.0), "{out:?}");

        // Q6_K: ql = 0x11, qh = 0b10101010 → q = 1 | (2 << 4) = 33 − 32 = 1; scale 2, d = 0.5 → 1.
        let mut b = vec![0x11u8; 128];
        b.extend([0b1010_1010u8; 64]);
        b.extend([2u8; 16]);
        b.extend(f16::from_f32(0.5).to_le_bytes());
        let out = GgmlType::Q6K.dequantize("t", &b, 256).unwrap();
        assert!(out.iter().all(|v| *v == 1.0), "{out:?}");
    }

    #[test]
    fn wrong_sizes_are_errors() {
        assert!(GgmlType::Q4_1.byte_size("t", 33).is_err());
        assert!(GgmlType::Q4_1.dequantize("t", &[0; 19], 32).is_err());
        assert!(matches!(
            GgmlType::Other(10).dequantize("t", &[], 0),
            Err(ModelError::UnsupportedTensorType { .. })
        ));
    }
}
