//! Compiling plain-Rust loops for AVX2 as well as the baseline, chosen at run time.
//!
//! The row operations and attention are written with ordinary f32 arithmetic in an explicit
//! order. Rust never fuses a multiply and an add on its own, so the AVX2 build computes exactly
//! what the baseline build computes, only with wider registers: the choice changes speed, not
//! results.

/// Defines `pub(crate) fn $name($args) -> $ret` that runs `$body` compiled with AVX2 and FMA
/// enabled when the CPU has them (and [`Isa::detect`](super::Isa::detect) allows), else the
/// baseline build.
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    imp($($arg),*)
                }
                if $crate::cpu::Isa::detect() != $crate::cpu::Isa::Portable {
                    // SAFETY: `detect` reports AVX2 and FMA only when the CPU has them.
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
