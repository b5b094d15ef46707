//! The per-rollout file lock.
//!
//! Writers hold `flock(LOCK_EX)` on `R.tokens.lock`, readers `LOCK_SH`. `flock` locks belong to
//! an open file description, so threads of one process exclude each other exactly like separate
//! processes do: every acquisition opens its own descriptor.
//!
//! `delete` unlinks the lock file while holding it. A waiter that opened the old inode would
//! then hold a lock nobody else can see, so after locking we check that the path still names
//! the inode we locked and start over if it does not (lock, then verify).

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{IoContext, Result};

/// Shared (readers) or exclusive (writers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    Shared,
    Exclusive,
}

/// A held lock; dropping it closes the descriptor, which releases the lock.
#[derive(Debug)]
pub struct RolloutLock {
    _file: File,
}

impl RolloutLock {
    /// Lock `path`, creating the lock file if needed.
    pub fn acquire(path: &Path, mode: LockMode) -> Result<Self> {
        loop {
            if let Some(lock) = Self::attempt(path, mode, true)? {
                return Ok(lock);
            }
        }
    }

    /// Lock `path` only if the lock file exists: `Ok(None)` when it does not, and nothing is
    /// created (readers of a rollout that has no files must leave none behind).
    pub fn acquire_if_exists(path: &Path, mode: LockMode) -> Result<Option<Self>> {
        Self::attempt(path, mode, false)
    }

    /// One lock-then-verify round; `None` means "retry" with `create`, "absent" without.
    fn attempt(path: &Path, mode: LockMode, create: bool) -> Result<Option<Self>> {
        loop {
            let opened = OpenOptions::new()
                .read(true)
                .write(create)
                .create(create)
                .truncate(false)
                .open(path);
            let file = match opened {
                Ok(file) => file,
                Err(err) if !create && err.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(err) => return Err(err).ctx("open lock", path),
            };
            lock_retrying_eintr(&file, mode).ctx("lock", path)?;
            let held = file.metadata().ctx("stat lock", path)?;
            match std::fs::metadata(path) {
                Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                    return Ok(Some(RolloutLock { _file: file }));
                }
                // Unlinked or replaced while we waited: the lock we hold guards nothing.
                Ok(_) => continue,
                Err(err) if err.kind() == io::ErrorKind::NotFound => {
                    if create {
                        continue;
                    }
                    return Ok(None);
                }
                Err(err) => return Err(err).ctx("stat lock", path),
            }
        }
    }

    /// Try to lock without waiting; `Ok(None)` when another holder has it (used by tests and
    /// tooling that must not block).
    pub fn try_acquire(path: &Path, mode: LockMode) -> Result<Option<Self>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .ctx("open lock", path)?;
        let attempt = match mode {
            LockMode::Shared => file.try_lock_shared(),
            LockMode::Exclusive => file.try_lock(),
        };
        match attempt {
            Ok(()) => Ok(Some(RolloutLock { _file: file })),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(err)) => Err(err).ctx("lock", path),
        }
    }
}

fn lock_retrying_eintr(file: &File, mode: LockMode) -> io::Result<()> {
    loop {
        let result = match mode {
            LockMode::Shared => file.lock_shared(),
            LockMode::Exclusive => file.lock(),
        };
        match result {
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusive_excludes_and_shared_shares() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.lock");
        let held = RolloutLock::acquire(&path, LockMode::Exclusive).unwrap();
        assert!(RolloutLock::try_acquire(&path, LockMode::Exclusive)
            .unwrap()
            .is_none());
        assert!(RolloutLock::try_acquire(&path, LockMode::Shared)
            .unwrap()
            .is_none());
        drop(held);
        let a = RolloutLock::try_acquire(&path, LockMode::Shared).unwrap();
        let b = RolloutLock::try_acquire(&path, LockMode::Shared).unwrap();
        assert!(a.is_some() && b.is_some());
        assert!(RolloutLock::try_acquire(&path, LockMode::Exclusive)
            .unwrap()
            .is_none());
    }

    #[test]
    fn without_create_an_absent_lock_is_none_and_creates_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.lock");
        assert!(RolloutLock::acquire_if_exists(&path, LockMode::Shared)
            .unwrap()
            .is_none());
        assert!(!path.exists());
    }

    #[test]
    fn a_waiter_on_an_unlinked_lock_retries_on_the_new_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.lock");
        let held = RolloutLock::acquire(&path, LockMode::Exclusive).unwrap();
        let waiter_path = path.clone();
        let waiter = std::thread::spawn(move || {
            RolloutLock::acquire(&waiter_path, LockMode::Exclusive).unwrap()
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        std::fs::remove_file(&path).unwrap();
        drop(held);
        let lock = waiter.join().unwrap();
        // The waiter's lock is on the file the path names now, so it really excludes others.
        assert!(path.exists());
        assert!(RolloutLock::try_acquire(&path, LockMode::Exclusive)
            .unwrap()
            .is_none());
        drop(lock);
    }
}
