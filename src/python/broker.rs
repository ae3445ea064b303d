//! `admitgate.broker.serve()` and `python -m admitgate broker`: the broker (`crates/broker`)
//! run in this process, blocking the calling thread with the GIL released.
//!
//! # Signals
//!
//! The broker runs on its own tokio runtime ([`admitgate_broker::Running`]) and installs no
//! signal handlers of its own: the process's signals stay the interpreter's. The calling
//! thread waits for the broker in slices of [`SLICE`], detached, and between them takes the
//! GIL to run `Python`'s pending signal handlers (`PyErr_CheckSignals`). So:
//!
//! * **A handler that raises** (SIGINT's default raises `KeyboardInterrupt`; any handler the
//!   user installed may raise) starts the broker's drain, the same as SIGTERM to the binary:
//!   stop accepting, refuse queued requests with `closing`, let running ones finish for up
//!   to `drain_timeout`. The exception is raised once the drain is over.
//! * **SIGTERM (and SIGINT) left at the default action** (`SIG_DFL`, which would kill the
//!   process without a drain) get a handler of serve()'s own for its duration, which asks
//!   for the same drain; serve() then returns `None`. The previous handlers are put back
//!   before serve() returns or raises, as uvicorn does.
//! * **A handler that returns** (the user's choice) and ignored signals leave the broker
//!   serving.
//! * **A second exception during the drain** cuts it: the connections and requests still
//!   open are closed at once, and that exception is raised. A second SIGTERM is ignored,
//!   as by the binary (the drain has its bound).
//!
//! Python runs signal handlers in the main thread only, so serve() refuses to run elsewhere
//! (nothing could stop it there), and one broker runs at a time per process (a second call
//! while one serves, from a signal handler, is refused).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use admitgate_broker::config::Naming;
use admitgate_broker::{logging, Config, Error, Flags, Running};
use parking_lot::Mutex;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use super::args;
use super::errors::{guard, InternalError};
use super::exit::detach_counted;

/// How long the calling thread waits for the broker before it looks at signals again.
const SLICE: Duration = Duration::from_millis(100);

/// Set while a broker serves in this process.
static SERVING: AtomicBool = AtomicBool::new(false);

/// The signal handlers the serving broker replaced, to put back when it ends (or in a forked
/// child, which has no broker). Locked only while attached, never across a call into Python,
/// so a forked child never inherits it locked.
static REPLACED: Mutex<Vec<(i32, Py<PyAny>)>> = Mutex::new(Vec::new());

/// A keyword argument: absent and `None` both mean "not given" (the YAML file or the
/// default decides, as for an absent flag).
fn given<'a, 'py>(value: &'a Option<Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    value.as_ref().filter(|v| !v.is_none())
}

fn text(name: &str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    let Some(value) = given(value) else {
        return Ok(None);
    };
    match value.cast::<PyString>() {
        Ok(text) => Ok(Some(text.to_str()?.to_owned())),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name} must be a str, got {}",
            args::repr(value)
        ))),
    }
}

/// A list of str (`priority=["interactive:min=0.5", "batch"]`, one per `--priority`); a
/// single str is refused rather than read as its characters.
fn texts(name: &str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let Some(value) = given(value) else {
        return Ok(Vec::new());
    };
    let bad = || {
        PyTypeError::new_err(format!(
            "{name} must be a list of str (one per class), got {}",
            args::repr(value)
        ))
    };
    if value.is_instance_of::<PyString>() {
        return Err(bad());
    }
    let mut out = Vec::new();
    for item in value.try_iter().map_err(|_| bad())? {
        let item = item?;
        let text = item.cast::<PyString>().map_err(|_| bad())?;
        out.push(text.to_str()?.to_owned());
    }
    Ok(out)
}

/// The fleet URL: like [`text`], but a bad value is named by its type only, never shown (it
/// may hold the Redis password).
fn secret_text(name: &str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    let Some(value) = given(value) else {
        return Ok(None);
    };
    match value.cast::<PyString>() {
        Ok(text) => Ok(Some(text.to_str()?.to_owned())),
        Err(_) => {
            let kind = value
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".to_owned());
            Err(PyTypeError::new_err(format!(
                "{name} must be a str (a redis:// or rediss:// URL), got a {kind} (not shown: \
                 it may hold a password)"
            )))
        }
    }
}

fn count(name: &'static str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<u32>> {
    given(value).map(|v| args::count(name, v)).transpose()
}

fn number(name: &'static str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<f64>> {
    given(value).map(|v| args::number(name, v)).transpose()
}

fn path(name: &str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<PathBuf>> {
    let Some(value) = given(value) else {
        return Ok(None);
    };
    if value.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a path (str or os.PathLike), got {}",
            args::repr(value)
        )));
    }
    value.extract::<PathBuf>().map(Some).map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a path (str or os.PathLike), got {}",
            args::repr(value)
        ))
    })
}

fn address(name: &str, value: &Option<Bound<'_, PyAny>>) -> PyResult<Option<SocketAddr>> {
    let Some(shown) = given(value) else {
        return Ok(None);
    };
    let Some(text) = text(name, value)? else {
        return Ok(None);
    };
    text.trim().parse::<SocketAddr>().map(Some).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be an IP:port address such as 127.0.0.1:8080, got {}",
            args::repr(shown)
        ))
    })
}

/// A broker error as the Python exception a caller would expect: a port that cannot be
/// bound is an `OSError` (with its errno) naming the setting and the address; a setting that
/// cannot be used a `ValueError`; a panic `admitgate.InternalError`.
fn broker_error(error: Error) -> PyErr {
    match &error {
        Error::Bind { source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, error.to_string())),
            None => PyOSError::new_err(error.to_string()),
        },
        Error::Settings(message) => PyValueError::new_err(message.clone()),
        Error::Start(message) => PyRuntimeError::new_err(message.clone()),
        Error::Panicked(message) => {
            InternalError::new_err(format!("admitgate internal error (Rust panic): {message}"))
        }
    }
}

/// serve()'s handler for a signal whose action was the default: asks for the drain.
#[pyclass(frozen, module = "admitgate._admitgate", name = "_DrainOnSignal")]
struct DrainOnSignal {
    requested: Arc<AtomicBool>,
}

#[pymethods]
impl DrainOnSignal {
    fn __call__(&self, _signum: &Bound<'_, PyAny>, _frame: &Bound<'_, PyAny>) {
        self.requested.store(true, Ordering::Relaxed);
    }
}

/// For SIGTERM and SIGINT left at `SIG_DFL`: a handler that sets `requested`, the previous
/// one kept in [`REPLACED`].
fn install_handlers(py: Python<'_>, requested: &Arc<AtomicBool>) -> PyResult<()> {
    let signal = py.import("signal")?;
    let default = signal.getattr("SIG_DFL")?;
    let handler = Py::new(
        py,
        DrainOnSignal {
            requested: requested.clone(),
        },
    )?;
    for name in ["SIGTERM", "SIGINT"] {
        let signum: i32 = signal.getattr(name)?.extract()?;
        let previous = signal.call_method1("getsignal", (signum,))?;
        if previous.eq(&default)? {
            signal.call_method1("signal", (signum, handler.clone_ref(py)))?;
            REPLACED.lock().push((signum, previous.unbind()));
        }
    }
    Ok(())
}

/// Puts back the handlers [`install_handlers`] replaced.
fn restore_handlers(py: Python<'_>) -> PyResult<()> {
    let replaced = std::mem::take(&mut *REPLACED.lock());
    let signal = py.import("signal")?;
    for (signum, previous) in replaced {
        signal.call_method1("signal", (signum, previous))?;
    }
    Ok(())
}

/// In a freshly forked child: the parent's broker is not the child's (its runtime's threads
/// do not exist here), so the child gets the handlers back and may serve a broker of its own.
/// Without this, a child forked while its parent served would ignore SIGTERM.
pub fn reset_after_fork(py: Python<'_>) -> PyResult<()> {
    if SERVING.swap(false, Ordering::SeqCst) {
        restore_handlers(py)?;
    }
    Ok(())
}

fn in_main_thread(py: Python<'_>) -> PyResult<bool> {
    let threading = py.import("threading")?;
    let main = threading.call_method0("main_thread")?;
    let current = threading.call_method0("current_thread")?;
    Ok(main.is(&current))
}

/// Clears [`SERVING`] when serve() ends, however it ends.
struct Serving;

impl Drop for Serving {
    fn drop(&mut self) {
        SERVING.store(false, Ordering::SeqCst);
    }
}

/// Runs the broker for `config` in this process until a signal and its drain.
fn run(py: Python<'_>, config: Config) -> PyResult<()> {
    if !in_main_thread(py)? {
        return Err(PyRuntimeError::new_err(
            "admitgate.broker.serve() must be called from the main thread: Python runs signal \
             handlers there only, and a signal is what stops the broker",
        ));
    }
    if SERVING.swap(true, Ordering::SeqCst) {
        return Err(PyRuntimeError::new_err(
            "admitgate.broker.serve() is already running in this process (one broker at a time)",
        ));
    }
    let _serving = Serving;
    let requested = Arc::new(AtomicBool::new(false));
    // Before the broker listens, so a SIGTERM right after start-up drains too.
    let installed = install_handlers(py, &requested);
    let served = installed.and_then(|()| serve_until_stopped(py, config, &requested));
    let restored = restore_handlers(py);
    served.and(restored)
}

fn serve_until_stopped(py: Python<'_>, config: Config, requested: &AtomicBool) -> PyResult<()> {
    let mut running = py.detach(|| Running::start(config)).map_err(broker_error)?;
    let outcome = wait_for_the_end(py, &mut running, requested);
    // The runtime's threads are waited for detached (they never need the GIL, but the
    // process's other threads may).
    py.detach(move || drop(running));
    outcome
}

/// Waits for `running` to end, starting its drain when a signal asks for it.
fn wait_for_the_end(py: Python<'_>, running: &mut Running, requested: &AtomicBool) -> PyResult<()> {
    // The exception that started the drain, raised once it is over.
    let mut raised: Option<PyErr> = None;
    let mut draining = false;
    loop {
        if let Some(ended) = detach_counted(py, || running.wait(SLICE)) {
            return match (ended, raised) {
                (Err(error), _) => Err(broker_error(error)),
                (Ok(()), Some(exception)) => Err(exception),
                (Ok(()), None) => Ok(()),
            };
        }
        if let Err(exception) = py.check_signals() {
            if draining {
                // Asked twice: the drain is cut (the caller drops the runtime, and every
                // connection still open with it).
                logging::line(
                    "warning",
                    "drain_cut",
                    &[(
                        "why",
                        logging::text("a signal handler raised during the drain"),
                    )],
                );
                return Err(exception);
            }
            raised = Some(exception);
        }
        if !draining && (raised.is_some() || requested.load(Ordering::Relaxed)) {
            running.stop();
            draining = true;
        }
    }
}

/// Runs the broker (``crates/broker``) in this process until SIGTERM / SIGINT and its drain.
#[pyfunction]
#[pyo3(signature = (
    *,
    upstream=None,
    listen=None,
    grpc_upstream=None,
    upstream_protocol=None,
    max_in_flight=None,
    queue_depth=None,
    overflow_policy=None,
    queue_timeout=None,
    max_in_flight_per_tenant=None,
    tenant_from=None,
    rate_limit=None,
    rate_key=None,
    gate_methods=None,
    path_prefix=None,
    jsonrpc_path=None,
    max_peek_bytes=None,
    fleet=None,
    fleet_key=None,
    fleet_on_error=None,
    fleet_tls_ca_file=None,
    fleet_tls_cert_file=None,
    fleet_tls_key_file=None,
    fleet_durability=None,
    metrics_listen=None,
    drain_timeout=None,
    first_bytes_timeout=None,
    upstream_idle_timeout=None,
    upstream_max_idle=None,
    memory_soft_ratio=None,
    memory_hard_ratio=None,
    memory_cgroup=None,
    request_body_timeout=None,
    max_buffered_body=None,
    abandoned_response_timeout=None,
    send_timeout=None,
    threads=None,
    readiness_path=None,
    priority=None,
    default_priority=None,
    priority_from=None,
    fairness=None,
    config=None,
))]
#[allow(
    clippy::too_many_arguments,
    reason = "one keyword per broker flag, as the binary has"
)]
pub fn serve_broker(
    py: Python<'_>,
    upstream: Option<Bound<'_, PyAny>>,
    listen: Option<Bound<'_, PyAny>>,
    grpc_upstream: Option<Bound<'_, PyAny>>,
    upstream_protocol: Option<Bound<'_, PyAny>>,
    max_in_flight: Option<Bound<'_, PyAny>>,
    queue_depth: Option<Bound<'_, PyAny>>,
    overflow_policy: Option<Bound<'_, PyAny>>,
    queue_timeout: Option<Bound<'_, PyAny>>,
    max_in_flight_per_tenant: Option<Bound<'_, PyAny>>,
    tenant_from: Option<Bound<'_, PyAny>>,
    rate_limit: Option<Bound<'_, PyAny>>,
    rate_key: Option<Bound<'_, PyAny>>,
    gate_methods: Option<Bound<'_, PyAny>>,
    path_prefix: Option<Bound<'_, PyAny>>,
    jsonrpc_path: Option<Bound<'_, PyAny>>,
    max_peek_bytes: Option<Bound<'_, PyAny>>,
    fleet: Option<Bound<'_, PyAny>>,
    fleet_key: Option<Bound<'_, PyAny>>,
    fleet_on_error: Option<Bound<'_, PyAny>>,
    fleet_tls_ca_file: Option<Bound<'_, PyAny>>,
    fleet_tls_cert_file: Option<Bound<'_, PyAny>>,
    fleet_tls_key_file: Option<Bound<'_, PyAny>>,
    fleet_durability: Option<Bound<'_, PyAny>>,
    metrics_listen: Option<Bound<'_, PyAny>>,
    drain_timeout: Option<Bound<'_, PyAny>>,
    first_bytes_timeout: Option<Bound<'_, PyAny>>,
    upstream_idle_timeout: Option<Bound<'_, PyAny>>,
    upstream_max_idle: Option<Bound<'_, PyAny>>,
    memory_soft_ratio: Option<Bound<'_, PyAny>>,
    memory_hard_ratio: Option<Bound<'_, PyAny>>,
    memory_cgroup: Option<Bound<'_, PyAny>>,
    request_body_timeout: Option<Bound<'_, PyAny>>,
    max_buffered_body: Option<Bound<'_, PyAny>>,
    abandoned_response_timeout: Option<Bound<'_, PyAny>>,
    send_timeout: Option<Bound<'_, PyAny>>,
    threads: Option<Bound<'_, PyAny>>,
    readiness_path: Option<Bound<'_, PyAny>>,
    priority: Option<Bound<'_, PyAny>>,
    default_priority: Option<Bound<'_, PyAny>>,
    priority_from: Option<Bound<'_, PyAny>>,
    fairness: Option<Bound<'_, PyAny>>,
    config: Option<Bound<'_, PyAny>>,
) -> PyResult<()> {
    guard(|| {
        // Converted here (types), validated by the broker's own rules (values), so a bad
        // value gets the binary's message, named as the keyword is.
        let flags = Flags {
            listen: address("listen", &listen)?,
            upstream: text("upstream", &upstream)?,
            grpc_upstream: text("grpc_upstream", &grpc_upstream)?,
            upstream_protocol: text("upstream_protocol", &upstream_protocol)?,
            max_in_flight: count("max_in_flight", &max_in_flight)?.map(i64::from),
            queue_depth: count("queue_depth", &queue_depth)?.map(i64::from),
            overflow_policy: text("overflow_policy", &overflow_policy)?,
            queue_timeout: number("queue_timeout", &queue_timeout)?,
            max_in_flight_per_tenant: count("max_in_flight_per_tenant", &max_in_flight_per_tenant)?
                .map(i64::from),
            tenant_from: text("tenant_from", &tenant_from)?,
            rate_limit: text("rate_limit", &rate_limit)?,
            rate_key: text("rate_key", &rate_key)?,
            gate_methods: text("gate_methods", &gate_methods)?,
            path_prefix: text("path_prefix", &path_prefix)?,
            jsonrpc_path: text("jsonrpc_path", &jsonrpc_path)?,
            max_peek_bytes: count("max_peek_bytes", &max_peek_bytes)?.map(|n| n as usize),
            fleet: secret_text("fleet", &fleet)?,
            fleet_key: text("fleet_key", &fleet_key)?,
            fleet_on_error: text("fleet_on_error", &fleet_on_error)?,
            fleet_tls_ca_file: path("fleet_tls_ca_file", &fleet_tls_ca_file)?,
            fleet_tls_cert_file: path("fleet_tls_cert_file", &fleet_tls_cert_file)?,
            fleet_tls_key_file: path("fleet_tls_key_file", &fleet_tls_key_file)?,
            fleet_durability: text("fleet_durability", &fleet_durability)?,
            metrics_listen: address("metrics_listen", &metrics_listen)?,
            drain_timeout: number("drain_timeout", &drain_timeout)?,
            first_bytes_timeout: number("first_bytes_timeout", &first_bytes_timeout)?,
            upstream_idle_timeout: number("upstream_idle_timeout", &upstream_idle_timeout)?,
            upstream_max_idle: count("upstream_max_idle", &upstream_max_idle)?.map(|n| n as usize),
            memory_soft_ratio: number("memory_soft_ratio", &memory_soft_ratio)?,
            memory_hard_ratio: number("memory_hard_ratio", &memory_hard_ratio)?,
            memory_cgroup: path("memory_cgroup", &memory_cgroup)?,
            request_body_timeout: number("request_body_timeout", &request_body_timeout)?,
            max_buffered_body: count("max_buffered_body", &max_buffered_body)?.map(|n| n as usize),
            abandoned_response_timeout: number(
                "abandoned_response_timeout",
                &abandoned_response_timeout,
            )?,
            send_timeout: number("send_timeout", &send_timeout)?,
            threads: count("threads", &threads)?.map(|n| n as usize),
            readiness_path: text("readiness_path", &readiness_path)?,
            config: path("config", &config)?,
            priorities: admitgate_broker::priority::PriorityFlags {
                priority: texts("priority", &priority)?,
                default_priority: text("default_priority", &default_priority)?,
                priority_from: text("priority_from", &priority_from)?,
                fairness: text("fairness", &fairness)?,
            },
            naming: Naming::Keywords, // messages name serve()'s keywords
        };
        let config = Config::resolve(flags).map_err(|e| PyValueError::new_err(e.to_string()))?;
        run(py, config)
    })
}

/// `python -m admitgate broker`: `argv` (the program name first) parsed as the binary parses
/// its own, so `--help`, the errors and their exit codes are the binary's; then the broker
/// runs as [`serve_broker`] runs it. Returns the exit code (0 after the drain).
#[pyfunction]
pub fn _broker_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    guard(|| match Config::from_args(argv) {
        Ok(config) => run(py, config).map(|()| 0),
        Err(error) => {
            // --help and --version print to stdout and exit 0; a bad flag prints to stderr.
            let _ = error.print();
            Ok(error.exit_code())
        }
    })
}

/// Makes the next broker to start panic inside its own task, to prove the panic becomes
/// `admitgate.InternalError`. For admitgate's own tests.
#[pyfunction]
pub fn _panic_in_next_broker() {
    admitgate_broker::test_hooks::panic_in_next_serve();
}
