//! Numerics shared by the sampler and the CPU kernels (eesd-models uses them from here, the
//! lower crate of the two).

/// `e^x` to about 2 ulp, branch-free so that loops over it vectorise (Cody–Waite reduction
/// `x = n·ln2 + r`, a degree-6 polynomial for `e^r`, `2^n` through the exponent bits).
/// Saturates to ≈ 1.2e-38 (2^−126) below −87.3 and to ∞ above 88.7; NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest through the 1.5·2^23 trick (no rounding instruction needed).
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    // `shifted` holds n = round(x·log2 e) in its low mantissa bits, so 2^n is built with integer
    // vector operations: a float-to-int `as` cast would be scalar (it saturates and maps NaN).
    let shifted = x * LOG2E + SHIFT;
    let n = shifted - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67 + r * (0.041_666_38 + r * (0.008_333_6 + r * 0.001_388_9)))));
    let scale = f32::from_bits(
        (shifted
            .to_bits()
            .wrapping_sub(SHIFT.to_bits())
            .wrapping_add(127))
            << 23,
    );
    let y = p * scale;
    // clamp() keeps NaN; the exponent trick would turn it into a number.
    if x.is_nan() { x } else { y }
}

/// The sum of `values` in f64, in eight interleaved partial sums (element `i` goes to sum
/// `i % 8`, the sums added in order at the end): one fixed order, and eight independent chains
/// where one would wait on each addition.
pub fn sum_f64(values: &[f32]) -> f64 {
    let mut sums = [0f64; 8];
    let mut chunks = values.chunks_exact(8);
    for chunk in &mut chunks {
        for (s, &v) in sums.iter_mut().zip(chunk) {
            *s += f64::from(v);
        }
    }
    for (s, &v) in sums.iter_mut().zip(chunks.remainder()) {
        *s += f64::from(v);
    }
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_f64_adds_every_value() {
        for n in [0, 1, 7, 8, 9, 100, 49_152] {
            let v: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.25).collect();
            let want: f64 = v.iter().map(|&x| f64::from(x)).sum();
            assert!((sum_f64(&v) - want).abs() <= 1e-9 * want.max(1.0), "{n}");
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-200.0) < 1.3e-38 && exp(-1e30) < 1.3e-38);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn exp_builds_two_to_the_n_as_a_cast_would() {
        // The exponent bits taken from the shifted sum equal `n as i32` for every n the
        // clamped range gives: the same bits as the earlier (scalar) cast.
        let cast = |x: f32| {
            let x = x.clamp(-87.3, 88.7);
            let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
            f32::from_bits(((n as i32 + 127) as u32) << 23)
        };
        let mut x = -100.0f32;
        while x < 100.0 {
            let shifted = x.clamp(-87.3, 88.7) * std::f32::consts::LOG2_E + 12_582_912.0;
            let bits = shifted.to_bits().wrapping_sub(12_582_912f32.to_bits());
            assert_eq!(f32::from_bits(bits.wrapping_add(127) << 23), cast(x), "{x}");
            x += 0.0071;
        }
    }
}
