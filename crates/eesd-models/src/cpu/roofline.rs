//! Measuring this machine's roofline: read bandwidth from memory, the FMA peak and the 8-bit
//! integer multiply-add peak, on the same threads the kernels use; the peaks with the kernels'
//! instruction set, the bandwidth with whichever of its load widths reads fastest.
//!
//! A forward pass over `b` rows must stream the weights once (`bytes`) and do about
//! `2 · params · b` operations, in floats or, for natively quantized matrices, in 8-bit
//! integer products; at best it takes `max(bytes / bandwidth, flops / FMA peak + int8 ops /
//! int8 peak)` (both kinds of arithmetic share the vector units, so their times add). Benchmarks
//! report measured time against that bound (`efficiency = roofline / measured`), so a reader
//! sees how far each block size is from the hardware rather than from a previous version.
//!
//! Beside the limits, the probe times a cache line's round trip between two threads. On a
//! virtual machine the same vCPUs may sit on one core complex (shared L3, tens of ns) or on two
//! (hundreds of ns, a memory link each): the read bandwidth and every kernel that shares data
//! between threads change with it, so reports name which placement their figures came from.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::huge_pages::HugeBuf;
use super::isa::Isa;
use super::lanes::{Lanes, Soft};
use super::pool::Pool;

/// Bytes streamed by the bandwidth probe: far larger than any last-level cache.
const PROBE_BYTES: usize = 512 << 20;

/// A machine's measured limits.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Roofline {
    /// Instruction set of the FMA probe (the one the kernels use).
    pub isa: Isa,
    /// Threads used (the kernels' pool).
    pub threads: usize,
    /// Read bandwidth from memory, GB/s (10⁹ bytes), best of several passes and of the load
    /// widths the CPU has.
    pub bandwidth_gb_s: f64,
    /// Fused multiply-add peak, GFLOP/s (one FMA = 2 flops), best of several runs.
    pub fma_gflop_s: f64,
    /// 8-bit integer multiply-add peak, GOP/s (one multiply-add = 2 ops), with the quantized
    /// kernels' instruction (AVX2 `vpmaddubsw`: 32 products summed in pairs; with AVX-512
    /// VNNI `vpdpbusd` on 512 bits: 64 products summed in fours), best of several runs.
    pub int8_gop_s: f64,
    /// Round trip of one cache line between two spinning threads, ns (best of a few batches;
    /// `None` with fewer than two cores or when the second thread never ran alongside).
    pub core_to_core_ns: Option<f64>,
}

impl Roofline {
    /// Measures bandwidth and FMA peak on the process-wide pool: the peaks with the detected
    /// ISA, the bandwidth at each of its load widths (about a second, and 512 MiB of memory for
    /// the duration). Each is the best of many short runs, so that a host stealing time now and
    /// then does not lower the bound.
    pub fn measure() -> Roofline {
        let pool = Pool::global();
        let isa = Isa::detect();
        Roofline {
            isa,
            threads: pool.threads(),
            bandwidth_gb_s: load_widths(isa)
                .map(|width| read_bandwidth(pool, width, PROBE_BYTES, 10))
                .fold(0.0, f64::max),
            fma_gflop_s: fma_peak(pool, isa, 20),
            int8_gop_s: int8_peak(pool, isa, 20),
            core_to_core_ns: core_to_core_round_trip(),
        }
    }

    /// The higher bandwidth and the higher peak of two measurements of the same machine (each
    /// probe can only be slowed down by other work on the host, never sped up), with the
    /// core-to-core round trip measured beside the higher bandwidth (the two go together when
    /// the host moves its vCPUs).
    pub fn best_with(&self, other: &Roofline) -> Roofline {
        let faster = if other.bandwidth_gb_s > self.bandwidth_gb_s {
            other
        } else {
            self
        };
        Roofline {
            bandwidth_gb_s: faster.bandwidth_gb_s,
            fma_gflop_s: self.fma_gflop_s.max(other.fma_gflop_s),
            int8_gop_s: self.int8_gop_s.max(other.int8_gop_s),
            core_to_core_ns: faster.core_to_core_ns,
            ..*self
        }
    }

    /// The least time (seconds) in which this machine can read `bytes` from memory and do
    /// `flops` floating-point and `int8_ops` 8-bit integer operations, overlapping memory and
    /// arithmetic perfectly.
    pub fn seconds(&self, bytes: f64, flops: f64, int8_ops: f64) -> f64 {
        let (memory, compute) = self.times(bytes, flops, int8_ops);
        memory.max(compute)
    }

    /// Which limit binds: `"memory"` or `"compute"`.
    pub fn bound(&self, bytes: f64, flops: f64, int8_ops: f64) -> &'static str {
        let (memory, compute) = self.times(bytes, flops, int8_ops);
        if memory >= compute {
            "memory"
        } else {
            "compute"
        }
    }

    /// Seconds to read `bytes` and, separately, to do the arithmetic.
    fn times(&self, bytes: f64, flops: f64, int8_ops: f64) -> (f64, f64) {
        (
            bytes / (self.bandwidth_gb_s * 1e9),
            flops / (self.fma_gflop_s * 1e9) + int8_ops / (self.int8_gop_s * 1e9),
        )
    }
}

/// One line for reports: the CPU, threads, ISA, bandwidth and peak.
impl std::fmt::Display for Roofline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} threads, {}): read {:.1} GB/s, FMA peak {:.0} GFLOP/s, int8 peak {:.0} GOP/s",
            cpu_name(),
            self.threads,
            self.isa.name(),
            self.bandwidth_gb_s,
            self.fma_gflop_s,
            self.int8_gop_s
        )?;
        if let Some(ns) = self.core_to_core_ns {
            write!(f, ", core-to-core round trip {ns:.0} ns")?;
        }
        Ok(())
    }
}

/// Round trip (ns) of one cache line between the calling thread and a second thread, both
/// spinning: the best average over a few batches of trips, so that a preempted batch does not
/// count. `None` with fewer than two cores, or when the trips take far too long (the two threads
/// sharing one core).
pub fn core_to_core_round_trip() -> Option<f64> {
    const TRIPS: u64 = 5_000;
    const BATCHES: usize = 5;
    const GIVE_UP: Duration = Duration::from_millis(200);
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        return None;
    }
    /// A counter alone on its cache line (and the adjacent-line prefetch's pair).
    #[repr(align(128))]
    struct Line(AtomicU64);
    let line = Line(AtomicU64::new(0));
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|scope| {
        // The echo: answers every odd value with the next even one.
        scope.spawn(|| {
            let mut expect = 1;
            while !stop.load(Ordering::Relaxed) {
                if line.0.load(Ordering::Acquire) == expect {
                    line.0.store(expect + 1, Ordering::Release);
                    expect += 2;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let mut best = f64::INFINITY;
        let mut value = 0;
        'batches: for _ in 0..BATCHES {
            let start = Instant::now();
            for _ in 0..TRIPS {
                line.0.store(value + 1, Ordering::Release);
                value += 2;
                while line.0.load(Ordering::Acquire) != value {
                    if started.elapsed() > GIVE_UP {
                        best = f64::INFINITY;
                        break 'batches;
                    }
                    std::hint::spin_loop();
                }
            }
            best = best.min(start.elapsed().as_secs_f64() * 1e9 / TRIPS as f64);
        }
        stop.store(true, Ordering::Relaxed);
        best.is_finite().then_some(best)
    })
}

/// The CPU's model name (`/proc/cpuinfo` on Linux), for reports.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|n| n.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Best GB/s over `passes` reads of a `bytes`-long buffer split across the pool.
pub fn read_bandwidth(pool: &Pool, isa: Isa, bytes: usize, passes: usize) -> f64 {
    let n = bytes / 4;
    // On the pages the weights use (huge pages where offered), so that the bound and the
    // kernels pay the same address translation.
    let buffer = HugeBuf::filled(n, 1f32);
    // Each thread reads its own contiguous share, in one task per thread.
    let tasks = pool.threads();
    let share = n.div_ceil(tasks).div_ceil(64) * 64;
    let mut best = 0f64;
    for _ in 0..passes {
        let start = Instant::now();
        pool.run(tasks, &|t| {
            let part = &buffer[(t * share).min(n)..((t + 1) * share).min(n)];
            std::hint::black_box(sum(isa, part));
        });
        best = best.max(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// The instruction sets whose loads the bandwidth probe streams with: `isa`, and AVX2 beside
/// AVX-512. The bound is the machine's, whatever load width reaches it: on a 2-core Intel Xeon
/// (family 6 model 167 under KVM) the 512-bit probe read 28–29 GB/s where the 256-bit one read
/// 32–37 in the same build, and both widths of the f32 kernel streamed 27–30 GB/s
/// (docs/results.md), so the 512-bit figure alone overstated every efficiency there.
fn load_widths(isa: Isa) -> impl Iterator<Item = Isa> {
    let narrower = (isa == Isa::Avx512).then_some(Isa::Avx2);
    std::iter::once(isa).chain(narrower)
}

/// Best GFLOP/s over `runs` of register-only FMA chains on every thread of the pool.
pub fn fma_peak(pool: &Pool, isa: Isa, runs: usize) -> f64 {
    peak(pool, runs, &|steps| fma_chains(isa, steps))
}

/// Best GOP/s over `runs` of register-only 8-bit multiply-add chains on every thread of the
/// pool.
pub fn int8_peak(pool: &Pool, isa: Isa, runs: usize) -> f64 {
    peak(pool, runs, &|steps| int8_chains(isa, steps))
}

/// Best G-operations per second over `runs` of `chains` (which runs a number of steps and
/// returns the operations done) on every thread of the pool at once.
fn peak(pool: &Pool, runs: usize, chains: &(dyn Fn(usize) -> usize + Sync)) -> f64 {
    const STEPS: usize = 2_000_000;
    let tasks = pool.threads();
    let mut best = 0f64;
    for _ in 0..runs {
        let start = Instant::now();
        let ops_per_task = std::sync::atomic::AtomicUsize::new(0);
        pool.run(tasks, &|_| {
            ops_per_task.store(chains(STEPS), std::sync::atomic::Ordering::Relaxed);
        });
        let ops = (ops_per_task.into_inner() * tasks) as f64;
        best = best.max(ops / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Runs 8-bit multiply-add chains for `steps` steps with the quantized kernels' instructions
/// and returns the operations done.
fn int8_chains(isa: Isa, steps: usize) -> usize {
    match isa.supported() {
        // SAFETY: `wide` checked every feature the probe uses.
        #[cfg(target_arch = "x86_64")]
        isa if super::qpanel::wide(isa) => unsafe { x86::dpbusd_chains(steps) },
        // SAFETY: the CPU supports AVX2 (AVX-512 machines without VNNI run the AVX2 kernels).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::maddubs_chains(steps) },
        _ => scalar_int8_chains(steps),
    }
}

/// 12 chains of scalar 32-bit multiply-adds (the portable kernel's arithmetic).
fn scalar_int8_chains(steps: usize) -> usize {
    let m = std::hint::black_box(3i32);
    let acc: [i32; 12] = std::array::from_fn(|i| i as i32);
    run_chains(steps, acc, |a| a.wrapping_mul(m).wrapping_add(1)) * 12 * 2
}

/// Sums `x` with the widest loads `isa` has (four independent accumulators).
fn sum(isa: Isa, x: &[f32]) -> f32 {
    match isa.supported() {
        // SAFETY: the CPU supports the instruction set.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::sum_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::sum_avx2(x) },
        _ => unsafe { sum_with::<Soft<8>>(x) },
    }
}

/// Runs the FMA chains of `isa` for `steps` steps and returns the flops done.
fn fma_chains(isa: Isa, steps: usize) -> usize {
    match isa.supported() {
        // SAFETY: the CPU supports the instruction set.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::chains_avx512(steps) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::chains_avx2(steps) },
        _ => unsafe { chains_with::<Soft<8>, 12>(steps) },
    }
}

/// # Safety
/// `V`'s instructions are supported.
#[inline(always)]
unsafe fn sum_with<V: Lanes>(x: &[f32]) -> f32 {
    let w = V::WIDTH;
    let one = [1.0f32; 16];
    unsafe {
        let one = V::load(one.as_ptr());
        let mut acc = [V::zero(); 4];
        let mut chunks = x.chunks_exact(4 * w);
        for c in &mut chunks {
            for (a, part) in acc.iter_mut().zip(c.chunks_exact(w)) {
                *a = V::mul_add(V::load(part.as_ptr()), one, *a);
            }
        }
        let mut lanes = [0f32; 16];
        let mut total: f32 = chunks.remainder().iter().sum();
        for a in acc {
            a.store(lanes.as_mut_ptr());
            total += lanes[..w].iter().sum::<f32>();
        }
        total
    }
}

/// `N` independent chains `a ← a · m + c`, `steps` times ([`run_chains`]); returns the flops
/// done. The chains start from different values and the multiplier passes through
/// [`std::hint::black_box`].
///
/// # Safety
/// `V`'s instructions are supported.
#[inline(always)]
unsafe fn chains_with<V: Lanes, const N: usize>(steps: usize) -> usize {
    unsafe {
        let m = std::hint::black_box([0.999_999f32; 16]);
        let c = std::hint::black_box([1e-7f32; 16]);
        let (m, c) = (V::load(m.as_ptr()), V::load(c.as_ptr()));
        let mut acc = [V::zero(); N];
        for (i, a) in acc.iter_mut().enumerate() {
            let start = [i as f32; 16];
            *a = V::load(start.as_ptr());
        }
        run_chains(steps, acc, |a| V::mul_add(a, m, c)) * N * V::WIDTH * 2
    }
}

/// Runs the chains `acc` (independent values of a register type), each `a ← step(a)`, for
/// `steps` steps rounded down to a multiple of 64; returns the steps run per chain.
///
/// The chains pass through [`std::hint::black_box`] every 64 steps, so the compiler can
/// neither merge identical chains nor fold the loop (a C probe that skipped this measured
/// latency, not throughput). Inlined into each probe, so `step` runs with the probe's
/// instruction set.
#[inline(always)]
fn run_chains<T: Copy, const N: usize>(
    steps: usize,
    mut acc: [T; N],
    step: impl Fn(T) -> T,
) -> usize {
    for _ in 0..steps / 64 {
        for _ in 0..64 {
            for a in acc.iter_mut() {
                *a = step(*a);
            }
        }
        acc = std::hint::black_box(acc);
    }
    std::hint::black_box(acc);
    steps / 64 * 64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{chains_with, run_chains, sum_with};
    use std::arch::x86_64::{__m256, __m512};

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sum_avx2(x: &[f32]) -> f32 {
        unsafe { sum_with::<__m256>(x) }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn sum_avx512(x: &[f32]) -> f32 {
        unsafe { sum_with::<__m512>(x) }
    }

    /// 12 chains of 8 lanes: enough to cover 2 FMA units × 4–5 cycles of latency.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn chains_avx2(steps: usize) -> usize {
        unsafe { chains_with::<__m256, 12>(steps) }
    }

    /// 12 chains of `vpmaddubsw` (32 multiply-adds each): enough to cover 2 units × 3–5
    /// cycles of latency. The values are meaningless; the timing does not depend on them.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn maddubs_chains(steps: usize) -> usize {
        use std::arch::x86_64::*;
        let m = _mm256_set1_epi8(std::hint::black_box(3));
        let acc: [__m256i; 12] = std::array::from_fn(|i| _mm256_set1_epi8(i as i8));
        run_chains(steps, acc, |a| _mm256_maddubs_epi16(a, m)) * 12 * 64
    }

    /// 12 chains of 512-bit `vpdpbusd` (64 multiply-adds each), as the wide quantized kernel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dpbusd_chains(steps: usize) -> usize {
        use std::arch::x86_64::*;
        let (w, x) = (
            _mm512_set1_epi8(3),
            _mm512_set1_epi8(std::hint::black_box(5)),
        );
        let acc: [__m512i; 12] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
        run_chains(steps, acc, |a| _mm512_dpbusd_epi32(a, w, x)) * 12 * 128
    }

    /// 24 chains of 16 lanes.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn chains_avx512(steps: usize) -> usize {
        unsafe { chains_with::<__m512, 24>(steps) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_return_plausible_figures() {
        let pool = Pool::new(2);
        let isa = Isa::detect();
        assert!(read_bandwidth(&pool, isa, 8 << 20, 1) > 0.1);
        assert!(fma_peak(&pool, isa, 1) > 0.1);
        assert!(int8_peak(&pool, isa, 1) > 0.1);
        assert!(int8_peak(&pool, Isa::Portable, 1) > 0.1);
        let r = Roofline {
            isa,
            threads: 2,
            bandwidth_gb_s: 10.0,
            fma_gflop_s: 100.0,
            int8_gop_s: 400.0,
            core_to_core_ns: None,
        };
        assert!((r.seconds(1e9, 1e9, 0.0) - 0.1).abs() < 1e-12);
        assert!((r.seconds(1e8, 1e11, 0.0) - 1.0).abs() < 1e-12);
        assert!((r.seconds(1e8, 1e11, 4e11) - 2.0).abs() < 1e-12);
        assert_eq!(r.bound(1e9, 1e9, 0.0), "memory");
        assert_eq!(r.bound(1e8, 1e11, 0.0), "compute");
        assert_eq!(r.bound(1e9, 0.0, 4e10), "memory");
    }

    #[test]
    fn the_round_trip_goes_with_the_faster_probe() {
        let slow = Roofline {
            isa: Isa::Portable,
            threads: 2,
            bandwidth_gb_s: 35.0,
            fma_gflop_s: 230.0,
            int8_gop_s: 900.0,
            core_to_core_ns: Some(70.0),
        };
        let fast = Roofline {
            bandwidth_gb_s: 60.0,
            fma_gflop_s: 220.0,
            core_to_core_ns: Some(340.0),
            ..slow
        };
        for best in [slow.best_with(&fast), fast.best_with(&slow)] {
            assert_eq!(best.bandwidth_gb_s, 60.0);
            assert_eq!(best.fma_gflop_s, 230.0);
            assert_eq!(best.core_to_core_ns, Some(340.0));
        }
    }

    #[test]
    fn the_round_trip_is_plausible_when_measured() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // `None` is allowed on a busy machine (the tests run in parallel): the echo thread
        // may never run beside this one within the time limit.
        let trip = core_to_core_round_trip();
        if cores < 2 {
            assert_eq!(trip, None);
        }
        if let Some(ns) = trip {
            // From a shared cache (tens of ns) to another socket or a preempted batch.
            assert!(ns > 1.0 && ns < 200_000.0, "{ns}");
        }
    }
}
