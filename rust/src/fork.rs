//! Objects that survive `fork`: each process uses its own.
//!
//! A forked child has one thread, but a copy of the parent's whole memory, including every
//! mutex another thread of the parent held at that instant: locked, by a thread that does not
//! exist in the child, forever. The core's objects are full of short-held mutexes (a cache's
//! LRU, the writers' queues, the descriptor budget's gate), and a thread that has just left
//! the interpreter to enter the core is exactly the one a forking thread runs behind, so a
//! child that touched any of them would often hang in its first call.
//!
//! [`PerProcess`] holds an object together with the id of the process that opened it. Every
//! use compares that id with this process's (`getpid`, one system call) through a lock-free
//! pointer ([`arc_swap::ArcSwap`]: an atomic load, no mutex) *before* anything of the object
//! is touched. In a forked child the first use opens a fresh object the same way the
//! original was opened (same root, same options) and swaps it in with a compare-and-swap;
//! the parent's copy is leaked, never locked, read or dropped there: its mutexes may be held
//! by threads that are gone, its maps may be half-updated, and dropping what it holds may
//! answer the parent's waiters (a queued put's completion) or close what the parent still
//! relies on.
//!
//! Process-wide state follows the same rule: the descriptor budget
//! ([`crate::descriptors::budget`]) and the worker pool of the Python bindings are looked up
//! by process id through the same kind of pointer, and a child creates its own.

use std::sync::Arc;

use arc_swap::ArcSwapOption;

/// The id of the calling process (`getpid`; never cached, so a forked child sees its own).
pub fn current_pid() -> u32 {
    std::process::id()
}

/// The value in `slot` that process `pid` made (`pid_of` tells whose a value is), or one
/// `make` makes, given the value of the process before (a forked child's parent's), installed
/// with a compare-and-swap: lock-free, an atomic load and, once per process, a swap. The
/// previous process's value is leaked, never dropped here (dropping it could lock what its
/// threads held); threads of one process racing here agree on one value, the others' are
/// dropped unshared. For process-wide state (the descriptor budget, the bindings' pool).
pub fn this_process<T, E>(
    slot: &ArcSwapOption<T>,
    pid: u32,
    pid_of: impl Fn(&T) -> u32,
    mut make: impl FnMut(Option<&T>) -> Result<T, E>,
) -> Result<Arc<T>, E> {
    loop {
        let seen = slot.load_full();
        if let Some(current) = seen.as_ref().filter(|current| pid_of(current) == pid) {
            return Ok(Arc::clone(current));
        }
        let fresh = Arc::new(make(seen.as_deref())?);
        let previous = slot.compare_and_swap(&seen, Some(Arc::clone(&fresh)));
        let swapped = match (previous.as_ref(), seen.as_ref()) {
            (Some(previous), Some(seen)) => Arc::ptr_eq(previous, seen),
            (None, None) => true,
            _ => false,
        };
        if swapped {
            if let Some(before) = seen {
                std::mem::forget(before); // leaked, never dropped in this process
            }
            return Ok(fresh);
        }
    }
}

/// An object and the process that opened it.
struct Opened<T> {
    pid: u32,
    value: Arc<T>,
}

type Reopen<T, E> = Box<dyn Fn() -> Result<T, E> + Send + Sync>;

/// An object of this process, reopened (by `reopen`) in a forked child on first use; see the
/// module documentation.
pub struct PerProcess<T, E> {
    /// Always set (an `Option` only to share [`this_process`] with process-wide state).
    current: ArcSwapOption<Opened<T>>,
    reopen: Reopen<T, E>,
}

impl<T, E> std::fmt::Debug for PerProcess<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerProcess")
            .field(
                "pid",
                &self.current.load().as_ref().map(|opened| opened.pid),
            )
            .finish_non_exhaustive()
    }
}

impl<T, E> PerProcess<T, E> {
    /// `value`, opened in this process; `reopen` opens an equivalent one in a forked child.
    pub fn new(value: T, reopen: impl Fn() -> Result<T, E> + Send + Sync + 'static) -> Self {
        PerProcess {
            current: ArcSwapOption::from_pointee(Opened {
                pid: current_pid(),
                value: Arc::new(value),
            }),
            reopen: Box::new(reopen),
        }
    }

    /// The object `open` opens now, which it opens again in a forked child.
    pub fn open(open: impl Fn() -> Result<T, E> + Send + Sync + 'static) -> Result<Self, E> {
        Ok(Self::new(open()?, open))
    }

    /// This process's object (opened now if this is a forked child's first use).
    pub fn get(&self) -> Result<Arc<T>, E> {
        self.get_in(current_pid())
    }

    /// [`PerProcess::get`] as process `pid` (tests pretend to be a child with another id).
    fn get_in(&self, pid: u32) -> Result<Arc<T>, E> {
        // In a forked child's first use a fresh object is opened beside the parent's, which is
        // never touched and is leaked (see the module documentation).
        let opened = this_process(
            &self.current,
            pid,
            |opened| opened.pid,
            |_parents| {
                Ok(Opened {
                    pid,
                    value: Arc::new((self.reopen)()?),
                })
            },
        )?;
        Ok(Arc::clone(&opened.value))
    }

    /// Whether the object in use was opened by this process (tests).
    pub fn opened_here(&self) -> bool {
        self.current
            .load()
            .as_ref()
            .is_some_and(|opened| opened.pid == current_pid())
    }
}

impl<T, E> Drop for PerProcess<T, E> {
    fn drop(&mut self) {
        // A child dropping an object it never used: the parent's copy is leaked, not dropped.
        if let Some(current) = self.current.load_full() {
            if current.pid != current_pid() {
                std::mem::forget(current);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// Counts its drops, and holds a mutex a "parent thread" may keep locked.
    struct Object {
        generation: usize,
        lock: Mutex<()>,
        drops: Arc<AtomicUsize>,
    }

    impl Drop for Object {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn handle() -> (
        PerProcess<Object, String>,
        Arc<AtomicUsize>,
        Arc<AtomicUsize>,
    ) {
        let drops = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(1));
        let first = Object {
            generation: 0,
            lock: Mutex::new(()),
            drops: Arc::clone(&drops),
        };
        let (reopen_drops, reopen_count) = (Arc::clone(&drops), Arc::clone(&opened));
        let handle = PerProcess::new(first, move || {
            let generation = reopen_count.fetch_add(1, Ordering::SeqCst);
            Ok(Object {
                generation,
                lock: Mutex::new(()),
                drops: Arc::clone(&reopen_drops),
            })
        });
        (handle, drops, opened)
    }

    #[test]
    fn the_opening_process_keeps_its_object() {
        let (handle, drops, opened) = handle();
        for _ in 0..3 {
            assert_eq!(handle.get().unwrap().generation, 0);
        }
        assert!(handle.opened_here());
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        drop(handle);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_child_opens_its_own_and_never_touches_or_drops_the_parents() {
        let (handle, drops, opened) = handle();
        let parent = handle.get_in(current_pid()).unwrap();
        // A thread of the "parent" holds the object's mutex and never lets go, as a thread
        // that does not exist in a forked child would.
        let held = parent.lock.lock().unwrap();
        std::mem::forget(held);
        let child_pid = current_pid().wrapping_add(1);
        let child = handle.get_in(child_pid).unwrap();
        assert_eq!(child.generation, 1);
        drop(child.lock.lock().unwrap()); // the child's own mutex is free
        assert!(handle.get_in(child_pid).unwrap().generation == 1);
        assert_eq!(opened.load(Ordering::SeqCst), 2, "opened once per process");
        drop(parent);
        // A grandchild opens its own again; the child's object was leaked likewise.
        let grandchild = handle.get_in(child_pid.wrapping_add(1)).unwrap();
        assert_eq!(grandchild.generation, 2);
        drop(grandchild);
        drop(handle);
        // Nothing was dropped: each process's object was leaked by the next one, and the
        // handle, dropped in a process that did not open its object, leaks that one too.
        assert_eq!(drops.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn threads_of_a_child_agree_on_one_object() {
        let (handle, _drops, opened) = handle();
        let child_pid = current_pid().wrapping_add(7);
        let generations: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| scope.spawn(|| handle.get_in(child_pid).unwrap().generation))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let installed = handle.get_in(child_pid).unwrap().generation;
        assert!(
            generations.iter().all(|&g| g == installed),
            "{generations:?}"
        );
        // Racing threads may each have opened one, but one was installed and kept.
        assert!(opened.load(Ordering::SeqCst) >= 2);
    }

    #[test]
    fn a_failed_reopen_is_returned_and_retried_next_time() {
        let fails = Arc::new(AtomicUsize::new(1));
        let remaining = Arc::clone(&fails);
        let handle: PerProcess<usize, String> = PerProcess::new(0, move || {
            if remaining.fetch_sub(1, Ordering::SeqCst) > 0 {
                Err("cannot open".to_owned())
            } else {
                Ok(1)
            }
        });
        let child = current_pid().wrapping_add(1);
        assert_eq!(handle.get_in(child).unwrap_err(), "cannot open");
        assert_eq!(*handle.get_in(child).unwrap(), 1);
        assert_eq!(fails.load(Ordering::SeqCst), usize::MAX); // wrapped: called twice
    }
}
