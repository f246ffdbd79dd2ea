//! Compiling plain-Rust loops for AVX-512 and AVX2 as well as the baseline, chosen at run time.
//!
//! The row operations and attention are written with ordinary f32 arithmetic in an explicit
//! order. Rust never fuses a multiply and an add on its own, so the AVX-512 and AVX2 builds
//! compute exactly what the baseline build computes, only with wider registers: the choice
//! changes speed, not results.

/// Defines `pub(crate) fn $name($args) -> $ret` that runs `$body` compiled with AVX-512 (F, BW,
/// VL, DQ), or else AVX2 and FMA, enabled when the CPU has them (and
/// [`Isa::detect`](super::Isa::detect) allows), else the baseline build. (AVX-512: the SiLU's
/// `exp` and division in 16 lanes; SwiGLU of 4 rows 0.28–0.32 → 0.23 ms a pass on the Xeon.)
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                let isa = $crate::cpu::Isa::detect();
                if isa.avx512_bw_vl() && std::arch::is_x86_feature_detected!("avx512dq") {
                    // SAFETY: the CPU has every feature the build enables (AVX-512 F, BW, VL
                    // and DQ; AVX2 and FMA come with `Isa::Avx512`).
                    return unsafe { avx512($($arg),*) };
                }
                if isa != $crate::cpu::Isa::Portable {
                    // SAFETY: `detect` reports AVX2 and FMA only when the CPU has them.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
