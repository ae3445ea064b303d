//! The one place the core takes its locks from, so loom can model them.
//!
//! Under `--cfg admitgate_loom` the mutex is loom's, and the model tests in `gate.rs` explore
//! every interleaving of the operations that take it. Otherwise it is parking_lot's: small,
//! fair enough, and it does not poison, so a panic inside a critical section leaves the gate
//! usable (the state is only ever mutated through methods that keep it consistent).

#[cfg(not(admitgate_loom))]
pub(crate) use parking_lot::Mutex;

/// The atomic counting turns let through ([`super::passthrough`]), which races the gate's
/// adoption of them: loom's under the models, so they explore that race too.
#[cfg(not(admitgate_loom))]
pub(crate) use std::sync::atomic::AtomicU64;

#[cfg(admitgate_loom)]
pub(crate) use loom::sync::atomic::AtomicU64;

#[cfg(admitgate_loom)]
pub(crate) use self::loom_shim::Mutex;

#[cfg(admitgate_loom)]
mod loom_shim {
    /// loom's mutex with parking_lot's interface (`lock()` returns the guard directly).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            // loom's mutex never reports poisoning; taking the guard either way is what
            // parking_lot does.
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        }
    }
}
