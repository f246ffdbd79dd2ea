//! The GGUF block formats the quantized kernel reads in place, seen as sub-blocks of 32 weights.
//!
//! Every supported format is, per sub-block of 32 consecutive weights, `w = s · q + m` with
//! small unsigned integers `q` (signed for Q8_0), a scale `s` per group of 4 weights (the same
//! for all 32, except Q6_K whose two halves of 16 have their own) and an offset `m` per 16 or
//! 32 weights. Scales and offsets are computed from the block's f16 and integer fields exactly
//! (an f16 times an integer of at most 8 bits fits an f32 mantissa), so every code path sees the
//! same values. Layouts follow ggml's `ggml-quants.c` (see [`crate::quant`] for the dequantizers
//! they are tested against).

use half::f16;

use crate::quant::{GgmlType, scale_min_k4};

/// Weights per sub-block: the granularity of scales in every format, and of the activations'
/// 8-bit quantization.
pub const SUB: usize = 32;

/// A quantized GGUF block format with a native kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// Blocks of 32: f16 scale, 4-bit values, `w = d · (q − 8)`.
    Q4_0,
    /// Blocks of 32: f16 scale and min, 4-bit values, `w = d · q + m`.
    Q4_1,
    /// Blocks of 32: f16 scale, 8-bit signed values, `w = d · q`.
    Q8_0,
    /// Super-blocks of 256: f16 scale and min, 6-bit sub-block scales and mins, 4-bit values.
    Q4K,
    /// Super-blocks of 256: f16 scale, 8-bit scales per 16, 6-bit values, `w = d · s · (q − 32)`.
    Q6K,
}

/// How a sub-block's weights are offset: `w = s · q + m` (`T`: the value, or a register of it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Offset<T = f32> {
    /// `m = 0`.
    None,
    /// One `m` for all 32 weights.
    Whole(T),
    /// One `m` per half of 16 weights.
    Halves(T, T),
}

/// Scales and offset of one sub-block: `scale[0]` for weights 0..16, `scale[1]` for 16..32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SubScales {
    pub scale: [f32; 2],
    pub offset: Offset,
}

impl QuantFormat {
    /// Every format, for tests and reports.
    pub const ALL: [QuantFormat; 5] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q6K,
    ];

    /// The format of a GGML type, `None` for float and unsupported types.
    pub fn from_ggml(t: GgmlType) -> Option<Self> {
        Some(match t {
            GgmlType::Q4_0 => Self::Q4_0,
            GgmlType::Q4_1 => Self::Q4_1,
            GgmlType::Q8_0 => Self::Q8_0,
            GgmlType::Q4K => Self::Q4K,
            GgmlType::Q6K => Self::Q6K,
            _ => return None,
        })
    }

    /// The GGML type.
    pub fn ggml(self) -> GgmlType {
        match self {
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4K => GgmlType::Q4K,
            Self::Q6K => GgmlType::Q6K,
        }
    }

    /// Weights per block.
    pub const fn block_len(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Scales and offset of sub-block `s` of block `b`.
    #[inline(always)]
    pub(crate) fn scales(self, b: &[u8], s: usize) -> SubScales {
        let both = |v: f32| [v, v];
        match self {
            Self::Q4_0 => {
                let d = f16_at(b, 0);
                SubScales {
                    scale: both(d),
                    offset: Offset::Whole(-8.0 * d),
                }
            }
            Self::Q4_1 => SubScales {
                scale: both(f16_at(b, 0)),
                offset: Offset::Whole(f16_at(b, 2)),
            },
            Self::Q8_0 => SubScales {
                scale: both(f16_at(b, 0)),
                offset: Offset::None,
            },
            Self::Q4K => {
                let (sc, m) = scale_min_k4(s, &b[4..16]);
                SubScales {
                    scale: both(f16_at(b, 0) * sc as f32),
                    offset: Offset::Whole(-(f16_at(b, 2) * m as f32)),
                }
            }
            Self::Q6K => {
                // Sub-block s = 4·half + quarter; its 16-weight groups use scales 8·half +
                // 2·quarter and the one after (ggml's `is + 2·quarter`).
                let d = f16_at(b, 208);
                let first = 8 * (s / 4) + 2 * (s % 4);
                let sc = |i: usize| d * (b[192 + i] as i8) as f32;
                let (a, c) = (sc(first), sc(first + 1));
                SubScales {
                    scale: [a, c],
                    offset: Offset::Halves(-32.0 * a, -32.0 * c),
                }
            }
        }
    }

    /// The 32 integer values of sub-block `s` of block `b` (as stored: unsigned, or signed for
    /// Q8_0).
    #[inline(always)]
    pub(crate) fn values(self, b: &[u8], s: usize) -> [i32; SUB] {
        let mut q = [0i32; SUB];
        match self {
            Self::Q4_0 | Self::Q4_1 => {
                let qs = &b[self.block_bytes() - 16..];
                for i in 0..16 {
                    q[i] = (qs[i] & 0x0f) as i32;
                    q[i + 16] = (qs[i] >> 4) as i32;
                }
            }
            Self::Q8_0 => {
                for (v, &byte) in q.iter_mut().zip(&b[2..34]) {
                    *v = byte as i8 as i32;
                }
            }
            Self::Q4K => {
                let qs = &b[16 + 32 * (s / 2)..][..32];
                let shift = 4 * (s % 2);
                for (v, &byte) in q.iter_mut().zip(qs) {
                    *v = ((byte >> shift) & 0x0f) as i32;
                }
            }
            Self::Q6K => {
                let (half, quarter) = (s / 4, s % 4);
                let ql = &b[64 * half + 32 * (quarter % 2)..][..32];
                let qh = &b[128 + 32 * half..][..32];
                let (lo_shift, hi_shift) = (4 * (quarter / 2), 2 * quarter);
                for l in 0..SUB {
                    q[l] = (((ql[l] >> lo_shift) & 0x0f) | (((qh[l] >> hi_shift) & 3) << 4)) as i32;
                }
            }
        }
        q
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4_k",
            Self::Q6K => "q6_k",
        })
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Deterministic pseudo-random blocks with small finite scales (any bit pattern is a valid
/// block otherwise), for tests.
#[cfg(test)]
pub(crate) fn test_blocks(format: QuantFormat, blocks: usize, seed: u32) -> Vec<u8> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut bytes: Vec<u8> = (0..blocks * format.block_bytes())
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as u8
        })
        .collect();
    // Keep the f16 scales small and finite.
    let f16_fields: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K => &[0, 2],
        QuantFormat::Q6K => &[208],
    };
    for (b, block) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
        for (i, &at) in f16_fields.iter().enumerate() {
            let v = ((b * 7 + i * 3) % 13) as f32 / 400.0 - 0.01;
            block[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_blocks_reproduce_the_dequantizer() {
        for format in QuantFormat::ALL {
            let n = 2 * format.block_len();
            let bytes = test_blocks(format, 2, 9);
            let want = format.ggml().dequantize("t", &bytes, n).unwrap();
            for (b, block) in bytes.chunks_exact(format.block_bytes()).enumerate() {
                for s in 0..format.block_len() / SUB {
                    let q = format.values(block, s);
                    let sc = format.scales(block, s);
                    for (e, &q) in q.iter().enumerate() {
                        let offset = match sc.offset {
                            Offset::None => 0.0,
                            Offset::Whole(m) => m,
                            Offset::Halves(a, c) => [a, c][e / 16],
                        };
                        let got = sc.scale[e / 16] * q as f32 + offset;
                        let at = b * format.block_len() + s * SUB + e;
                        let tol = 1e-6 * (1.0 + want[at].abs());
                        assert!((got - want[at]).abs() <= tol, "{format} {at}");
                    }
                }
            }
        }
    }
}
