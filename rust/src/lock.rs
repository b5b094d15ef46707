//! The per-rollout file lock.
//!
//! Writers hold `flock(LOCK_EX)` on `R.tokens.lock`, readers `LOCK_SH`. `flock` locks belong to
//! an open file description, so threads of one process exclude each other exactly like separate
//! processes do: every acquisition opens its own descriptor.
//!
//! `delete` unlinks the lock file while holding it. A waiter that opened the old inode would
//! then hold a lock nobody else can see, so after locking we check that the path still names
//! the inode we locked and start over if it does not (lock, then verify).
//!
//! The store keeps a rollout's lock file open between its writes (`RolloutLock::unlock`,
//! `RolloutLock::relock`): opening it by name was the costliest step of a put after the
//! fsync. A kept descriptor is only ever used by one thread at a time (it travels with the
//! rollout's cached index, which a thread takes out of the cache while it works).
//!
//! A forked child inherits a copy of every lock descriptor its parent has open, and an flock
//! belongs to the open file description the copy shares: were the parent to die while holding
//! a lock (SIGKILL mid-put), the lock would stay held for as long as the child lived. So every
//! lock file's descriptor is a [`LockFile`], listed while it is open, and a forked child puts
//! `/dev/null` in place of each (`tokencapture.forking`'s after-fork hook, through
//! [`take_inherited_lock_files`]): the child never uses its parent's objects (`crate::fork`),
//! and a number that stays taken by `/dev/null` is never reused under a leaked one.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::ops::Deref;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwapOption;

use crate::error::{Error, IoContext, Result};

/// Shared (readers) or exclusive (writers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    Shared,
    Exclusive,
}

/// The identity of a file (device and inode): whether a path still names an open file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    pub(crate) fn of(meta: &std::fs::Metadata) -> Self {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// The lock file descriptors open in one process. Each process lists its own: a forked child
/// never locks its parent's list (a parent's thread may have held it at the fork, and would
/// never release it in the child), except once, without waiting, to take what it inherited.
struct OpenLockFiles {
    pid: u32,
    fds: Mutex<Vec<RawFd>>,
}

static OPEN_LOCK_FILES: ArcSwapOption<OpenLockFiles> = ArcSwapOption::const_empty();

/// This process's list (made on first use; a forked child's parent's is leaked, never used).
fn open_lock_files() -> Arc<OpenLockFiles> {
    let pid = crate::fork::current_pid();
    let made = crate::fork::this_process(
        &OPEN_LOCK_FILES,
        pid,
        |list| list.pid,
        |_| {
            Ok::<_, std::convert::Infallible>(OpenLockFiles {
                pid,
                fds: Mutex::new(Vec::new()),
            })
        },
    );
    match made {
        Ok(list) => list,
        Err(never) => match never {},
    }
}

/// A lock file's descriptor, on its process's list from its open to its close (see the module
/// documentation).
#[derive(Debug)]
pub struct LockFile {
    file: File,
    list: Arc<OpenLockFiles>,
}

impl std::fmt::Debug for OpenLockFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenLockFiles")
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl LockFile {
    /// `file`, listed until it is closed.
    pub(crate) fn new(file: File) -> Self {
        let list = open_lock_files();
        list.fds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(file.as_raw_fd());
        LockFile { file, list }
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Off the list before the number is closed (the `File` is dropped after this), so the
        // list never names a number this process has reused. A parent's descriptor dropped in
        // a child is on the parent's list, which the child leaves alone.
        if self.list.pid != crate::fork::current_pid() {
            return;
        }
        let fd = self.file.as_raw_fd();
        let mut fds = self.list.fds.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = fds.iter().rposition(|&listed| listed == fd) {
            fds.swap_remove(at);
        }
    }
}

impl Deref for LockFile {
    type Target = File;
    fn deref(&self) -> &File {
        &self.file
    }
}

/// In a forked child, first thing: the numbers of the lock file descriptors its parent had
/// open at the fork (the child's copies now), for the caller to put `/dev/null` in their
/// place. Empty in a process that is not a child of the list's process (a second call, a
/// grandchild of a parent that forked without this hook), and when a thread of the parent was
/// changing the list at the fork (that thread is not here to finish): those copies stay open.
pub fn take_inherited_lock_files() -> Vec<RawFd> {
    let Some(parents) = OPEN_LOCK_FILES.load_full() else {
        return Vec::new();
    };
    if parents.pid == crate::fork::current_pid()
        || parents.pid != std::os::unix::process::parent_id()
    {
        return Vec::new();
    }
    let taken = match parents.fds.try_lock() {
        Ok(mut fds) => std::mem::take(&mut *fds),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => {
            std::mem::take(&mut *poisoned.into_inner())
        }
        Err(std::sync::TryLockError::WouldBlock) => Vec::new(),
    };
    open_lock_files(); // this process's own list from here on
    taken
}

/// A held lock; dropping it releases the lock, then closes the descriptor.
///
/// Released explicitly, not by the close alone: a forked child holds a copy of the descriptor
/// (the same open file description, which is what an flock belongs to), so a close in the
/// parent would leave the lock held for as long as the child lives, and every reader and
/// writer of the rollout, in every process, would wait for it. The child never locks or
/// unlocks a descriptor it inherited (the kept-lock pid checks), so the parent's unlock
/// releases only what the parent took.
#[derive(Debug)]
pub struct RolloutLock {
    /// Always `Some` until [`RolloutLock::unlock`] takes it.
    file: Option<LockFile>,
    id: FileId,
}

impl Drop for RolloutLock {
    fn drop(&mut self) {
        if let Some(file) = &self.file {
            // Failing to unlock leaves only the close, which is all there was before.
            let _ = file.unlock();
        }
    }
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

    /// A shared lock for a reader that needs no write access: an existing lock file is opened
    /// read-only (`flock` works on any descriptor), so a read-only mount or a user who may
    /// only read can still read. An absent one is created, as [`RolloutLock::acquire`] would.
    ///
    /// `Ok(None)`: the lock file is absent and the filesystem is read-only, so it cannot be
    /// created. Nothing writes through a read-only mount and every writer creates the lock
    /// file before anything else, so the caller reads without a lock. Any other failure to
    /// create it is the error: without write permission (`EACCES`) another user may be
    /// writing, and reading unlocked could see a write its writer is about to undo.
    pub fn acquire_to_read(path: &Path) -> Result<Option<Self>> {
        let mut read_only_fs = false;
        loop {
            if let Some(lock) = Self::attempt(path, LockMode::Shared, false)? {
                return Ok(Some(lock));
            }
            if read_only_fs {
                return Ok(None); // still absent: nobody created it meanwhile
            }
            match Self::attempt(path, LockMode::Shared, true) {
                Ok(lock) => return Ok(lock),
                Err(Error::Io { source, .. })
                    if source.kind() == io::ErrorKind::ReadOnlyFilesystem =>
                {
                    read_only_fs = true; // look once more: another mount may have made it
                }
                // Made by another process meanwhile (an existing file this user cannot open
                // for writing): the next round opens it read-only.
                Err(Error::Io { source, .. })
                    if source.kind() == io::ErrorKind::PermissionDenied && path.exists() => {}
                Err(Error::Io {
                    op: "open lock",
                    source,
                    ..
                }) => return Err(source).ctx("create missing lock file", path),
                Err(err) => return Err(err),
            }
        }
    }

    /// One lock-then-verify round; `None` means "retry" with `create`, "absent" without.
    fn attempt(path: &Path, mode: LockMode, create: bool) -> Result<Option<Self>> {
        loop {
            let mut options = OpenOptions::new();
            options
                .read(true)
                .write(create)
                .create(create)
                .truncate(false);
            let opened = crate::descriptors::retry(|| options.open(path));
            let file = match opened {
                Ok(file) => LockFile::new(file),
                Err(err) if !create && err.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(err) => return Err(err).ctx("open lock", path),
            };
            let id = FileId::of(&file.metadata().ctx("stat lock", path)?);
            if let Some(lock) = Self::relock(file, id, path, mode)? {
                return Ok(Some(lock));
            }
            // Unlinked or replaced while we waited: the lock we held guarded nothing. The next
            // round opens what the path names now (and without `create`, finds it absent).
        }
    }

    /// Lock `file` again: the descriptor of an earlier lock on `path` (identity `id`) that
    /// this process kept open after [`RolloutLock::unlock`]. `Ok(None)` (and the lock
    /// released, the descriptor closed) when `path` no longer names that file: the caller
    /// acquires afresh.
    pub(crate) fn relock(
        file: LockFile,
        id: FileId,
        path: &Path,
        mode: LockMode,
    ) -> Result<Option<Self>> {
        lock_retrying_eintr(&file, mode).ctx("lock", path)?;
        // Held from here on: dropped on any way out below, it is released.
        let lock = RolloutLock {
            file: Some(file),
            id,
        };
        match std::fs::metadata(path) {
            Ok(now) if FileId::of(&now) == id => Ok(Some(lock)),
            Ok(_) => Ok(None),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(err).ctx("stat lock", path),
        }
    }

    /// Release the lock and keep the descriptor (with its identity) for [`RolloutLock::relock`].
    /// `None` if unlocking failed; the descriptor is then closed, which releases the lock.
    pub(crate) fn unlock(mut self) -> Option<(LockFile, FileId)> {
        let file = self.file.take()?;
        file.unlock().ok()?;
        Some((file, self.id))
    }

    #[cfg(test)]
    fn file(&self) -> &File {
        self.file.as_ref().expect("a held lock's descriptor")
    }

    /// The locked descriptor (tests check which one an acquisition used).
    #[cfg(test)]
    pub(crate) fn file_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.file().as_raw_fd()
    }

    /// A duplicate of the locked descriptor (the same open file description, as a forked
    /// child holds one).
    #[cfg(test)]
    pub(crate) fn duplicate(&self) -> File {
        self.file().try_clone().expect("dup")
    }

    /// Try to lock without waiting; `Ok(None)` when another holder has it (used by tests and
    /// tooling that must not block).
    pub fn try_acquire(path: &Path, mode: LockMode) -> Result<Option<Self>> {
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        let file = crate::descriptors::retry(|| options.open(path)).ctx("open lock", path)?;
        let file = LockFile::new(file);
        let id = FileId::of(&file.metadata().ctx("stat lock", path)?);
        let attempt = match mode {
            LockMode::Shared => file.try_lock_shared(),
            LockMode::Exclusive => file.try_lock(),
        };
        match attempt {
            Ok(()) => Ok(Some(RolloutLock {
                file: Some(file),
                id,
            })),
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

    /// A forked child holds a duplicate of every descriptor its parent had open, sharing the
    /// open file description and with it the flock. A lock the parent lets go of by closing
    /// its descriptor (an error path drops its `RolloutLock`) would then stay held for as
    /// long as the child lives: every other reader and writer of the rollout, in every
    /// process, would wait for the child to exit.
    #[test]
    fn a_dropped_lock_is_released_though_a_forked_child_shares_its_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.lock");
        for mode in [LockMode::Exclusive, LockMode::Shared] {
            let held = RolloutLock::acquire(&path, mode).unwrap();
            let childs_copy = held.duplicate();
            drop(held);
            assert!(
                RolloutLock::try_acquire(&path, LockMode::Exclusive)
                    .unwrap()
                    .is_some(),
                "{mode:?} lock still held through the child's copy of its descriptor"
            );
            drop(childs_copy);
        }
    }

    /// `relock` through a kept descriptor whose path now names another file gives up the lock
    /// it took on the old one, though a forked child shares that descriptor: a process that
    /// opened the old file before it was replaced and waits to lock it must not wait for the
    /// child (it then finds the file replaced and moves on to the new one).
    #[test]
    fn a_relock_that_finds_its_file_replaced_releases_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.tokens.lock");
        let (kept, id) = RolloutLock::acquire(&path, LockMode::Exclusive)
            .unwrap()
            .unlock()
            .unwrap();
        let childs_copy = kept.try_clone().unwrap();
        let waiter = OpenOptions::new().read(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"").unwrap();
        let relocked = RolloutLock::relock(kept, id, &path, LockMode::Exclusive).unwrap();
        assert!(relocked.is_none(), "the path names another file now");
        assert!(
            waiter.try_lock().is_ok(),
            "the old lock file is still locked through the child's copy"
        );
        drop(childs_copy);
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
