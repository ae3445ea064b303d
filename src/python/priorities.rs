//! Priority classes and fair queuing as Python configures them: `priorities=`,
//! `default_priority=`, `fairness=` and `tenant_weights=` read into the core's [`Order`], a
//! turn's `priority=` resolved to its class, and `stats()["classes"]`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use admitgate_core::queue::classes::quote;
use admitgate_core::queue::ClassStats;
use admitgate_core::{ClassId, Order, Priorities, PriorityClass};

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".to_owned())
}

/// A gate's classes as turns name them: fixed names, a default and fair queuing that
/// `reconfigure` may change. Read without the core's lock on every `admit(priority=...)`.
#[derive(Debug)]
pub struct ClassNames {
    /// The classes' names, most important first; empty for a gate without classes.
    names: Arc<[Arc<str>]>,
    default: AtomicU8,
    fair: AtomicBool,
}

impl ClassNames {
    /// The names of `order`'s classes (none for a gate without classes).
    pub fn new(order: &Order, classed: bool) -> Self {
        let names: Arc<[Arc<str>]> = if classed {
            order.priorities.names().into()
        } else {
            Arc::from(Vec::new())
        };
        Self {
            names,
            default: AtomicU8::new(order.priorities.default_class().0),
            fair: AtomicBool::new(order.fair),
        }
    }

    /// Whether the gate has classes.
    pub fn classed(&self) -> bool {
        !self.names.is_empty()
    }

    /// Whether turns are tracked per tenant for fair queuing.
    pub fn fair(&self) -> bool {
        self.fair.load(Ordering::Relaxed)
    }

    /// Follows a reconfiguration (the names are unchanged).
    pub fn update(&self, order: &Order) {
        self.default
            .store(order.priorities.default_class().0, Ordering::Relaxed);
        self.fair.store(order.fair, Ordering::Relaxed);
    }

    /// The class a turn's `priority=` names (`None`: the default class), as a concrete
    /// position. A ValueError names an unknown class and the known ones.
    pub fn resolve(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<ClassId> {
        let priority = priority.filter(|p| !p.is_none());
        let Some(priority) = priority else {
            return Ok(ClassId(self.default.load(Ordering::Relaxed)));
        };
        let name = priority.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "priority must be a str naming a priority class, got {}",
                repr(priority)
            ))
        })?;
        let name = name.to_str()?;
        if !self.classed() {
            return Err(PyValueError::new_err(format!(
                "priority={} given, but this gate has no priority classes \
                 (build it with priorities=[...])",
                repr(priority)
            )));
        }
        self.names
            .iter()
            .position(|known| &**known == name)
            .and_then(|i| u8::try_from(i).ok())
            .map(ClassId)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "unknown priority {}; known: {}",
                    repr(priority),
                    admitgate_core::queue::classes::names(&self.names)
                ))
            })
    }

    /// A class's name, for `AdmissionRejected.priority` (`None` without classes).
    pub fn name(&self, class: ClassId) -> Option<Arc<str>> {
        let position = if usize::from(class.0) < self.names.len() {
            usize::from(class.0)
        } else {
            usize::from(self.default.load(Ordering::Relaxed))
        };
        self.names.get(position).cloned()
    }
}

/// A float attribute of a class object, named in errors as the user wrote it.
fn share(class: &Bound<'_, PyAny>, attr: &str, name: &str) -> PyResult<f64> {
    let value = class.getattr(attr)?;
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{attr} of priority class {} must be a number from 0 to 1, got {}",
            quote(name),
            repr(&value)
        )));
    }
    value.extract::<f64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{attr} of priority class {} must be a number from 0 to 1, got {}",
            quote(name),
            repr(&value)
        ))
    })
}

/// Reads `priorities=` (a list of `admitgate.PriorityClass`, most important first),
/// `default_priority=`, `fairness=` and `tenant_weights=` into the core's order. Returns
/// whether the gate has classes.
pub fn order_from(
    py: Python<'_>,
    priorities: Option<&Bound<'_, PyAny>>,
    default_priority: Option<&Bound<'_, PyAny>>,
    fairness: Option<&Bound<'_, PyAny>>,
    tenant_weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Order, bool)> {
    let class_type = py
        .import("admitgate._priorities")?
        .getattr("PriorityClass")?;
    let priorities = priorities.filter(|p| !p.is_none());
    let default_priority = default_priority.filter(|p| !p.is_none());
    let classes = match priorities {
        None => None,
        Some(list) => {
            if list.is_instance_of::<PyString>() || list.is_instance_of::<PyDict>() {
                return Err(PyTypeError::new_err(format!(
                    "priorities must be a list of admitgate.PriorityClass, got {}",
                    repr(list)
                )));
            }
            let mut classes = Vec::new();
            for item in list.try_iter().map_err(|_| {
                PyTypeError::new_err(format!(
                    "priorities must be a list of admitgate.PriorityClass, got {}",
                    repr(list)
                ))
            })? {
                let item = item?;
                if !item.is_instance(&class_type)? {
                    return Err(PyTypeError::new_err(format!(
                        "priorities must hold admitgate.PriorityClass values, got {}",
                        repr(&item)
                    )));
                }
                let name: String = item.getattr("name")?.extract()?;
                let min_share = share(&item, "min_share", &name)?;
                let max_share = share(&item, "max_share", &name)?;
                classes.push(PriorityClass::shared(&name, min_share, max_share));
            }
            Some(classes)
        }
    };
    let default = match default_priority {
        None => None,
        Some(value) => Some(
            value
                .cast::<PyString>()
                .map_err(|_| {
                    PyTypeError::new_err(format!(
                        "default_priority must be a str naming a priority class, got {}",
                        repr(value)
                    ))
                })?
                .to_str()?
                .to_owned(),
        ),
    };
    let classed = classes.is_some();
    let priorities = match classes {
        Some(classes) => Priorities::new(classes, default.as_deref())
            .map_err(|err| PyValueError::new_err(err.to_string()))?,
        None => {
            if let Some(default) = default {
                return Err(PyValueError::new_err(format!(
                    "default_priority={} needs priorities=[...]",
                    quote(&default)
                )));
            }
            Priorities::default()
        }
    };
    let fair = match fairness.filter(|f| !f.is_none()) {
        None => classed,
        Some(value) => {
            let text = value
                .cast::<PyString>()
                .ok()
                .and_then(|s| s.to_str().ok().map(str::to_owned));
            match text.as_deref() {
                Some("tenant") => true,
                Some("none") => false,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "fairness must be one of ('tenant', 'none') or None, got {}",
                        repr(value)
                    )))
                }
            }
        }
    };
    let weights = weights_from(tenant_weights)?;
    if !weights.is_empty() && !fair {
        return Err(PyValueError::new_err(
            "tenant_weights needs fair queuing (fairness='tenant', or priorities=[...])",
        ));
    }
    Ok((
        Order {
            priorities,
            fair,
            weights,
        },
        classed,
    ))
}

/// `tenant_weights=`: `{tenant: weight}`, weights whole numbers from 1 to 1,000,000.
fn weights_from(weights: Option<&Bound<'_, PyAny>>) -> PyResult<HashMap<Arc<str>, u32>> {
    let Some(weights) = weights.filter(|w| !w.is_none()) else {
        return Ok(HashMap::new());
    };
    let dict = weights.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "tenant_weights must be a dict of tenant -> weight, got {}",
            repr(weights)
        ))
    })?;
    let mut out = HashMap::new();
    for (tenant, weight) in dict.iter() {
        let name = tenant.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "tenant_weights keys must be str tenant ids, got {}",
                repr(&tenant)
            ))
        })?;
        let value = (!weight.is_instance_of::<pyo3::types::PyBool>())
            .then(|| weight.extract::<i64>().ok())
            .flatten()
            .filter(|w| (1..=1_000_000).contains(w))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "tenant_weights[{}] must be a whole number from 1 to 1000000, got {}",
                    repr(&tenant),
                    repr(&weight)
                ))
            })?;
        out.insert(Arc::from(name.to_str()?), u32::try_from(value).unwrap_or(1));
    }
    Ok(out)
}

/// `stats()["classes"]`: `{name: {in_flight, queued, admitted, rejected, shed, cancelled}}`.
pub fn classes_dict<'py>(py: Python<'py>, stats: &[ClassStats]) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for class in stats {
        let d = PyDict::new(py);
        d.set_item("in_flight", class.in_flight)?;
        d.set_item("queued", class.queued)?;
        d.set_item("admitted", class.tally.admitted)?;
        d.set_item("rejected", class.tally.rejected)?;
        d.set_item("shed", class.tally.shed)?;
        d.set_item("cancelled", class.tally.cancelled)?;
        out.set_item(&*class.name, d)?;
    }
    Ok(out)
}
