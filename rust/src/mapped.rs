//! A read-only memory map of a log's acknowledged bytes, for reading a long log in one go.
//!
//! Why a map: a fresh resolver of a long rollout (W5: 28.5 MiB of log) spent about a quarter
//! of its time in `pread` copying the page cache into a buffer (and, in a fresh process, in
//! the page faults of that buffer), before scanning the copy. A map scans the page-cache pages
//! where they are: measured on that log, map + one pass 2.3 ms against 4-6 ms for the copy
//! alone (docs/benchmarks.md, "Resolve"). A freeze of a long log reads it through a map for
//! the same reason (the copy was ~12% of its verifying thread).
//!
//! The one hazard of a file map is a file shortened under it: touching a page past the new
//! end raises SIGBUS. [`Mapped`] is therefore only made while the rollout's lock is held
//! (shared for a resolve or a read, exclusive for a freeze), over bytes that were in the file
//! when the length was taken under that lock, and it is dropped before the lock is: every
//! writer (this crate's and NeMo Gym 0.7.0's store) shortens a log only under the exclusive
//! lock, and only to cut a torn tail, which a freeze holding that lock does itself only past
//! its last complete line (whose page stays mapped and readable). A resolver, which creates
//! no file, reads a log that has no lock file (an operator removed it) with `pread`, never
//! mapped; a store's freeze or read locks the lock file it recreates. The rule rests on the
//! rollout's lock being the one lock every process takes: an operator who removes a lock file
//! while another process holds it breaks that exclusion for every operation of the rollout
//! (its fences included), and a map made then could meet a cut.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;

/// A `PROT_READ` map of `[start, end)` of a file, unmapped on drop.
#[derive(Debug)]
pub struct Mapped {
    base: *mut std::ffi::c_void,
    mapped: usize,
    /// Bytes between the page-aligned start of the map and `start`.
    skip: usize,
}

impl Mapped {
    /// Map `[start, end)` of `file` (`start < end`). The caller holds the rollout's lock until
    /// this is dropped, and `end` was taken under it (see the module docs).
    pub fn new(file: &File, start: u64, end: u64) -> io::Result<Mapped> {
        if end <= start {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty map"));
        }
        let page = rustix::param::page_size() as u64;
        let aligned = start - start % page;
        let mapped = usize::try_from(end - aligned)
            .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "log too long to map"))?;
        // SAFETY: a fresh private read-only mapping chosen by the kernel (null hint) aliases no
        // Rust object; the descriptor is valid for the call; the length is non-zero.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                mapped,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE,
                file.as_fd(),
                aligned,
            )
        }?;
        Ok(Mapped {
            base,
            mapped,
            skip: (start - aligned) as usize,
        })
    }

    /// The bytes `[start, end)`.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `base..base + mapped` is mapped readable until `drop`, which the borrow
        // outlives no longer than `self`. Every byte lies in the file (below `end`, taken
        // under the rollout's lock, which outlives the map), so no access raises SIGBUS; and no
        // writer changes acknowledged bytes in place (puts append past `end` under the
        // exclusive lock), so the bytes do not change while borrowed.
        let all = unsafe { std::slice::from_raw_parts(self.base.cast::<u8>(), self.mapped) };
        &all[self.skip..]
    }
}

// SAFETY: the map is read-only and its bytes do not change while it lives (see `bytes`), so
// borrowing them from several threads at once, or unmapping from another thread than the one
// that mapped, is as safe as sharing a `&[u8]`; the raw pointer is only what keeps the compiler
// from inferring this.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no borrow of it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.base, self.mapped) };
    }
}
