//! Catching panics without catching a thread's forced exit.
//!
//! `catch_unwind` catches every unwind that reaches it, including the *forced unwind* with
//! which `pthread_exit` ends a thread. Catching that one aborts the process (glibc: "FATAL:
//! exception not rethrown"). It is not hypothetical here: CPython before 3.14 ends with
//! `pthread_exit` any thread that takes the GIL while the interpreter finalizes, and a daemon
//! thread can be inside the gate at that moment (waking a waiter on another event loop runs
//! Python code, which may switch threads). [`catch_panic`] catches Rust panics only; a forced
//! unwind that reaches it parks the thread for good instead, as CPython 3.14 does to such
//! threads itself (and PyO3 where its own re-attach meets a finalizing interpreter): the
//! thread never runs again and the process exits around it. Locks the unwind passed through
//! were released by their guards on the way.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Parks its thread for good when dropped by an unwind that is not a Rust panic
/// (`std::thread::panicking` is false during a forced unwind, true during a panic).
struct ParkOnForcedUnwind;

impl Drop for ParkOnForcedUnwind {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            loop {
                std::thread::park();
            }
        }
    }
}

/// Runs `f`, returning a Rust panic's payload as `Err` as [`catch_unwind`] does; a forced
/// unwind (a thread's exit) parks the thread instead of being caught.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    catch_unwind(AssertUnwindSafe(|| {
        let park = ParkOnForcedUnwind;
        let value = f();
        // Not dropped: the guard only acts when an unwind drops it.
        std::mem::forget(park);
        value
    }))
}

#[cfg(test)]
mod tests {
    use super::catch_panic;

    #[test]
    fn returns_values_and_catches_panics_as_catch_unwind_does() {
        assert_eq!(catch_panic(|| 7).ok(), Some(7));
        let payload = catch_panic(|| -> u8 { panic!("boom") }).err();
        let message = payload
            .as_ref()
            .and_then(|p| p.downcast_ref::<&str>())
            .copied();
        assert_eq!(message, Some("boom"));
    }
}
