//! Weight buffers on 2 MiB pages where the OS offers them (Linux transparent huge pages).
//!
//! Why: a forward pass streams ~0.5 GB of weights. On 4 KiB pages that is 130,000 page-table
//! walks per pass (the TLB covers a few MiB), and the hardware prefetchers stop at every
//! 4 KiB boundary. On 2 MiB pages a 16-row f32 block of SmolLM2's layers ran ≈ 8% faster
//! (kernel alone, same process, pages interleaved). Linux's default THP mode (`madvise`) gives
//! huge pages only to memory that asks for them before it is first touched, and only to whole
//! aligned 2 MiB pages, so a buffer of 2 MiB or more starts on a 2 MiB boundary and asks for
//! the whole pages it holds (its tail stays on small pages: nothing is wasted).

use std::alloc::Layout;
use std::ptr::NonNull;

/// Size and alignment of a huge page.
const HUGE: usize = 2 << 20;

/// A fixed-length buffer of plain values `T` (made only for `T: Copy`: dropping it frees the
/// memory, nothing else) whose whole 2 MiB pages are on huge pages where the OS offers them
/// (elsewhere an ordinary allocation).
pub(crate) struct HugeBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    /// The allocation's layout (`None`: nothing allocated, `len · size_of::<T>() == 0`).
    layout: Option<Layout>,
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
                layout: None,
            };
        };
        let align = if bytes >= HUGE { HUGE } else { align_of::<T>() };
        let layout = Layout::from_size_align(bytes, align).expect("capacity overflow");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            std::alloc::handle_alloc_error(layout);
        };
        advise(raw, bytes);
        HugeBuf {
            ptr,
            len,
            layout: Some(layout),
        }
    }
}

/// Asks for huge pages for the whole 2 MiB pages in `bytes` bytes from `start` (a hint:
/// ignored where unsupported).
fn advise(start: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        let first = (start as usize).next_multiple_of(HUGE);
        let last = (start as usize + bytes) / HUGE * HUGE;
        if last > first {
            // SAFETY: the range lies inside an allocation this buffer owns; MADV_HUGEPAGE
            // changes how it is backed, not what it holds.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_HUGEPAGE,
                )
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

impl<T> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated with this layout in `uninit`.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
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
}
