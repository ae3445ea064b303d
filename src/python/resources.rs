//! Memory-aware admission in the binding: which resource policy and sampler a gate consults,
//! and the built-in RSS sampler class.
//!
//! The common configurations (none, or admitgate's own `MemoryPressurePolicy` with the
//! built-in sampler) are decided entirely in Rust from a mode read without a lock. Anything
//! else (a custom policy or sampler) calls into Python: the configuration is an immutable
//! snapshot behind a lock that is held only to copy or swap the snapshot's `Arc`, never
//! while Python runs, so a policy property that releases the GIL cannot deadlock a thread
//! replacing the sampler.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use pyo3::{PyTraverseError, PyVisit};

use super::errors::guard;
use super::fork::register_sampler;
use super::policy::{decision_from, not_a_decision, rss_of, PyMemoryPressurePolicy};
use super::runtime::{log, now};
use admitgate_core::rss::RssSampler;
use admitgate_core::{Decision, MemoryPressure};

/// Which resource policy the gate consults.
enum ResourcePolicy {
    None,
    /// admitgate's own `MemoryPressurePolicy`: evaluated in Rust.
    Native(MemoryPressure),
    /// Any object with `evaluate(sample)` (and optionally `enabled`).
    Foreign(Py<PyAny>),
}

/// Where samples come from.
enum Sampler {
    None,
    Builtin(Py<PyRssSampler>),
    /// Any object with `read()` returning something with `rss_mb`.
    Foreign(Py<PyAny>),
}

/// No memory-aware admission.
const MODE_OFF: u8 = 0;
/// admitgate's `MemoryPressurePolicy` read through the built-in sampler: all in Rust.
const MODE_NATIVE: u8 = 1;
/// Anything else: consult the snapshot (and Python) on every decision.
const MODE_DYNAMIC: u8 = 2;

/// One immutable resource configuration.
struct Resources {
    policy: ResourcePolicy,
    policy_object: Option<Py<PyAny>>,
    sampler: Sampler,
}

impl Resources {
    const NONE: Resources = Resources {
        policy: ResourcePolicy::None,
        policy_object: None,
        sampler: Sampler::None,
    };
}

/// A gate's memory-aware admission.
pub struct ResourceGate {
    /// Which path applies, readable without a lock.
    mode: AtomicU8,
    /// The built-in sampler the gate made for itself, for [`MODE_NATIVE`].
    native_sampler: OnceLock<Arc<RssSampler>>,
    /// admitgate's own ladder (soft, hard, as `f64` bits), for [`MODE_NATIVE`]: atomics so
    /// `reconfigure` can change it without a lock on the hot path.
    native_ladder: [AtomicU64; 2],
    config: Mutex<Arc<Resources>>,
    warned: AtomicBool,
}

fn sampler_from(sampler: Bound<'_, PyAny>) -> PyResult<Sampler> {
    if let Ok(builtin) = sampler.cast::<PyRssSampler>() {
        return Ok(Sampler::Builtin(builtin.clone().unbind()));
    }
    if !sampler.hasattr("read")? {
        return Err(PyTypeError::new_err(format!(
            "resource_sampler must have a read() method, got {}",
            sampler.repr()?
        )));
    }
    Ok(Sampler::Foreign(sampler.unbind()))
}

impl ResourceGate {
    /// The resource side of a gate built with `resource_policy` and `resource_sampler`.
    pub fn new(
        py: Python<'_>,
        resource_policy: Option<Bound<'_, PyAny>>,
        resource_sampler: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let policy = match &resource_policy {
            None => ResourcePolicy::None,
            Some(rp) => match rp.cast::<PyMemoryPressurePolicy>() {
                // Exactly ours (a subclass may override evaluate in Python).
                Ok(ours) if rp.get_type().is(py.get_type::<PyMemoryPressurePolicy>()) => {
                    ResourcePolicy::Native(ours.get().ladder)
                }
                _ => {
                    if !rp.hasattr("evaluate")? {
                        return Err(PyTypeError::new_err(format!(
                            "resource_policy must have an evaluate(sample) method, got {}",
                            rp.repr()?
                        )));
                    }
                    ResourcePolicy::Foreign(rp.clone().unbind())
                }
            },
        };
        let sampler = match (resource_sampler, &resource_policy) {
            (Some(s), _) => sampler_from(s)?,
            (None, Some(_)) => Sampler::Builtin(Py::new(py, PyRssSampler::new())?),
            (None, None) => Sampler::None,
        };
        let gate = Self {
            mode: AtomicU8::new(MODE_OFF),
            native_sampler: OnceLock::new(),
            native_ladder: [AtomicU64::new(0), AtomicU64::new(0)],
            config: Mutex::new(Arc::new(Resources::NONE)),
            warned: AtomicBool::new(false),
        };
        if let (ResourcePolicy::Native(_), Sampler::Builtin(builtin)) = (&policy, &sampler) {
            let _ = gate.native_sampler.set(builtin.get().sampler.clone());
        }
        gate.install(Resources {
            policy,
            policy_object: resource_policy.map(Bound::unbind),
            sampler,
        });
        Ok(gate)
    }

    fn native_ladder(&self) -> MemoryPressure {
        MemoryPressure {
            soft_rss_mb: f64::from_bits(self.native_ladder[0].load(Ordering::Relaxed)),
            hard_rss_mb: f64::from_bits(self.native_ladder[1].load(Ordering::Relaxed)),
        }
    }

    /// Checks that `max_rss_mb` can be changed: memory-aware admission is admitgate's own
    /// ladder, or off. A custom resource policy's thresholds are its own.
    pub fn check_reconfigurable(&self) -> PyResult<()> {
        if let ResourcePolicy::Foreign(p) = &self.snapshot().policy {
            return Err(PyValueError::new_err(format!(
                "max_rss_mb cannot be reconfigured: the gate's resource_policy is a custom object ({}); rebuild the gate or change that policy",
                Python::attach(|py| p.bind(py).repr().map(|r| r.to_string()).unwrap_or_default())
            )));
        }
        Ok(())
    }

    /// Sets the hard RSS ceiling (MiB) of admitgate's own ladder, keeping its soft ratio
    /// (0.9 for a gate that had none); 0 turns memory-aware admission off. The caller has
    /// validated the value and called [`ResourceGate::check_reconfigurable`].
    pub fn set_max_rss_mb(&self, py: Python<'_>, max_rss_mb: f64) -> PyResult<()> {
        let current = self.snapshot();
        let ratio = match &current.policy {
            ResourcePolicy::Native(ladder) if ladder.hard_rss_mb > 0.0 => {
                ladder.soft_rss_mb / ladder.hard_rss_mb
            }
            _ => 0.9,
        };
        let ladder = MemoryPressure::from_ceiling(max_rss_mb, ratio)
            .map_err(|err| PyValueError::new_err(err.describe(&max_rss_mb.to_string())))?;
        let sampler = match &current.sampler {
            Sampler::None => {
                let builtin = Py::new(py, PyRssSampler::new())?;
                let _ = self.native_sampler.set(builtin.get().sampler.clone());
                Sampler::Builtin(builtin)
            }
            Sampler::Builtin(s) => Sampler::Builtin(s.clone_ref(py)),
            Sampler::Foreign(s) => Sampler::Foreign(s.clone_ref(py)),
        };
        let (policy, policy_object) = match ladder {
            Some(ladder) => {
                let object = Py::new(py, PyMemoryPressurePolicy { ladder })?.into_any();
                (ResourcePolicy::Native(ladder), Some(object))
            }
            None => (ResourcePolicy::None, None),
        };
        self.install(Resources {
            policy,
            policy_object,
            sampler,
        });
        Ok(())
    }

    /// The current configuration (the lock is held only to clone the `Arc`).
    fn snapshot(&self) -> Arc<Resources> {
        self.config.lock().clone()
    }

    /// Replaces the configuration; the previous one is dropped after the lock is released.
    fn install(&self, resources: Resources) {
        let mode = match (&resources.policy, &resources.sampler) {
            (ResourcePolicy::None, _) | (_, Sampler::None) => MODE_OFF,
            (ResourcePolicy::Native(ladder), _) if !ladder.enabled() => MODE_OFF,
            (ResourcePolicy::Native(ladder), Sampler::Builtin(sampler)) => {
                match self.native_sampler.get() {
                    Some(ours) if Arc::ptr_eq(ours, &sampler.get().sampler) => {
                        self.native_ladder[0]
                            .store(ladder.soft_rss_mb.to_bits(), Ordering::Relaxed);
                        self.native_ladder[1]
                            .store(ladder.hard_rss_mb.to_bits(), Ordering::Relaxed);
                        MODE_NATIVE
                    }
                    _ => MODE_DYNAMIC,
                }
            }
            _ => MODE_DYNAMIC,
        };
        let previous = {
            let mut config = self.config.lock();
            self.mode.store(mode, Ordering::Relaxed);
            std::mem::replace(&mut *config, Arc::new(resources))
        };
        drop(previous);
    }

    /// Whether memory-aware admission is on. A custom policy's `enabled` is asked each time.
    pub fn enabled(&self, py: Python<'_>) -> bool {
        match self.mode.load(Ordering::Relaxed) {
            MODE_OFF => false,
            MODE_NATIVE => true,
            _ => Self::dynamic_enabled(py, &self.snapshot()),
        }
    }

    fn dynamic_enabled(py: Python<'_>, resources: &Resources) -> bool {
        if matches!(resources.sampler, Sampler::None) {
            return false;
        }
        match &resources.policy {
            ResourcePolicy::None => false,
            ResourcePolicy::Native(ladder) => ladder.enabled(),
            ResourcePolicy::Foreign(policy) => {
                match policy.bind(py).getattr(pyo3::intern!(py, "enabled")) {
                    Ok(enabled) => enabled.is_truthy().unwrap_or(true),
                    Err(_) => true,
                }
            }
        }
    }

    /// The memory-pressure decision for one turn. Never fails: a broken sampler or policy
    /// is logged once and admits, as the reference does (the concurrency ceiling still holds).
    pub fn decision(&self, py: Python<'_>) -> Decision {
        match self.mode.load(Ordering::Relaxed) {
            MODE_OFF => return Decision::Admit,
            MODE_NATIVE => {
                if let Some(sampler) = self.native_sampler.get() {
                    return self.native_ladder().evaluate(read_builtin(py, sampler));
                }
            }
            _ => {}
        }
        let resources = self.snapshot();
        if !Self::dynamic_enabled(py, &resources) {
            return Decision::Admit;
        }
        let read = || -> PyResult<Bound<'_, PyAny>> {
            match &resources.sampler {
                Sampler::Builtin(builtin) => {
                    resource_sample(py, read_builtin(py, &builtin.get().sampler))
                }
                Sampler::Foreign(foreign) => {
                    foreign.bind(py).call_method0(pyo3::intern!(py, "read"))
                }
                Sampler::None => resource_sample(py, None),
            }
        };
        let outcome = (|| -> PyResult<Decision> {
            match (&resources.policy, &resources.sampler) {
                (ResourcePolicy::Native(ladder), Sampler::Builtin(builtin)) => {
                    Ok(ladder.evaluate(read_builtin(py, &builtin.get().sampler)))
                }
                (ResourcePolicy::Native(ladder), _) => Ok(ladder.evaluate(rss_of(&read()?)?)),
                (ResourcePolicy::Foreign(policy), _) => {
                    let answer = policy
                        .bind(py)
                        .call_method1(pyo3::intern!(py, "evaluate"), (read()?,))?;
                    decision_from(&answer).ok_or_else(|| not_a_decision("evaluate", &answer))
                }
                (ResourcePolicy::None, _) => Ok(Decision::Admit),
            }
        })();
        outcome.unwrap_or_else(|err| {
            if !self.warned.swap(true, Ordering::Relaxed) {
                log(
                    py,
                    "warning",
                    format!("AdmissionGate: resource policy failed ({err}); admitting"),
                );
            }
            Decision::Admit
        })
    }

    /// The hard threshold the policy reports (`hard_rss_mb`), or 0.0.
    pub fn max_rss_mb(&self, py: Python<'_>) -> f64 {
        let resources = self.snapshot();
        match &resources.policy_object {
            Some(p) => p
                .bind(py)
                .getattr("hard_rss_mb")
                .ok()
                .filter(|v| v.is_truthy().unwrap_or(false))
                .and_then(|v| v.extract::<f64>().ok())
                .unwrap_or(0.0),
            None => 0.0,
        }
    }

    /// The policy object the gate was built with.
    pub fn policy_object(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.snapshot()
            .policy_object
            .as_ref()
            .map(|p| p.clone_ref(py))
    }

    /// The sampler consulted on every decision.
    pub fn sampler_object(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &self.snapshot().sampler {
            Sampler::None => None,
            Sampler::Builtin(s) => Some(s.clone_ref(py).into_any()),
            Sampler::Foreign(s) => Some(s.clone_ref(py)),
        }
    }

    /// Replaces the sampler; `None` removes it.
    pub fn set_sampler(&self, py: Python<'_>, sampler: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let sampler = match sampler {
            None => Sampler::None,
            Some(s) => sampler_from(s)?,
        };
        let current = self.snapshot();
        let policy = match &current.policy {
            ResourcePolicy::None => ResourcePolicy::None,
            ResourcePolicy::Native(ladder) => ResourcePolicy::Native(*ladder),
            ResourcePolicy::Foreign(p) => ResourcePolicy::Foreign(p.clone_ref(py)),
        };
        let policy_object = current.policy_object.as_ref().map(|p| p.clone_ref(py));
        self.install(Resources {
            policy,
            policy_object,
            sampler,
        });
        Ok(())
    }

    /// Visits the Python objects of the configuration (for the garbage collector).
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        let Some(config) = self.config.try_lock() else {
            return Ok(());
        };
        if let ResourcePolicy::Foreign(p) = &config.policy {
            visit.call(p)?;
        }
        if let Some(p) = &config.policy_object {
            visit.call(p)?;
        }
        match &config.sampler {
            Sampler::Builtin(s) => visit.call(s)?,
            Sampler::Foreign(s) => visit.call(s)?,
            Sampler::None => {}
        }
        Ok(())
    }

    /// Drops the configuration's Python objects (the collector breaking a cycle).
    pub fn clear(&self) {
        let previous = {
            let mut config = self.config.lock();
            self.mode.store(MODE_OFF, Ordering::Relaxed);
            std::mem::replace(&mut *config, Arc::new(Resources::NONE))
        };
        drop(previous);
    }
}

static RESOURCE_SAMPLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// RSS in MiB (or `None`) from the built-in sampler, warning once when sampling turns out to
/// be unavailable.
fn read_builtin(py: Python<'_>, sampler: &RssSampler) -> Option<f64> {
    let reading = sampler.read(now());
    if reading.just_disabled {
        log(
            py,
            "warning",
            "AdmissionGate: resource sampling unavailable on this platform; memory-pressure admission disabled.".into(),
        );
    }
    reading.rss_mb
}

/// A `ResourceSample(rss_mb=...)`.
fn resource_sample(py: Python<'_>, rss_mb: Option<f64>) -> PyResult<Bound<'_, PyAny>> {
    let cls = RESOURCE_SAMPLE.import(py, "admitgate._types", "ResourceSample")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("rss_mb", rss_mb)?;
    cls.call((), Some(&kwargs))
}

/// The built-in RSS sampler: live RSS, falling back to peak RSS, cached for 5 ms.
#[pyclass(frozen, weakref, module = "admitgate", name = "RssSampler")]
pub struct PyRssSampler {
    sampler: Arc<RssSampler>,
}

impl PyRssSampler {
    fn new() -> Self {
        let sampler = Arc::new(RssSampler::default());
        register_sampler(&sampler);
        Self { sampler }
    }
}

#[pymethods]
impl PyRssSampler {
    #[new]
    fn py_new() -> Self {
        Self::new()
    }

    /// A `ResourceSample` of the process's RSS (`rss_mb=None` when unavailable).
    fn read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        guard(|| resource_sample(py, read_builtin(py, &self.sampler)))
    }

    /// How stale a reading may be, in seconds.
    #[getter]
    fn interval_seconds(&self) -> PyResult<f64> {
        guard(|| Ok(self.sampler.interval().as_secs_f64()))
    }

    /// `"live"`, `"peak"` or `"unavailable"`.
    #[getter]
    fn source(&self) -> PyResult<&'static str> {
        guard(|| {
            Ok(match self.sampler.source() {
                admitgate_core::rss::RssSource::Live => "live",
                admitgate_core::rss::RssSource::Peak => "peak",
                admitgate_core::rss::RssSource::Unavailable => "unavailable",
            })
        })
    }
}
