//! `y = x · wᵀ` with `w: [out, k]` kept in its GGUF block format ([`QuantMatrix`]) and f32
//! activation rows `x: [b, k]`, quantized per row to 8 bits ([`Q8Rows`]) for integer dot
//! products (AVX2 `maddubs`, AVX-512 VNNI `vpdpbusd`), as llama.cpp runs quantized models.
//!
//! Why: decoding streams every weight once per token; in Q4_1 that is 5 bits per weight
//! instead of 32, and a block of rows reads each weight block once for all of them.
//!
//! Every format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) is regrouped at load into panels of 8 rows
//! (module `qpanel`, whose kernels serve 8 or 16 outputs per instruction and fix each output's
//! arithmetic whatever the block size, row grouping, thread or instruction set: a block's rows
//! equal the rows computed alone, bit for bit).

use super::huge_pages::HugeBuf;
use super::isa::Isa;
use super::matmul::{ShapeError, row_groups};
use super::pool::Pool;
use super::q8::Q8Rows;
use super::qformat::{QuantFormat, SUB};
use super::qpanel;

/// A weight matrix `[out, k]` in GGUF blocks, rows front to back, as stacked parts that may
/// use different formats (a fused q/k/v projection of a mixed-quantization file).
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    parts: Vec<Part>,
    out: usize,
    k: usize,
}

#[derive(Clone, PartialEq)]
struct Part {
    format: QuantFormat,
    /// First output row.
    first: usize,
    rows: usize,
    /// The blocks in panels ([`qpanel`]); on huge pages where the OS offers them
    /// ([`super::huge_pages`]).
    data: HugeBuf<u8>,
    /// The file blocks' heads that the panels do not keep ([`qpanel::head_bytes`]; Q4_K,
    /// Q6_K), to give the file's blocks back; never read by the kernels.
    heads: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let formats: Vec<String> = self.parts.iter().map(|p| p.format.to_string()).collect();
        f.debug_struct("QuantMatrix")
            .field("out", &self.out)
            .field("k", &self.k)
            .field("formats", &formats)
            .finish()
    }
}

impl QuantMatrix {
    /// A matrix of `out` rows of `k` weights from `data` (row-major blocks, as in a GGUF file).
    pub fn new(
        format: QuantFormat,
        data: Vec<u8>,
        out: usize,
        k: usize,
    ) -> Result<Self, ShapeError> {
        let mut m = QuantMatrix {
            parts: Vec::new(),
            out: 0,
            k,
        };
        m.push(format, data, out)?;
        Ok(m)
    }

    /// Appends `rows` more output rows in `format`.
    pub fn push(
        &mut self,
        format: QuantFormat,
        data: Vec<u8>,
        rows: usize,
    ) -> Result<(), ShapeError> {
        let k = self.k;
        let row_bytes = k / format.block_len() * format.block_bytes();
        if k == 0
            || !k.is_multiple_of(format.block_len())
            || rows.checked_mul(row_bytes) != Some(data.len())
        {
            return Err(ShapeError::Weights {
                len: data.len(),
                out: rows,
                k,
            });
        }
        let (panels, heads) = qpanel::repack(format, &data, rows, k);
        self.parts.push(Part {
            format,
            first: self.out,
            rows,
            data: HugeBuf::from_slice(&panels),
            heads,
        });
        self.out += rows;
        Ok(())
    }

    /// Output rows.
    pub fn out(&self) -> usize {
        self.out
    }

    /// Inner dimension.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes the kernels read (the file's bytes, plus the padding of a last panel of fewer
    /// than 8 rows; Q4_K panels hold 24 bytes per 32 weights where the file has 18, Q6_K 40
    /// where it has 26.25).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// The formats of the parts, in row order.
    pub fn formats(&self) -> Vec<QuantFormat> {
        self.parts.iter().map(|p| p.format).collect()
    }

    /// The format and the file's bytes of output row `o`, rebuilt from its panel.
    fn row(&self, o: usize) -> Option<(QuantFormat, Vec<u8>)> {
        let p = self
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.rows).contains(&o))?;
        let (r, bb) = (o - p.first, p.format.block_bytes());
        let bytes = self.k / p.format.block_len() * bb;
        let mut row = vec![0u8; bytes];
        for (b, block) in row.chunks_exact_mut(bb).enumerate() {
            qpanel::file_block(p.format, &p.data, &p.heads, self.k, r, b, block);
        }
        Some((p.format, row))
    }

    /// Output row `o` dequantized to f32 (by [`crate::quant::GgmlType::dequantize`], so the
    /// values equal those of a dequantizing load).
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) -> Result<(), ShapeError> {
        let bad = ShapeError::Operands {
            x: out.len(),
            y: o,
            out: self.out,
            k: self.k,
        };
        let Some((format, bytes)) = self.row(o).filter(|_| out.len() == self.k) else {
            return Err(bad);
        };
        let values = format
            .ggml()
            .dequantize("row", &bytes, self.k)
            .map_err(|_| bad)?;
        out.copy_from_slice(&values);
        Ok(())
    }

    /// The whole matrix dequantized, row-major `[out, k]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.out * self.k];
        for (o, row) in w.chunks_exact_mut(self.k).enumerate() {
            // Every row exists and has length k.
            let _ = self.dequantize_row(o, row);
        }
        w
    }

    /// The matrix of rows `ids` (in that order), e.g. an LM head restricted to a vocabulary
    /// subset.
    pub fn select_rows(&self, ids: &[u32]) -> Result<QuantMatrix, ShapeError> {
        let mut m = QuantMatrix {
            parts: Vec::new(),
            out: 0,
            k: self.k,
        };
        // Runs of rows in one format, each becoming one part.
        let mut runs: Vec<(QuantFormat, Vec<u8>, usize)> = Vec::new();
        for &id in ids {
            let (format, bytes) = self.row(id as usize).ok_or(ShapeError::Operands {
                x: id as usize,
                y: 0,
                out: self.out,
                k: self.k,
            })?;
            match runs.last_mut() {
                Some((f, data, rows)) if *f == format => {
                    data.extend_from_slice(&bytes);
                    *rows += 1;
                }
                _ => runs.push((format, bytes, 1)),
            }
        }
        for (format, data, rows) in runs {
            m.push(format, data, rows)?;
        }
        Ok(m)
    }

    /// `y[j·out + o] = Σ_i x[j·k + i] · w[o, i]` (with `x` quantized per row to 8 bits) on the
    /// process-wide [`Pool`] with the detected [`Isa`].
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), ShapeError> {
        self.matmul_with(Isa::detect(), Pool::global(), x, y)
    }

    /// [`QuantMatrix::matmul`] with an explicit instruction set and pool.
    pub fn matmul_with(
        &self,
        isa: Isa,
        pool: &Pool,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), ShapeError> {
        let k = self.k;
        let b = x.len() / k.max(1);
        if !x.len().is_multiple_of(k) || b.checked_mul(self.out) != Some(y.len()) {
            return Err(ShapeError::Operands {
                x: x.len(),
                y: y.len(),
                out: self.out,
                k,
            });
        }
        // SAFETY: `x` holds `b` rows and `y` their `b · out` values (checked above).
        unsafe { self.quantized_product(isa, pool, x, y.as_mut_ptr()) };
        Ok(())
    }

    /// `x · wᵀ` as a new `[b, out]` buffer, written once by the kernel and never zero-filled
    /// first (an LM head's logits are ≈ 200 KB per row).
    pub fn product(&self, x: &[f32]) -> Result<Vec<f32>, ShapeError> {
        let k = self.k;
        let bad = ShapeError::Operands {
            x: x.len(),
            y: 0,
            out: self.out,
            k,
        };
        if !x.len().is_multiple_of(k) {
            return Err(bad);
        }
        let len = (x.len() / k).checked_mul(self.out).ok_or(bad)?;
        let mut y = Vec::with_capacity(len);
        // SAFETY: `x` holds whole rows and `y` has room for their `len` values.
        unsafe { self.quantized_product(Isa::detect(), Pool::global(), x, y.as_mut_ptr()) };
        // SAFETY: the product wrote every one of the `len` values (each unit stores all of its
        // valid columns for every row).
        unsafe { y.set_len(len) };
        Ok(y)
    }

    /// `x` quantized per row into this thread's buffer, then multiplied into `y`
    /// ([`QuantMatrix::matmul_q8`]); nothing for no rows.
    ///
    /// # Safety
    /// `x.len()` is a multiple of `k`, and `y` is valid for writes of `x.len() / k · out`
    /// floats that nothing else accesses during the call.
    unsafe fn quantized_product(&self, isa: Isa, pool: &Pool, x: &[f32], y: *mut f32) {
        if x.is_empty() {
            return;
        }
        ACTS.with_borrow_mut(|acts| {
            acts.quantize_into(x, self.k);
            // SAFETY: as this function's.
            unsafe { self.matmul_q8(isa, pool, acts, y) };
        });
    }

    /// `y = x · wᵀ` for rows already quantized into `acts` (by [`Q8Rows::quantize_into`] or
    /// a [`Q8Rows::writer`]), on the process-wide [`Pool`] with the detected [`Isa`]: the same
    /// bits as [`QuantMatrix::matmul`] on the rows they came from.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    pub(crate) fn matmul_quantized(&self, acts: &Q8Rows, y: &mut [f32]) -> Result<(), ShapeError> {
        if acts.k != self.k || acts.rows.checked_mul(self.out) != Some(y.len()) {
            return Err(ShapeError::Operands {
                x: acts.rows * acts.k,
                y: y.len(),
                out: self.out,
                k: self.k,
            });
        }
        if acts.rows > 0 {
            // SAFETY: `y` holds `rows · out` values (checked above).
            unsafe { self.matmul_q8(Isa::detect(), Pool::global(), acts, y.as_mut_ptr()) };
        }
        Ok(())
    }

    /// The product with already quantized rows (`acts.k() == self.k()`) into `y: [rows, out]`,
    /// every value of which it writes.
    ///
    /// # Safety
    /// `y` is valid for writes of `acts.rows · self.out` floats, and nothing else accesses
    /// them during the call.
    unsafe fn matmul_q8(&self, isa: Isa, pool: &Pool, acts: &Q8Rows, y: *mut f32) {
        let isa = isa.supported();
        let y_ptr = super::pool::Disjoint(y);
        // Units of 8 or 16 output rows inside one part ([`unit_rows`]), split as any
        // product's ([`Pool::run_product`]).
        let units: usize = self
            .parts
            .iter()
            .map(|p| p.rows.div_ceil(unit_rows(isa)))
            .sum();
        let outputs = self.parts.iter().map(|p| p.rows).sum();
        pool.run_product(outputs, units, &|range| {
            let mut first = 0;
            for part in &self.parts {
                let n = part.rows.div_ceil(unit_rows(isa));
                let (a, z) = (range.start.max(first), range.end.min(first + n));
                if a < z {
                    // SAFETY: tasks write disjoint output columns of `y`, which has
                    // `rows · out` elements (checked by the caller).
                    unsafe { part_units(isa, part, self, acts, a - first..z - first, y_ptr.ptr()) };
                }
                first += n;
            }
        });
    }
}

/// Output rows per unit of work: one panel, or two where the wide kernel takes them at once.
fn unit_rows(isa: Isa) -> usize {
    if qpanel::wide(isa) {
        2 * qpanel::ROWS
    } else {
        qpanel::ROWS
    }
}

/// Units `units` of `part` (rows `u · unit..(u + 1) · unit` of the part, [`unit_rows`]) against
/// every activation row.
///
/// # Safety
/// `y` holds `acts.rows · m.out` floats and no other thread writes these units' columns.
unsafe fn part_units(
    isa: Isa,
    part: &Part,
    m: &QuantMatrix,
    acts: &Q8Rows,
    units: std::ops::Range<usize>,
    y: *mut f32,
) {
    let (k, out) = (m.k, m.out);
    #[cfg(target_arch = "x86_64")]
    if qpanel::wide(isa) {
        // SAFETY: as this function's; the CPU has what the wide kernel needs.
        unsafe { wide_units(part, m, acts, units, y) };
        return;
    }
    let panel_bytes = k / SUB * qpanel::sub_bytes(part.format);
    let groups = row_groups(acts.rows, qpanel::max_acts(part.format));
    let mut tile = [[0f32; qpanel::ROWS]; qpanel::MAX_ACTS];
    for p in units {
        let panel = &part.data[p * panel_bytes..][..panel_bytes];
        let o = part.first + p * qpanel::ROWS;
        let valid = (part.rows - p * qpanel::ROWS).min(qpanel::ROWS);
        for rows in groups.clone() {
            let (j, count) = (rows.start, rows.len());
            // SAFETY: `isa` is supported, the part is in panels, `count ≤ max_acts`.
            unsafe { qpanel::tile(isa, part.format, panel, acts, j, count, &mut tile) };
            // SAFETY: as this function's; rows `j..j + count` exist.
            unsafe { store_tile(&tile[..count], y, out, j, o, valid) };
        }
    }
}

/// [`part_units`] for a panel part with the wide kernel: unit `u` is panels `2u` and `2u + 1`
/// (a part's odd last panel goes alone, the kernel reading it twice).
///
/// # Safety
/// As [`part_units`]; [`qpanel::wide`] holds and `part` is in panels.
#[cfg(target_arch = "x86_64")]
unsafe fn wide_units(
    part: &Part,
    m: &QuantMatrix,
    acts: &Q8Rows,
    units: std::ops::Range<usize>,
    y: *mut f32,
) {
    let (k, out, rows) = (m.k, m.out, qpanel::ROWS);
    let panel_bytes = k / SUB * qpanel::sub_bytes(part.format);
    let panels = part.rows.div_ceil(rows);
    let groups = row_groups(acts.rows, qpanel::WIDE_ACTS);
    let mut tile = [[0f32; 2 * qpanel::ROWS]; qpanel::WIDE_ACTS];
    for u in units {
        let (p, q) = (2 * u, (2 * u + 1).min(panels - 1));
        let a = &part.data[p * panel_bytes..][..panel_bytes];
        let b = &part.data[q * panel_bytes..][..panel_bytes];
        let o = part.first + p * rows;
        let valid = (part.rows - p * rows).min(if q > p { 2 * rows } else { rows });
        for group in groups.clone() {
            let (j, count) = (group.start, group.len());
            // SAFETY: the part is in panels, `count ≤ WIDE_ACTS`, the caller checked the CPU.
            unsafe { qpanel::wide_tile(part.format, a, b, acts, j, count, &mut tile) };
            // SAFETY: as this function's; rows `j..j + count` exist.
            unsafe { store_tile(&tile[..count], y, out, j, o, valid) };
        }
    }
}

/// The first `valid` values of each row of `tile` into rows `j..` of `y` (`out` columns), from
/// column `o` on.
///
/// # Safety
/// `y` holds rows `j..j + tile.len()` of `out` floats, `o + valid ≤ out`, and no other thread
/// writes those columns.
unsafe fn store_tile<const N: usize>(
    tile: &[[f32; N]],
    y: *mut f32,
    out: usize,
    j: usize,
    o: usize,
    valid: usize,
) {
    for (i, values) in tile.iter().enumerate() {
        // SAFETY: row `j + i` of `y` has `out` columns from `o` on, `valid` of them ours.
        let dst = unsafe { y.add((j + i) * out + o) };
        if valid == N {
            // A whole tile row: a copy of known length, inlined (not a `memmove` call per row).
            // SAFETY: as above, with `valid == N`.
            unsafe { dst.cast::<[f32; N]>().write_unaligned(*values) };
        } else {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts_mut(dst, valid) }.copy_from_slice(&values[..valid]);
        }
    }
}

thread_local! {
    /// The quantized activations of the current product (reused: no allocation per call).
    static ACTS: std::cell::RefCell<Q8Rows> = std::cell::RefCell::new(Q8Rows::default());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_inputs::{isas, same_bits, values};

    fn blocks(format: QuantFormat, blocks: usize, seed: u32) -> Vec<u8> {
        super::super::qformat::test_blocks(format, blocks, seed)
    }

    fn product(isa: Isa, pool: &Pool, m: &QuantMatrix, x: &[f32]) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.len() / m.k() * m.out()];
        m.matmul_with(isa, pool, x, &mut y).unwrap();
        y
    }

    /// Close to the exact product of the dequantized weights and the 8-bit activations, and
    /// the same bits on every instruction set.
    #[test]
    fn every_format_matches_the_dequantized_product() {
        let pool = Pool::new(3);
        for format in QuantFormat::ALL {
            let k = 2 * format.block_len();
            for out in [1, 2, 5, 16] {
                let m = QuantMatrix::new(
                    format,
                    blocks(format, out * k / format.block_len(), 3),
                    out,
                    k,
                )
                .unwrap();
                assert_eq!(
                    m.bytes(),
                    out.div_ceil(8) * (k / SUB) * qpanel::sub_bytes(format)
                );
                let w = m.dequantize();
                let bytes = blocks(format, out * k / format.block_len(), 3);
                let want_w = format.ggml().dequantize("t", &bytes, out * k).unwrap();
                assert_eq!(w, want_w);
                assert_eq!(w.len(), want_w.len());
                for b in [1, 2, 3, 5, 9] {
                    let x = values(b * k, 7 + b as u32);
                    let mut acts = Q8Rows::default();
                    acts.quantize_into(&x, k);
                    let reference = product(Isa::Portable, &pool, &m, &x);
                    for j in 0..b {
                        for o in 0..out {
                            let exact: f64 = (0..k)
                                .map(|i| {
                                    let xq = acts.q[j * k + i] as f64
                                        * acts.d[j * (k / SUB) + i / SUB] as f64;
                                    w[o * k + i] as f64 * xq
                                })
                                .sum();
                            let mag: f64 = (0..k)
                                .map(|i| (w[o * k + i] as f64 * x[j * k + i] as f64).abs())
                                .sum();
                            let got = reference[j * out + o] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-5 * (1.0 + mag),
                                "{format} b={b} ({j},{o}): {got} vs {exact}"
                            );
                        }
                    }
                    for isa in isas() {
                        let got = product(isa, &pool, &m, &x);
                        let same = same_bits(&got, &reference);
                        assert!(same, "{isa:?} {format} out={out} b={b}");
                    }
                }
            }
        }
    }

    /// A block's rows equal the rows alone, bit for bit, for every block size and thread count.
    #[test]
    fn rows_are_batch_invariant() {
        let one = Pool::new(1);
        let three = Pool::new(3);
        for format in QuantFormat::ALL {
            let k = 3 * 256;
            let out = 37;
            let m = QuantMatrix::new(
                format,
                blocks(format, out * k / format.block_len(), 5),
                out,
                k,
            )
            .unwrap();
            for isa in isas() {
                for b in [2, 3, 7, 8, 16, 33] {
                    let x = values(b * k, 11 + b as u32);
                    let block = product(isa, &three, &m, &x);
                    for j in 0..b {
                        let alone = product(isa, &one, &m, &x[j * k..(j + 1) * k]);
                        let same = same_bits(&block[j * out..(j + 1) * out], &alone);
                        assert!(same, "{isa:?} {format} b={b} row {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn stacked_parts_and_selected_rows() {
        let k = 256;
        let pool = Pool::new(2);
        let a = blocks(QuantFormat::Q4K, 3, 1);
        let b = blocks(QuantFormat::Q6K, 2, 2);
        let mut m = QuantMatrix::new(QuantFormat::Q4K, a.clone(), 3, k).unwrap();
        m.push(QuantFormat::Q6K, b.clone(), 2).unwrap();
        assert_eq!(
            (m.out(), m.formats()),
            (5, vec![QuantFormat::Q4K, QuantFormat::Q6K])
        );
        let only_a = QuantMatrix::new(QuantFormat::Q4K, a, 3, k).unwrap();
        let only_b = QuantMatrix::new(QuantFormat::Q6K, b, 2, k).unwrap();
        let x = values(2 * k, 4);
        let (y, ya, yb) = (
            product(Isa::detect(), &pool, &m, &x),
            product(Isa::detect(), &pool, &only_a, &x),
            product(Isa::detect(), &pool, &only_b, &x),
        );
        for j in 0..2 {
            assert_eq!(y[j * 5..j * 5 + 3], ya[j * 3..j * 3 + 3]);
            assert_eq!(y[j * 5 + 3..j * 5 + 5], yb[j * 2..j * 2 + 2]);
        }
        let picked = m.select_rows(&[4, 0]).unwrap();
        let yp = product(Isa::detect(), &pool, &picked, &x);
        for j in 0..2 {
            assert_eq!([yp[j * 2], yp[j * 2 + 1]], [y[j * 5 + 4], y[j * 5]]);
        }
        assert!(m.select_rows(&[5]).is_err());
    }

    /// `product` gives `matmul`'s values in a buffer of its own, every one written.
    #[test]
    fn product_equals_matmul() {
        let (k, out) = (64, 21);
        let m = QuantMatrix::new(
            QuantFormat::Q4_1,
            blocks(QuantFormat::Q4_1, out * 2, 9),
            out,
            k,
        )
        .unwrap();
        for b in [0, 1, 3, 9] {
            let x = values(b * k, 5 + b as u32);
            let got = m.product(&x).unwrap();
            let mut want = vec![f32::NAN; b * out];
            m.matmul(&x, &mut want).unwrap();
            assert!(same_bits(&got, &want), "b={b}");
        }
        assert!(m.product(&[0.0; 65]).is_err());
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        assert!(QuantMatrix::new(QuantFormat::Q4_1, vec![0; 19], 1, 32).is_err());
        assert!(QuantMatrix::new(QuantFormat::Q4K, vec![0; 144], 1, 128).is_err());
        let m = QuantMatrix::new(QuantFormat::Q4_1, vec![0; 40], 2, 32).unwrap();
        let mut y = vec![0f32; 2];
        assert!(m.matmul(&[0.0; 31], &mut y).is_err());
        assert!(m.matmul(&[0.0; 32], &mut y[..1]).is_err());
        assert!(m.matmul(&[0.0; 32], &mut y).is_ok());
    }
}
