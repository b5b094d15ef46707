//! A wake-up descriptor for an event loop: threads ring it, the loop watches it for
//! readability and clears it before looking for work.
//!
//! On Linux it is an eventfd: ringing adds to a counter (an 8-byte write, no buffer to
//! allocate) and one read clears every ring since the last. Elsewhere it is a socket pair
//! (a byte per ring, drained until empty).

use std::io;
use std::os::fd::RawFd;

#[cfg(any(target_os = "linux", target_os = "android"))]
mod imp {
    use std::fs::File;
    use std::io::{self, Read, Write};
    use std::os::fd::{AsRawFd, RawFd};

    use rustix::event::{eventfd, EventfdFlags};

    #[derive(Debug)]
    pub struct Doorbell(File);

    impl Doorbell {
        pub fn new() -> io::Result<Self> {
            let flags = EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC;
            let fd = crate::descriptors::retry(|| Ok(eventfd(0, flags)?))?;
            Ok(Doorbell(File::from(fd)))
        }

        pub fn ring(&self) {
            // Fails only if the counter is full, which already wakes the loop.
            let _ = (&self.0).write(&1u64.to_ne_bytes());
        }

        pub fn clear(&self) {
            let mut count = [0u8; 8];
            let _ = (&self.0).read(&mut count); // nothing pending: EAGAIN
        }

        pub fn fd(&self) -> RawFd {
            self.0.as_raw_fd()
        }

        #[cfg(test)]
        pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
            std::os::fd::AsFd::as_fd(&self.0)
        }
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
mod imp {
    use std::io::{self, Read, Write};
    use std::os::fd::{AsRawFd, RawFd};
    use std::os::unix::net::UnixStream;

    #[derive(Debug)]
    pub struct Doorbell {
        ring: UnixStream,
        watch: UnixStream,
    }

    impl Doorbell {
        pub fn new() -> io::Result<Self> {
            let (ring, watch) = crate::descriptors::retry(UnixStream::pair)?;
            ring.set_nonblocking(true)?;
            watch.set_nonblocking(true)?;
            Ok(Doorbell { ring, watch })
        }

        pub fn ring(&self) {
            // Fails only if the socket buffer is full, which already wakes the loop.
            let _ = (&self.ring).write(&[1]);
        }

        pub fn clear(&self) {
            let mut sink = [0u8; 256];
            while matches!((&self.watch).read(&mut sink), Ok(n) if n > 0) {}
        }

        pub fn fd(&self) -> RawFd {
            self.watch.as_raw_fd()
        }
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct Doorbell(imp::Doorbell);

impl Doorbell {
    pub fn new() -> io::Result<Self> {
        imp::Doorbell::new().map(Doorbell)
    }

    /// Wake the watcher (never blocks; rings before a `clear` coalesce into one wake-up).
    pub fn ring(&self) {
        self.0.ring();
    }

    /// Consume every ring so far: the descriptor is no longer readable until the next.
    pub fn clear(&self) {
        self.0.clear();
    }

    /// The descriptor to watch for readability.
    pub fn fd(&self) -> RawFd {
        self.0.fd()
    }
}

#[cfg(all(test, any(target_os = "linux", target_os = "android")))]
mod tests {
    use super::*;
    use rustix::event::{poll, PollFd, PollFlags, Timespec};

    fn readable(bell: &Doorbell) -> bool {
        let mut fds = [PollFd::from_borrowed_fd(bell.0.as_fd(), PollFlags::IN)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        poll(&mut fds, Some(&now)).unwrap() == 1
    }

    #[test]
    fn rings_wake_the_watcher_until_cleared() {
        let bell = Doorbell::new().unwrap();
        assert!(!readable(&bell));
        bell.clear(); // nothing pending: no error, no wait
        bell.ring();
        bell.ring();
        assert!(readable(&bell));
        bell.clear(); // both rings at once
        assert!(!readable(&bell));
        bell.ring();
        assert!(readable(&bell));
    }
}
