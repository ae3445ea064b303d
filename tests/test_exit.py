"""Interpreter exit with daemon threads inside admitgate.

CPython before 3.14 ends a daemon thread that takes the GIL once finalization has begun with
``pthread_exit``. A thread inside admitgate's Rust code at that moment (a slot handed to an
async waiter runs ``call_soon_threadsafe``; a policy's ``decide`` runs Python) used to crash
the process: about 1 exit in 100 of a process with busy daemon ``admit_sync`` threads ended
with SIGABRT ("FATAL: exception not rethrown"), SIGSEGV or SIGBUS. The tests here make that
moment certain instead of rare: the daemon thread is inside a call-out, releasing the GIL,
while the main thread finalizes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A daemon thread sleeps (GIL released) inside the gate's call to a policy's ``decide``
# while the main thread finalizes: the finalizing garbage collection runs a finalizer that
# releases the GIL for longer than that sleep, so the daemon thread wakes, inside admitgate,
# while the interpreter finalizes. Before the exit hook this crashed every time or nearly.
PROGRAM = textwrap.dedent(
    """
    import atexit, gc, threading, time
    # Registered before admitgate's hook, so it runs after it: how long that hook waited.
    returned = []
    atexit.register(lambda: print(f"hook waited {time.monotonic() - returned[0]:.3f}"))
    import admitgate

    entered = threading.Event()

    class SlowPolicy(admitgate.ConcurrencyLimitPolicy):
        def decide(self, **facts):
            if threading.current_thread() is not threading.main_thread():
                entered.set()
                time.sleep(0.2)
            return super().decide(**facts)

    class SlowGarbage:
        # Collected by the garbage collection the interpreter runs while it finalizes
        # (module globals may be gone by then, so the sleep is bound now).
        def __del__(self, sleep=time.sleep):
            sleep(0.5)

    gate = admitgate.AdmissionGate(SlowPolicy(max_concurrent_runs=2, queue_depth=1))

    def worker():
        while True:
            with gate.admit_sync(session_id="t"):
                pass

    for _ in range(3):
        threading.Thread(target=worker, daemon=True).start()
    entered.wait(5)
    gc.collect()
    garbage = SlowGarbage()
    garbage.cycle = garbage
    del garbage
    returned.append(time.monotonic())
    print("main returns", flush=True)
    """
)


def test_exit_with_a_daemon_thread_inside_a_call_out_is_clean():
    """The exit hook waits for the daemon threads to leave the gate and parks them when they
    come back: the process exits 0 with nothing on stderr. The threads park inside a nested
    entry (``decide`` calls the Rust base class), which must not keep the hook waiting for
    its whole timeout (1 s): it waits about as long as the call-out sleeps (0.2 s)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "main returns" in proc.stdout
    assert proc.stderr == "", proc.stderr[-2000:]
    waited = float(proc.stdout.split("hook waited ")[1])
    assert waited < 0.9, f"the exit hook waited {waited} s (its timeout is 1 s)"


def test_a_thread_entering_after_the_exit_hook_parks_and_the_process_exits():
    """After the hook, a daemon thread that enters the gate parks (with the GIL released)
    instead of running: the exit is not held up by it and nothing it holds is lost."""
    program = textwrap.dedent(
        """
        import atexit, threading, time
        import admitgate
        gate = admitgate.build_admission_gate(max_concurrent_runs=4)
        go = threading.Event()
        entered = []
        def late():
            go.wait()
            with gate.admit_sync():
                entered.append(1)
        threading.Thread(target=late, daemon=True).start()

        def after_quiesce():
            # atexit runs hooks last-registered first, so this one runs before admitgate's:
            # it runs admitgate's hook itself (running it twice is harmless), then lets the
            # thread enter the gate.
            admitgate._admitgate._quiesce_at_exit()
            go.set()
            time.sleep(0.2)
            print("entered" if entered else "parked", flush=True)
        atexit.register(after_quiesce)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "parked"


def test_a_forked_child_does_not_wait_for_the_parents_threads_at_exit():
    """A child forked while another thread is inside the gate inherits that thread's depth
    but not the thread: its exit hook must not wait for it."""
    program = textwrap.dedent(
        """
        import atexit, os, threading, time
        import admitgate

        entered = threading.Event()

        class SlowPolicy(admitgate.ConcurrencyLimitPolicy):
            def decide(self, **facts):
                if threading.current_thread() is not threading.main_thread():
                    entered.set()
                    time.sleep(2)
                return super().decide(**facts)

        gate = admitgate.AdmissionGate(SlowPolicy(max_concurrent_runs=2, queue_depth=1))

        def worker():
            with gate.admit_sync():
                pass

        threading.Thread(target=worker, daemon=True).start()
        entered.wait(5)
        pid = os.fork()
        if pid == 0:
            start = time.monotonic()
            admitgate._admitgate._quiesce_at_exit()
            os.write(1, f"child hook waited {time.monotonic() - start:.3f}\\n".encode())
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        os._exit(0)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child status 0" in proc.stdout, proc.stdout
    waited = float(proc.stdout.split("child hook waited ")[1].split()[0])
    assert waited < 0.5, f"the child's exit hook waited {waited} s for a thread it does not have"
