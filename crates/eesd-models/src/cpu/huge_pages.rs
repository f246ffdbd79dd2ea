//! Weight buffers on 2 MiB pages where the OS offers them (Linux transparent huge pages).
//!
//! Why: a forward pass streams ~0.5 GB of weights. On 4 KiB pages that is 130,000 page-table
//! walks per pass (the TLB covers a few MiB), and the hardware prefetchers stop at every
//! 4 KiB boundary. On 2 MiB pages a 16-row f32 block of SmolLM2's layers ran ≈ 8% faster
//! (kernel alone, same process, pages interleaved). Linux's default THP mode (`madvise`) gives
//! huge pages only to memory that asks for them before it is first touched, and only to whole
//! aligned 2 MiB pages. So on Linux a buffer of 2 MiB or more is mapped fresh from the OS (the
//! heap could hand back pages a previous model already touched), starts on a 2 MiB boundary
//! and asks for the whole pages it holds; its tail stays on small pages, nothing is wasted.
//!
//! Most of a layer's matrices are smaller than a huge page (SmolLM2's Q4_1 projections hold
//! 0.2–1.1 MB each, its f16 ones 0.7–1.8 MB), so buffers from 64 KiB up share *regions*: 32 MiB
//! mappings advised as huge pages, handed out in order and unmapped when the last buffer in
//! them is dropped. A model's weights then lie on huge pages however they are cut.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// Size and alignment of a huge page.
const HUGE: usize = 2 << 20;

/// Buffers from this size up to a huge page are placed in a shared [`Region`].
const SHARED_MIN: usize = 64 << 10;

/// Bytes of one shared region (16 huge pages: a buffer that does not fit the rest of the
/// current region opens a new one, leaving at most one buffer's size unused).
const REGION: usize = 32 << 20;

/// Alignment of a buffer inside a region (a cache line).
const REGION_ALIGN: usize = 64;

/// A fixed-length buffer of plain values `T` (made only for `T: Copy`: dropping it frees the
/// memory, nothing else) whose whole 2 MiB pages are on huge pages where the OS offers them
/// (elsewhere an ordinary allocation).
pub(crate) struct HugeBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    backing: Backing,
}

/// Where a buffer's memory comes from.
enum Backing {
    /// Nothing allocated (`len · size_of::<T>() == 0`).
    Empty,
    /// The global allocator, with this layout.
    Heap(Layout),
    /// A mapping of its own (2 MiB or more) or a slice of a shared region, kept mapped while
    /// this buffer lives (held for its drop, never read; Linux).
    #[allow(dead_code)]
    Mapped(Arc<Region>),
}

/// A huge-page mapping from [`map_huge`]: one large buffer's, or one that small buffers share
/// ([`SHARED_MIN`]); unmapped when the last buffer in it is dropped.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
struct Region {
    start: NonNull<u8>,
    len: usize,
}

// SAFETY: a region is plain memory; its buffers' own types decide what crosses threads.
unsafe impl Send for Region {}
// SAFETY: as above; the region itself is never read or written through `&Region`.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: mapped with this length in `map_huge`, and no buffer in it is alive.
        unsafe {
            libc::munmap(self.start.as_ptr().cast(), self.len);
        }
    }
}

/// The region new small buffers go to, and how many of its bytes are taken. Weak: a region
/// no buffer uses any more is unmapped at once, not kept for later buffers.
static CURRENT: Mutex<Option<(Weak<Region>, usize)>> = Mutex::new(None);

/// Room for `bytes` (`SHARED_MIN ≤ bytes < HUGE`) in the current region, or in a new one;
/// `None` if the OS refuses a mapping (the caller then uses the heap).
#[cfg(target_os = "linux")]
fn place_shared(bytes: usize) -> Option<(NonNull<u8>, Arc<Region>)> {
    let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    let fits = current.as_ref().and_then(|(region, used)| {
        let region = region.upgrade()?;
        let at = used.next_multiple_of(REGION_ALIGN);
        (at + bytes <= region.len).then_some((region, at))
    });
    let (region, at) = match fits {
        Some(found) => found,
        None => (Arc::new(map_huge(REGION)?), 0),
    };
    *current = Some((Arc::downgrade(&region), at + bytes));
    // SAFETY: `at + bytes ≤ region.len`: inside the mapping.
    let ptr = unsafe { region.start.add(at) };
    Some((ptr, region))
}

// SAFETY: a HugeBuf owns its elements like a Vec.
unsafe impl<T: Send> Send for HugeBuf<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: Sync> Sync for HugeBuf<T> {}

impl<T: Copy> HugeBuf<T> {
    /// `len` copies of `value`.
    pub(crate) fn filled(len: usize, value: T) -> Self {
        let buf = Self::uninit(len);
        for i in 0..len {
            // SAFETY: `i < len`, inside the allocation.
            unsafe { buf.ptr.as_ptr().add(i).write(value) };
        }
        buf
    }

    /// A copy of `values`.
    pub(crate) fn from_slice(values: &[T]) -> Self {
        let buf = Self::uninit(values.len());
        // SAFETY: the allocation holds `values.len()` elements and does not overlap `values`.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), buf.ptr.as_ptr(), values.len()) };
        buf
    }

    /// Room for `len` elements, not yet written (the callers above write all of them before
    /// the buffer is used).
    fn uninit(len: usize) -> Self {
        let bytes = len.checked_mul(size_of::<T>());
        let Some(bytes) = bytes.filter(|&b| b > 0) else {
            // Zero-sized: no allocation (a length overflow fails like Vec's does).
            assert!(bytes.is_some(), "capacity overflow");
            return HugeBuf {
                ptr: NonNull::dangling(),
                len,
                backing: Backing::Empty,
            };
        };
        #[cfg(target_os = "linux")]
        if let Some(region) = (bytes >= HUGE).then(|| map_huge(bytes)).flatten() {
            return HugeBuf {
                ptr: region.start.cast(),
                len,
                backing: Backing::Mapped(Arc::new(region)),
            };
        }
        #[cfg(target_os = "linux")]
        if align_of::<T>() <= REGION_ALIGN
            && let Some((ptr, region)) = (SHARED_MIN..HUGE)
                .contains(&bytes)
                .then(|| place_shared(bytes))
                .flatten()
        {
            return HugeBuf {
                ptr: ptr.cast(),
                len,
                backing: Backing::Mapped(region),
            };
        }
        // On a cache line like the mapped buffers, so that vector loads never straddle two.
        let layout = Layout::array::<T>(len)
            .and_then(|l| l.align_to(REGION_ALIGN))
            .expect("capacity overflow");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            std::alloc::handle_alloc_error(layout);
        };
        HugeBuf {
            ptr,
            len,
            backing: Backing::Heap(layout),
        }
    }
}

/// A fresh anonymous mapping of at least `bytes` bytes starting on a 2 MiB boundary, its whole
/// huge pages advised as such, or `None` if the OS refuses (the caller then uses the heap).
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<Region> {
    const PAGE: usize = 4096;
    let len = bytes.next_multiple_of(PAGE);
    let reserve = len.checked_add(HUGE)?;
    // SAFETY: a new private anonymous mapping; no existing memory is affected.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE);
    // SAFETY: both ranges lie inside the mapping just made and outside [aligned, aligned+len).
    unsafe {
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        let end = aligned + len;
        if start + reserve > end {
            libc::munmap(end as *mut libc::c_void, start + reserve - end);
        }
        let whole = len / HUGE * HUGE;
        // A hint: refused (THP off) it changes nothing.
        libc::madvise(aligned as *mut libc::c_void, whole, libc::MADV_HUGEPAGE);
    }
    NonNull::new(aligned as *mut u8).map(|start| Region { start, len })
}

impl<T> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        match &self.backing {
            // The region unmaps itself when its last buffer goes.
            Backing::Empty | Backing::Mapped(_) => {}
            // SAFETY: allocated with this layout in `uninit`.
            Backing::Heap(layout) => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr().cast(), *layout)
            },
        }
    }
}

impl<T> std::ops::Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements (or a dangling pointer with no bytes).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as `deref`, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: PartialEq> PartialEq for HugeBuf<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_it_was_given_at_every_size() {
        for len in [0, 1, 7, HUGE / 4 - 1, HUGE / 4 + 5, 3 * HUGE / 4 + 1] {
            let values: Vec<u32> = (0..len as u32).collect();
            let buf = HugeBuf::from_slice(&values);
            assert_eq!(&*buf, &values[..]);
            assert_eq!(buf.clone(), buf);
            let mut filled = HugeBuf::filled(len, 9u8);
            assert!(filled.iter().all(|&v| v == 9));
            filled.iter_mut().for_each(|v| *v = 1);
            assert_eq!(filled.iter().map(|&v| v as usize).sum::<usize>(), len);
        }
        // Large buffers start on a huge page.
        let big = HugeBuf::filled(HUGE, 0u8);
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        let zst = HugeBuf::filled(5, ());
        assert_eq!(zst.len(), 5);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn small_buffers_share_regions_and_keep_their_values() {
        // 40 buffers of 64 KiB .. 2 MiB (41 MB in all) fill more than one 32 MiB region.
        let mut bufs: Vec<HugeBuf<u32>> = (0..40u32)
            .map(|i| {
                let len = (SHARED_MIN + (i as usize) * 50_000) / 4;
                let values: Vec<u32> = (0..len as u32).map(|v| v ^ i).collect();
                HugeBuf::from_slice(&values)
            })
            .collect();
        let shared = bufs
            .iter()
            .filter(|b| matches!(b.backing, Backing::Mapped(_)))
            .count();
        assert!(
            shared == 0 || shared == bufs.len(),
            "{shared} of {}",
            bufs.len()
        );
        for b in &bufs {
            assert_eq!(b.as_ptr() as usize % REGION_ALIGN, 0);
        }
        // Dropping every other buffer leaves the rest intact.
        let kept: Vec<(u32, HugeBuf<u32>)> = bufs
            .drain(..)
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(i, b)| (i as u32, b))
            .collect();
        for (i, b) in &kept {
            assert!(
                b.iter().enumerate().all(|(v, &x)| x == v as u32 ^ i),
                "buffer {i}"
            );
        }
        // Buffers side by side in one region do not overlap.
        let mut spans: Vec<(usize, usize)> = kept
            .iter()
            .map(|(_, b)| (b.as_ptr() as usize, b.as_ptr() as usize + 4 * b.len()))
            .collect();
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
    }
}
