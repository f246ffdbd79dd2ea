//! One persistent pool of worker threads for the CPU kernels.
//!
//! Why not rayon: a forward pass issues ~120 matrix products of 0.1–2 ms each, back to back.
//! Waking a parked thread for each costs tens of microseconds (a futex round trip per call, seen
//! as `sched_yield`/`futex` time in profiles). Here the workers spin for a short while after each
//! job, so the next product of the same forward pass starts at once, and park only when the
//! model is idle. The calling thread always takes part in the work.
//!
//! A job is `n` independent tasks `f(0) .. f(n-1)`, handed out in order to whichever thread asks
//! first. Kernels make each output element's arithmetic independent of which task computes it,
//! so the split never changes a result.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Matrix products of at most this many outputs (every matrix of a SmolLM2 layer, not its LM
/// head) run as one range per thread ([`Pool::run_product`]).
pub(crate) const EVEN_SPLIT_OUTPUTS: usize = 6144;

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// A fixed set of worker threads that run jobs together with the calling thread.
pub struct Pool {
    shared: Arc<Shared>,
    /// Held while a job runs: a second caller (another thread, or a task calling back into the
    /// pool) runs its job on its own thread instead of waiting.
    submit: Mutex<()>,
    threads: usize,
}

/// The job being run, published to the workers by bumping `epoch`.
struct Shared {
    epoch: AtomicUsize,
    job: UnsafeCell<Job>,
    /// Workers that have not yet finished with the current job.
    active: AtomicUsize,
    panicked: AtomicBool,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the submitter while holding `submit` and while no worker
// reads it (every worker has finished the previous job: `active == 0`); workers read it only
// between seeing a new epoch and decrementing `active`.
unsafe impl Sync for Shared {}

#[derive(Clone, Copy)]
struct Job {
    /// The task function with its lifetime erased; valid until `active` drops to 0.
    task: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    next: *const AtomicUsize,
}

// SAFETY: the pointers are only dereferenced while the submitting call keeps them alive.
unsafe impl Send for Job {}

impl Pool {
    /// The process-wide pool: `EESD_THREADS` threads if set, else one per available core.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let threads = std::env::var("EESD_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            Pool::new(threads)
        })
    }

    /// A pool of `threads` threads in all (the caller and `threads - 1` workers).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(Job {
                task: &noop as &(dyn Fn(usize) + Sync),
                tasks: 0,
                next: std::ptr::null(),
            }),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut spawned = 1;
        for i in 1..threads {
            let shared = shared.clone();
            let ok = std::thread::Builder::new()
                .name(format!("eesd-cpu-{i}"))
                .spawn(move || worker(&shared))
                .is_ok();
            spawned += usize::from(ok);
        }
        Pool {
            shared,
            submit: Mutex::new(()),
            threads: spawned,
        }
    }

    /// Threads that take part in a job (workers plus the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `task(0) .. task(tasks - 1)`, spread over the pool, and returns when all are done.
    pub fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let guard = match self.submit.try_lock() {
            Ok(guard) if self.threads > 1 && tasks > 1 => guard,
            _ => {
                (0..tasks).for_each(task);
                return;
            }
        };
        let s = &*self.shared;
        let next = AtomicUsize::new(0);
        // SAFETY: the previous job is finished (`active == 0`, checked at the end of the last
        // run), so no worker reads `job` now; the lifetime erasure is sound because this call
        // does not return before every worker is done with the pointers.
        unsafe {
            let task: *const (dyn Fn(usize) + Sync) = std::mem::transmute(task);
            *s.job.get() = Job {
                task,
                tasks,
                next: &next,
            };
        }
        s.active.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _lock = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // The workers hold pointers into this frame: wait for them even if a task panics here.
        let mine = catch_unwind(AssertUnwindSafe(|| {
            loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= tasks {
                    break;
                }
                task(t);
            }
        }));
        while s.active.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        drop(guard);
        if let Err(payload) = mine {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a CPU kernel task panicked on a worker thread");
        }
    }
}

impl Pool {
    /// Runs `task(range)` over ranges that together cover `0..units` once, spread over the
    /// pool ([`Guided`]: large ranges first, single units last, so that the threads finish
    /// together).
    pub fn run_ranges(&self, units: usize, task: &(dyn Fn(Range<usize>) + Sync)) {
        let split = Guided::new(units, self.threads);
        self.run(split.tasks(), &|t| task(split.range(t)));
    }

    /// Runs the `units` of a matrix product of `outputs` outputs: a layer's product (at most
    /// `EVEN_SPLIT_OUTPUTS`, 6,144) as one range per thread ([`Pool::run_even`]), a larger one
    /// (the LM head) in shrinking ranges ([`Pool::run_ranges`]) so that the threads finish
    /// together.
    pub fn run_product(&self, outputs: usize, units: usize, task: &(dyn Fn(Range<usize>) + Sync)) {
        match outputs <= EVEN_SPLIT_OUTPUTS {
            true => self.run_even(units, task),
            false => self.run_ranges(units, task),
        }
    }

    /// Runs `task(range)` over one contiguous range of `0..units` per thread (as equal as
    /// units allow; fewer ranges when there are fewer units).
    ///
    /// Why: for a product of a layer (tens of microseconds) the guided split's many tasks cost
    /// more than its balance gains: each task starts a cold stream of weights, and a thread's
    /// one range streams (and prefetches) from end to end. On a 2-core Xeon (model 167),
    /// 576 × 576 in f32 took 37-38 µs this way against 43-45 µs guided, at 1 and 8 rows
    /// (`matmul_cost`, alternated twice), and a forward pass 3-7% less at 1-32 rows in f32,
    /// f16 and native weights (`block_cost`; docs/results.md).
    pub fn run_even(&self, units: usize, task: &(dyn Fn(Range<usize>) + Sync)) {
        let n = self.threads.min(units);
        self.run(n, &|t| task(units * t / n..units * (t + 1) / n));
    }

    /// Calls `f(i, chunk)` for every `chunk`-long piece `i` of `data` (the last may be
    /// shorter), spread over the pool.
    pub fn for_each_chunk<T: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: &(dyn Fn(usize, &mut [T]) + Sync),
    ) {
        let chunk = chunk.max(1);
        let len = data.len();
        let base = Disjoint(data.as_mut_ptr());
        self.run(len.div_ceil(chunk), &|i| {
            let start = i * chunk;
            let n = chunk.min(len - start);
            // SAFETY: piece i is [start, start + n), inside `data`, and no other task's.
            f(i, unsafe { base.slice(start, n) });
        });
    }
}

/// A split of `units` of equal work into tasks for `threads` threads that shrink as the work
/// runs out ("guided" scheduling): each round hands every thread an equal share of half the
/// units left, until a round's share would be under two units; the rest are single units.
///
/// Why: equal tasks leave every thread but one idle for up to a task's length at the end of a
/// product, and a forward pass ends ~150 products; many small tasks instead cut the weight
/// stream (and its prefetch) into short pieces. Shrinking tasks do both: few and long first,
/// one unit at the end. Which thread computes which unit never changes a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guided {
    units: usize,
    threads: usize,
    /// Rounds of `threads` tasks each.
    rounds: usize,
    /// First unit of the single-unit tail.
    tail: usize,
}

impl Guided {
    /// The split of `units` for `threads` threads (one task when there is one thread).
    pub fn new(units: usize, threads: usize) -> Guided {
        let threads = threads.max(1);
        let (mut rounds, mut start) = (0, 0);
        while threads > 1 && (units - start) / 2 >= 2 * threads {
            start += (units - start) / 2;
            rounds += 1;
        }
        Guided {
            units,
            threads,
            rounds,
            tail: start,
        }
    }

    /// Number of tasks.
    pub fn tasks(&self) -> usize {
        match self.threads {
            1 => usize::from(self.units > 0),
            _ => self.rounds * self.threads + (self.units - self.tail),
        }
    }

    /// The units of task `t < tasks()`.
    pub fn range(&self, t: usize) -> Range<usize> {
        if self.threads == 1 {
            return 0..self.units;
        }
        let round = t / self.threads;
        if round >= self.rounds {
            let u = self.tail + t - self.rounds * self.threads;
            return u..u + 1;
        }
        let mut start = 0;
        for _ in 0..round {
            start += (self.units - start) / 2;
        }
        let span = (self.units - start) / 2;
        let i = t % self.threads;
        start + span * i / self.threads..start + span * (i + 1) / self.threads
    }
}

/// A buffer that tasks write in disjoint pieces.
pub(crate) struct Disjoint<T>(pub(crate) *mut T);

// SAFETY: each task touches only its own piece.
unsafe impl<T: Send> Sync for Disjoint<T> {}

impl<T> Disjoint<T> {
    /// The buffer's start, for tasks that write scattered pieces (each task its own).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }

    /// # Safety
    /// `start..start + len` is inside the buffer and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

fn noop(_: usize) {}

/// A worker's loop; it starts before any job, at epoch 0 (reading the epoch here instead would
/// miss a job published before the thread got going).
fn worker(s: &Shared) {
    let mut seen = 0;
    loop {
        // Spin for new work, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                let mut lock = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                while s.epoch.load(Ordering::SeqCst) == seen {
                    lock = s.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
                }
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
                break;
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        // SAFETY: a new epoch means a job was published and stays valid until this worker
        // decrements `active`.
        let job = unsafe { *s.job.get() };
        let result = catch_unwind(AssertUnwindSafe(|| unsafe {
            let next = &*job.next;
            loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= job.tasks {
                    break;
                }
                (*job.task)(t);
            }
        }));
        if result.is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
        s.active.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        let pool = Pool::new(3);
        for tasks in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn many_small_jobs_and_concurrent_callers() {
        let pool = Arc::new(Pool::new(2));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for n in 0..2000usize {
                        let sum = AtomicUsize::new(0);
                        pool.run(n % 5 + 1, &|t| {
                            sum.fetch_add(t + 1, Ordering::Relaxed);
                        });
                        let k = n % 5 + 1;
                        assert_eq!(sum.load(Ordering::Relaxed), k * (k + 1) / 2);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    #[test]
    fn guided_ranges_cover_the_units_once_and_shrink() {
        for threads in [1, 2, 3, 16] {
            for units in [0, 1, 2, 5, 30, 96, 1536] {
                let split = Guided::new(units, threads);
                let ranges: Vec<_> = (0..split.tasks()).map(|t| split.range(t)).collect();
                let mut next = 0;
                for r in &ranges {
                    assert_eq!(
                        r.start, next,
                        "{units} units, {threads} threads: {ranges:?}"
                    );
                    assert!(
                        !r.is_empty(),
                        "{units} units, {threads} threads: {ranges:?}"
                    );
                    next = r.end;
                }
                assert_eq!(next, units, "{units} units, {threads} threads");
                let last = ranges.last().map_or(0, |r| r.len());
                assert!(threads == 1 || last <= 1, "{units}, {threads}: {ranges:?}");
                let first = ranges.first().map_or(0, |r| r.len());
                // (A round's equal shares may differ by one unit.)
                assert!(ranges.iter().all(|r| r.len() <= first + 1));
            }
        }
        // Few tasks for many units: a log-many rounds of `threads` tasks, then a short tail.
        assert!(Guided::new(1536, 2).tasks() <= 2 * 10 + 8);
    }

    #[test]
    fn run_ranges_runs_each_unit_once() {
        let pool = Pool::new(3);
        let hits: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
        pool.run_ranges(100, &|r| {
            r.for_each(|u| {
                hits[u].fetch_add(1, Ordering::Relaxed);
            })
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn run_even_runs_each_unit_once_in_one_range_per_thread() {
        let pool = Pool::new(3);
        for units in [0, 1, 2, 3, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            let ranges = AtomicUsize::new(0);
            pool.run_even(units, &|r| {
                assert!(
                    !r.is_empty() && r.len() <= units.div_ceil(3),
                    "{units}: {r:?}"
                );
                ranges.fetch_add(1, Ordering::Relaxed);
                r.for_each(|u| {
                    hits[u].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            assert_eq!(ranges.load(Ordering::Relaxed), units.min(3));
        }
    }

    #[test]
    fn chunks_cover_the_data_once() {
        let pool = Pool::new(3);
        let mut data = vec![0usize; 103];
        pool.for_each_chunk(&mut data, 10, &|i, chunk| {
            chunk.iter_mut().for_each(|v| *v += i + 1);
        });
        assert!(data.iter().enumerate().all(|(j, &v)| v == j / 10 + 1));
    }

    #[test]
    fn nested_jobs_run_inline() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
    }

    #[test]
    fn wakes_after_parking() {
        let pool = Pool::new(2);
        std::thread::sleep(SPIN * 4);
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
