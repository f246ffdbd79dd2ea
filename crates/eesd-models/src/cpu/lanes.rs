//! Registers of f32 lanes, and weight loads (f32, f16, bf16) that widen into them.
//!
//! Every implementation computes the same thing per lane: a fused multiply-add with one
//! rounding. [`Soft`] does it in portable Rust with [`f32::mul_add`], so the portable path gives
//! bit-identical results to the SIMD ones and serves as their reference in tests.

use half::{bf16, f16};

/// A register of `WIDTH` f32 lanes.
pub(crate) trait Lanes: Copy {
    /// Lanes per register.
    const WIDTH: usize;
    /// All lanes zero.
    unsafe fn zero() -> Self;
    /// `WIDTH` f32 values from `p` (unaligned).
    unsafe fn load(p: *const f32) -> Self;
    /// The value at `p` in every lane.
    unsafe fn splat(p: *const f32) -> Self;
    /// Stores the lanes to `p` (unaligned).
    unsafe fn store(self, p: *mut f32);
    /// Stores the lanes to `p`, aligned to the register's size, past the caches (a
    /// non-temporal store: no read of the line first; [`Lanes::store`] where there is none).
    /// The storing thread fences before others read the values.
    #[inline(always)]
    unsafe fn store_stream(self, p: *mut f32) {
        unsafe { self.store(p) }
    }
    /// `a · b + acc` per lane with one rounding.
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self;
    /// `WIDTH` weights from `p` (unaligned), widened to f32 (exactly: every f16 and bf16 value
    /// is an f32 value).
    unsafe fn load_weights<E: WeightElement>(p: *const E) -> Self;
    /// Hints that the cache line at `p` is read soon (into L1).
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    /// Hints that the cache line at `p` is read soon, into L2 only: for data that would evict
    /// from L1 what is being read now.
    #[inline(always)]
    unsafe fn prefetch_l2(_p: *const u8) {}
    /// [`Lanes::prefetch`] where `to_l1`, else [`Lanes::prefetch_l2`].
    #[inline(always)]
    unsafe fn prefetch_into(p: *const u8, to_l1: bool) {
        // SAFETY: prefetches never fault.
        unsafe {
            match to_l1 {
                true => Self::prefetch(p),
                false => Self::prefetch_l2(p),
            }
        }
    }
}

/// A weight element type the kernels read: `f32`, [`half::f16`] or [`half::bf16`].
pub trait WeightElement:
    Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// The nearest value to `v` (round to nearest even).
    fn from_f32(v: f32) -> Self;
    /// `dst[i] = from_f32(src[i])` (equal lengths), with the CPU's conversion instructions
    /// where it has them: the same values, without a call per element.
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(s);
        }
    }
}

pub(crate) mod sealed {
    /// The storage format of a weight element, known at compile time.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Kind {
        F32,
        F16,
        Bf16,
    }

    pub trait Sealed {
        const KIND: Kind;
    }
    impl Sealed for f32 {
        const KIND: Kind = Kind::F32;
    }
    impl Sealed for half::f16 {
        const KIND: Kind = Kind::F16;
    }
    impl Sealed for half::bf16 {
        const KIND: Kind = Kind::Bf16;
    }
}

impl WeightElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl WeightElement for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn from_f32_slice(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

impl WeightElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// `N` lanes in portable Rust.
#[derive(Clone, Copy)]
pub(crate) struct Soft<const N: usize>([f32; N]);

impl<const N: usize> Lanes for Soft<N> {
    const WIDTH: usize = N;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Soft([0.0; N])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees N readable values at p.
        Soft(unsafe { std::ptr::read_unaligned(p.cast::<[f32; N]>()) })
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> Self {
        Soft([unsafe { *p }; N])
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { std::ptr::write_unaligned(p.cast::<[f32; N]>(), self.0) }
    }
    #[inline(always)]
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
        let mut lanes = acc.0;
        for ((lane, a), b) in lanes.iter_mut().zip(a.0).zip(b.0) {
            *lane = a.mul_add(b, *lane);
        }
        Soft(lanes)
    }
    #[inline(always)]
    unsafe fn load_weights<E: WeightElement>(p: *const E) -> Self {
        // SAFETY: the caller guarantees N readable values at p.
        let raw = unsafe { std::ptr::read_unaligned(p.cast::<[E; N]>()) };
        Soft(raw.map(E::to_f32))
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! AVX2 (+FMA, F16C) and AVX-512F registers.
    use super::sealed::Kind;
    use super::{Lanes, WeightElement};
    use std::arch::x86_64::*;

    impl Lanes for __m256 {
        const WIDTH: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> Self {
            unsafe { _mm256_broadcast_ss(&*p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm256_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn store_stream(self, p: *mut f32) {
            unsafe { _mm256_stream_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
            unsafe { _mm256_fmadd_ps(a, b, acc) }
        }
        /// f16 through F16C; bf16 is the upper half of an f32: widen to 32 bits and shift.
        #[inline(always)]
        unsafe fn load_weights<E: WeightElement>(p: *const E) -> Self {
            unsafe {
                match E::KIND {
                    Kind::F32 => _mm256_loadu_ps(p.cast()),
                    Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    Kind::Bf16 => {
                        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
        #[inline(always)]
        unsafe fn prefetch_l2(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
        }
    }

    impl Lanes for __m512 {
        const WIDTH: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> Self {
            unsafe { _mm512_set1_ps(*p) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn store_stream(self, p: *mut f32) {
            unsafe { _mm512_stream_ps(p, self) }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
            unsafe { _mm512_fmadd_ps(a, b, acc) }
        }
        #[inline(always)]
        unsafe fn load_weights<E: WeightElement>(p: *const E) -> Self {
            unsafe {
                match E::KIND {
                    Kind::F32 => _mm512_loadu_ps(p.cast()),
                    Kind::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                    Kind::Bf16 => {
                        let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
        #[inline(always)]
        unsafe fn prefetch_l2(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
        }
    }
}
