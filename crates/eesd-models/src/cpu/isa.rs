//! Which SIMD instruction set the kernels use, chosen once at run time.

use std::sync::OnceLock;

/// A SIMD instruction set the CPU kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// AVX-512F: 16 f32 lanes, 32 registers.
    Avx512,
    /// AVX2 with FMA and F16C: 8 f32 lanes, 16 registers.
    Avx2,
    /// Portable Rust (8 lanes emulated with `f32::mul_add`): bit-identical to AVX2, slow.
    Portable,
}

impl Isa {
    /// The widest set this CPU supports, unless `EESD_ISA` (`avx512`, `avx2` or `portable`)
    /// asks for a narrower one (to compare paths on one machine).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::best_supported();
            match std::env::var("EESD_ISA").ok().as_deref() {
                Some("portable") => Isa::Portable,
                Some("avx2") if best != Isa::Portable => Isa::Avx2,
                _ => best,
            }
        })
    }

    /// The widest set this CPU supports.
    pub fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// This set if the CPU supports it, else the best one it has below it.
    pub fn supported(self) -> Isa {
        let best = Isa::best_supported();
        match (self, best) {
            (Isa::Avx512, best) => best,
            (Isa::Avx2, Isa::Portable) => Isa::Portable,
            (isa, _) => isa,
        }
    }

    /// Whether this set is AVX-512 on this CPU together with its byte/word and vector-length
    /// extensions (BW, VL), which every 512-bit build beyond F enables (the quantized kernel's,
    /// the row operations'); each adds what else it needs.
    pub(crate) fn avx512_bw_vl(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            self == Isa::Avx512 && self.supported() == self && has!("avx512bw") && has!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }

    /// f32 lanes per register.
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 | Isa::Portable => 8,
        }
    }

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}
