//! The chunk ring of a streamed read: a log read through a few reused buffers instead of one
//! fresh buffer as long as the log.
//!
//! A fresh whole-log buffer costs a page fault per 4 KiB the first time a process reads a log
//! of that size (about 7,300 for a 30 MB log, ~10% of a fresh process's freeze of it), and its
//! bytes are long out of cache by the time the last of them is hashed. A streamed read instead
//! fills one [`Chunk`] at a time; the lines of a chunk go out as [`LineBytes`] holding it
//! shared, and when the last of them is dropped (the decoder built its lines, the hashing and
//! the call-id walk are done with it) the buffer goes back to its [`Ring`] for the next read.
//! A line longer than a chunk gets a buffer of its own, grown to fit. A log that can be
//! mapped is read in place instead, as one chunk ([`Chunk::mapped`]); the ring is then not
//! used.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

/// The bytes a chunk of a store's streamed reads holds (a line that does not fit grows its
/// chunk). Measured on W5 (28.5 MiB, lines of up to ~0.5 MB) and W3 (2.6 MB logs) against 1 MiB:
/// the same CPU within the noise, fewer pages touched (W5 8,600 faults a freeze against 8,840;
/// W3 as many as the whole-log buffer it replaces), and lines go out after each 512 KiB read
/// as before the ring.
pub const CHUNK_BYTES: usize = 512 << 10;

/// One filled buffer of a streamed read, shared by the lines it holds; dropped, it goes back
/// to the ring it came from. Or a map of the whole log ([`Chunk::mapped`]), read in place.
#[derive(Debug)]
pub struct Chunk {
    bytes: ChunkBytes,
}

#[derive(Debug)]
enum ChunkBytes {
    Buffer {
        bytes: Vec<u8>,
        /// How many of `bytes` were read.
        filled: usize,
        home: Sender<Vec<u8>>,
    },
    #[cfg(any(target_os = "linux", target_os = "android"))]
    Mapped(crate::mapped::Mapped),
}

impl Chunk {
    /// The bytes read into it.
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            ChunkBytes::Buffer { bytes, filled, .. } => &bytes[..*filled],
            #[cfg(any(target_os = "linux", target_os = "android"))]
            ChunkBytes::Mapped(map) => map.bytes(),
        }
    }

    /// A map's bytes, shared as one chunk. Whoever makes it keeps the log locked until every
    /// holder has dropped it (see [`crate::mapped`]).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub fn mapped(map: crate::mapped::Mapped) -> Shared {
        Arc::new(Chunk {
            bytes: ChunkBytes::Mapped(map),
        })
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let ChunkBytes::Buffer { bytes, home, .. } = &mut self.bytes {
            // A ring that is gone frees it here.
            let _ = home.send(std::mem::take(bytes));
        }
    }
}

/// A shared filled chunk.
pub type Shared = Arc<Chunk>;

/// One complete line: borrowed from a buffer the caller holds, or a range of a shared chunk
/// (which stays out of the ring while the line is held).
#[derive(Debug, Clone)]
pub enum LineBytes<'a> {
    Borrowed(&'a [u8]),
    Chunk(Shared, Range<usize>),
}

impl LineBytes<'_> {
    pub fn bytes(&self) -> &[u8] {
        match self {
            LineBytes::Borrowed(line) => line,
            LineBytes::Chunk(chunk, range) => &chunk.bytes()[range.clone()],
        }
    }
}

/// The buffers of one streamed read: those given back by dropped chunks are handed out again
/// before any is allocated. A buffer is always as long as its capacity, its bytes stale: a
/// reader overwrites them (no memset of a reused buffer before each read).
pub struct Ring {
    home: Sender<Vec<u8>>,
    back: Receiver<Vec<u8>>,
    /// The length of a new buffer.
    chunk_bytes: usize,
    /// Buffers allocated by this ring (not counting those it was given).
    pub allocated: usize,
}

impl Ring {
    /// A ring of buffers of `chunk_bytes` (at least 1) that starts with `spare` (buffers of an
    /// earlier read).
    pub fn new(spare: Vec<Vec<u8>>, chunk_bytes: usize) -> Self {
        let (home, back) = channel();
        for buf in spare {
            let _ = home.send(buf);
        }
        Ring {
            home,
            back,
            chunk_bytes: chunk_bytes.max(1),
            allocated: 0,
        }
    }

    /// The length of a new buffer.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// A buffer given back earlier, if any (to be overwritten).
    pub fn reuse(&self) -> Option<Vec<u8>> {
        self.back.try_recv().ok()
    }

    /// A new buffer of `chunk_bytes` (a large one zeroed by the kernel as its pages are first
    /// touched: no memset).
    pub fn allocate(&mut self) -> Vec<u8> {
        self.allocated += 1;
        vec![0u8; self.chunk_bytes]
    }

    /// `bytes`, of which the first `filled` were read, shared; back in this ring once every
    /// holder has dropped it.
    pub fn share(&self, bytes: Vec<u8>, filled: usize) -> Shared {
        Arc::new(Chunk {
            bytes: ChunkBytes::Buffer {
                bytes,
                filled,
                home: self.home.clone(),
            },
        })
    }

    /// A buffer this ring handed out and that was not shared, back for reuse.
    pub fn give_back(&self, bytes: Vec<u8>) {
        let _ = self.home.send(bytes);
    }

    /// The buffers given back so far (to keep for a later read).
    pub fn into_spare(self) -> Vec<Vec<u8>> {
        let Ring { home, back, .. } = self;
        drop(home);
        back.try_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_comes_back_once_its_last_line_is_dropped() {
        let mut ring = Ring::new(Vec::new(), CHUNK_BYTES);
        assert!(ring.reuse().is_none());
        let mut buf = ring.allocate();
        buf[..6].copy_from_slice(b"ab\ncd\n");
        let chunk = ring.share(buf, 6);
        assert_eq!(chunk.bytes(), b"ab\ncd\n");
        let first = LineBytes::Chunk(chunk.clone(), 0..2);
        let second = LineBytes::Chunk(chunk, 3..5);
        assert_eq!(first.bytes(), b"ab");
        assert_eq!(second.bytes(), b"cd");
        drop(first);
        assert!(ring.reuse().is_none());
        drop(second);
        let again = ring.reuse().expect("given back");
        assert_eq!(again.len(), CHUNK_BYTES);
        assert_eq!(ring.allocated, 1);
        ring.give_back(again);
        assert_eq!(ring.into_spare().len(), 1);
    }
}
