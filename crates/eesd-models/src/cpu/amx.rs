//! Intel AMX tiles (Sapphire Rapids and later Xeons) for the quantized kernel's integer dot
//! products: detection, the process's permission, the tile configuration and the few tile
//! instructions the kernel uses.
//!
//! Why: one `tdpbssd` multiplies a tile of up to 16 activation rows × 32 signed 8-bit codes by
//! the 32 codes of 16 outputs, 8,192 exact multiply-adds into 16 × 16 32-bit sums, ≈ 5 ns on
//! one core of the project's Xeon host (3.3 TOP/s), where the AVX-512 VNNI kernel issues 128
//! `vpdpbusd` and as many broadcasts for the same sums (the host's two cores together peak at
//! ≈ 1.9 TOP/s with `vpdpbusd`). The sums are exact integers either way and the float work
//! after them is the VNNI kernel's, lane for lane, so the results are the same bits.
//!
//! Linux hands the tile state to a process only when it asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`enabled`] asks once. The tile
//! instructions are inline assembly: Rust's AMX intrinsics are not stable.

use std::sync::OnceLock;

/// Whether the quantized kernel may use AMX-INT8 tiles: the CPU has AMX-TILE and AMX-INT8,
/// Linux granted this process the tile state, and `EESD_AMX` is not `0` (to compare the
/// kernels on one machine).
pub(crate) fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("EESD_AMX").as_deref() != Ok("0") && permitted())
}

/// CPUID reports AMX-TILE and AMX-INT8 and Linux grants the tile data state.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn permitted() -> bool {
    // CPUID leaf 7, sub-leaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    #[allow(unused_unsafe)] // `__cpuid_count` is safe in newer Rust, unsafe in older.
    // SAFETY: CPUID leaf 7 exists on every x86-64 CPU that runs this build (it reports zeros
    // where a feature is absent).
    let leaf = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
    if leaf.edx & (0b11 << 24) != 0b11 << 24 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request for a permission; it reads and writes no memory of ours.
    let status = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    status == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn permitted() -> bool {
    false
}

/// Activation rows one tile holds.
pub(crate) const ROWS: usize = 16;

/// The tile configuration for `rows` (1..=16) activation rows: `tmm0` to `tmm3` hold sums
/// (`rows` × 16 32-bit), `tmm4` and `tmm5` activation codes (`rows` × 32 bytes), `tmm6` and
/// `tmm7` one sub-block of 16 outputs' codes (8 × 64 bytes): several of each so that one
/// sub-block's product runs while the previous ones' sums are stored and scaled.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(crate) struct Config([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl Config {
    pub(crate) fn for_rows(rows: usize) -> Config {
        debug_assert!((1..=ROWS).contains(&rows));
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1: 8 tiles of up to 16 rows × 64 bytes
        let rows = rows as u8;
        // Bytes 16..48: bytes per row of each tile (u16); bytes 48..64: rows of each tile.
        let shapes = [(64u16, rows); 4]
            .into_iter()
            .chain([(32, rows); 2])
            .chain([(64, 8); 2]);
        for (tile, (bytes, rows)) in shapes.enumerate() {
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&bytes.to_le_bytes());
            c[48 + tile] = rows;
        }
        Config(c)
    }

    /// Makes this the calling thread's tile configuration (zeroing every tile).
    ///
    /// # Safety
    /// [`enabled`] returned true.
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller checked that the CPU has AMX and the process the tile state;
        // the configuration is valid for palette 1.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly))
        };
    }
}

/// Returns the calling thread's tiles to their initial state (cheaper to save at a context
/// switch; a later use loads a [`Config`] again).
///
/// # Safety
/// [`enabled`] returned true.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn release() {
    // SAFETY: as the caller's.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// Tile `T` from rows `stride` bytes apart at `from`.
///
/// # Safety
/// A [`Config`] is loaded; `from` is readable for the tile's rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn load<const T: u8>(from: *const u8, stride: usize) {
    // SAFETY: as the caller's.
    unsafe {
        std::arch::asm!(
            "tileloadd tmm{t}, [{from} + {stride} * 1]",
            t = const T,
            from = in(reg) from,
            stride = in(reg) stride,
            options(nostack, readonly),
        )
    };
}

/// Tile `T` into rows `stride` bytes apart at `to`.
///
/// # Safety
/// A [`Config`] is loaded; `to` is writable for the tile's rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn store<const T: u8>(to: *mut u8, stride: usize) {
    // SAFETY: as the caller's.
    unsafe {
        std::arch::asm!(
            "tilestored [{to} + {stride} * 1], tmm{t}",
            t = const T,
            to = in(reg) to,
            stride = in(reg) stride,
            options(nostack),
        )
    };
}

/// Tile `T` = 0.
///
/// # Safety
/// A [`Config`] is loaded.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn zero<const T: u8>() {
    // SAFETY: as the caller's.
    unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) };
}

/// `C[m][o] += Σ_e A[m][4i + e] · B[i][4o + e]` over `i` (signed bytes, exact 32-bit sums).
///
/// # Safety
/// A [`Config`] is loaded whose shapes match.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn dot<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: as the caller's.
    unsafe {
        std::arch::asm!(
            "tdpbssd tmm{c}, tmm{a}, tmm{b}",
            c = const C,
            a = const A,
            b = const B,
            options(nostack, nomem),
        )
    };
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// One tile product against the definition, where the machine has AMX.
    #[test]
    fn a_tile_product_is_the_exact_integer_product() {
        if !enabled() {
            eprintln!("no AMX here: skipped");
            return;
        }
        let rows = 11;
        let a: Vec<i8> = (0..rows * 32).map(|i| (i * 37 % 256) as u8 as i8).collect();
        let b: Vec<i8> = (0..8 * 64).map(|i| (i * 91 % 256) as u8 as i8).collect();
        let mut c = [0i32; ROWS * 16];
        // SAFETY: `enabled`; the buffers hold the configured tiles' rows.
        unsafe {
            Config::for_rows(rows).load();
            zero::<1>();
            load::<4>(a.as_ptr().cast(), 32);
            load::<7>(b.as_ptr().cast(), 64);
            dot::<1, 4, 7>();
            store::<1>(c.as_mut_ptr().cast(), 64);
            release();
        }
        for m in 0..rows {
            for o in 0..16 {
                let want: i32 = (0..32)
                    .map(|i| a[m * 32 + i] as i32 * b[(i / 4) * 64 + 4 * o + i % 4] as i32)
                    .sum();
                assert_eq!(c[m * 16 + o], want, "({m}, {o})");
            }
        }
    }
}
