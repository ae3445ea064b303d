//! Conversion of user-supplied arguments, with messages that name the argument and show the
//! bad value. Counts accept ints, integral floats and integer strings (as configuration files
//! and CLIs give them); booleans, fractions and anything else are refused.

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyString};

use admitgate_core::policy::{check_count, check_threshold, ConfigError, Overflow};

/// A value as an error message shows it: its `repr()`, or `<unrepresentable>` when that fails.
pub fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".to_owned())
}

fn not_an_integer(arg: &str, value: &Bound<'_, PyAny>) -> PyErr {
    PyValueError::new_err(format!("{arg} must be an integer, got {}", repr(value)))
}

/// A count in `0..=2**31-1`.
pub fn count(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<u32> {
    let as_int: i64 = if value.is_instance_of::<PyBool>() {
        return Err(not_an_integer(arg, value));
    } else if value.is_instance_of::<PyInt>() {
        // Beyond i64 is beyond any limit: saturate, and the range check below reports it
        // (with the caller's own spelling of the value).
        value.extract::<i64>().unwrap_or_else(|_| {
            if value.lt(0i64).unwrap_or(false) {
                i64::MIN
            } else {
                i64::MAX
            }
        })
    } else if value.is_instance_of::<PyFloat>() {
        let f: f64 = value.extract()?;
        if !f.is_finite() || f.fract() != 0.0 {
            return Err(not_an_integer(arg, value));
        }
        f as i64 // saturating: the range check below reports huge values
    } else if let Ok(text) = value.cast::<PyString>() {
        let text = text.to_str()?;
        text.trim()
            .parse::<i64>()
            .map_err(|_| not_an_integer(arg, value))?
    } else if value.hasattr("__index__")? {
        value
            .call_method0("__index__")?
            .extract::<i64>()
            .map_err(|_| not_an_integer(arg, value))?
    } else {
        return Err(not_an_integer(arg, value));
    };
    check_count(arg, as_int).map_err(|err| PyValueError::new_err(err.describe(&repr(value))))
}

/// A finite threshold `>= 0`; `None` means 0 (unset).
pub fn threshold(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    if value.is_none() {
        return Ok(0.0);
    }
    let as_float = number(arg, value)?;
    check_threshold(arg, as_float).map_err(|err| PyValueError::new_err(err.describe(&repr(value))))
}

/// Any number (int, float, numeric string or `__float__`), refusing booleans and values too
/// large for a float, with a message naming the argument. Not yet checked for finiteness.
pub fn number(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    let not_a_number =
        || PyValueError::new_err(format!("{arg} must be a number, got {}", repr(value)));
    let as_float: f64 = if value.is_instance_of::<PyBool>() {
        return Err(not_a_number());
    } else if value.is_instance_of::<PyInt>() || value.is_instance_of::<PyFloat>() {
        value.extract().map_err(|_| not_a_number())?
    } else if let Ok(text) = value.cast::<PyString>() {
        text.to_str()?
            .trim()
            .parse::<f64>()
            .map_err(|_| not_a_number())?
    } else if value.hasattr("__float__")? {
        value
            .call_method0("__float__")?
            .extract()
            .map_err(|_| not_a_number())?
    } else {
        return Err(not_a_number());
    };
    Ok(as_float)
}

/// An overflow policy name; `None` or empty means `reject`.
pub fn overflow(value: &Bound<'_, PyAny>) -> PyResult<Overflow> {
    if value.is_none() {
        return Ok(Overflow::Reject);
    }
    let parsed = match value.cast::<PyString>() {
        Ok(text) => Overflow::parse(text.to_str()?),
        Err(_) => Err(ConfigError::UnknownOverflow { value: repr(value) }),
    };
    parsed.map_err(|err| PyValueError::new_err(err.describe(&repr(value))))
}

/// A keyword argument that tells "not given" (`Arg(None)`, the signature default) from an
/// explicit `None`, which PyO3's `Option` cannot.
pub struct Arg(pub Option<Py<PyAny>>);

impl<'a, 'py> FromPyObject<'a, 'py> for Arg {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> Result<Self, Self::Error> {
        Ok(Arg(Some(obj.to_owned().unbind())))
    }
}

impl Arg {
    /// A count: 0 when not given.
    pub fn count(&self, py: Python<'_>, arg: &'static str) -> PyResult<u32> {
        match &self.0 {
            None => Ok(0),
            Some(value) => count(arg, value.bind(py)),
        }
    }

    /// A threshold: 0.0 when not given or `None`.
    pub fn threshold(&self, py: Python<'_>, arg: &'static str) -> PyResult<f64> {
        match &self.0 {
            None => Ok(0.0),
            Some(value) => threshold(arg, value.bind(py)),
        }
    }

    /// A wait bound: `None` when not given or `None`.
    pub fn timeout(&self, py: Python<'_>, arg: &'static str) -> PyResult<Option<Duration>> {
        match &self.0 {
            None => Ok(None),
            Some(value) => timeout(arg, value.bind(py)),
        }
    }

    /// Whether the argument was given at all.
    pub fn given(&self) -> bool {
        self.0.is_some()
    }

    /// An overflow policy: `reject` when not given or `None`.
    pub fn overflow(&self, py: Python<'_>) -> PyResult<Overflow> {
        match &self.0 {
            None => Ok(Overflow::Reject),
            Some(value) => overflow(value.bind(py)),
        }
    }
}

/// A wait bound in seconds: `None` for no bound, else a finite number `> 0`.
pub fn timeout(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<Option<Duration>> {
    if value.is_none() {
        return Ok(None);
    }
    let seconds = number(arg, value)?;
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(PyValueError::new_err(format!(
            "{arg} must be a positive number of seconds or None, got {}",
            repr(value)
        )));
    }
    Duration::try_from_secs_f64(seconds)
        .map(Some)
        .map_err(|_| PyValueError::new_err(format!("{arg} is too large, got {}", repr(value))))
}

/// A hold in seconds that may be 0 (a provider's `Retry-After: 0`): `None` for none, else a
/// finite number `>= 0`.
pub fn hold(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<Option<Duration>> {
    if value.is_none() {
        return Ok(None);
    }
    let seconds = number(arg, value)?;
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "{arg} must be a number of seconds >= 0 or None, got {}",
            repr(value)
        )));
    }
    Duration::try_from_secs_f64(seconds)
        .map(Some)
        .map_err(|_| PyValueError::new_err(format!("{arg} is too large, got {}", repr(value))))
}

/// A live count handed to `decide` (`in_flight` and the like): a non-negative int.
pub fn fact(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if value.is_instance_of::<PyBool>() || !value.is_instance_of::<PyInt>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{arg} must be an int, got {}",
            repr(value)
        )));
    }
    value.extract::<u64>().map_err(|_| {
        let bound = if value.lt(0i64).unwrap_or(false) {
            "must be >= 0"
        } else {
            "must fit in 64 bits"
        };
        PyValueError::new_err(format!("{arg} {bound}, got {}", repr(value)))
    })
}

/// A session id as the gate's scope key. Ids that are not valid Unicode on their own (a lone
/// surrogate, which JSON can carry) get a distinct, stable escaped form instead of an error.
pub fn scope_key<'a>(session_id: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    match session_id.to_str() {
        Ok(text) => Ok(std::borrow::Cow::Borrowed(text)),
        Err(_) => {
            let escaped = session_id
                .call_method1("encode", ("unicode_escape",))?
                .extract::<Vec<u8>>()?;
            // A NUL prefix keeps the escaped form apart from ordinary ids spelling the same.
            Ok(std::borrow::Cow::Owned(format!(
                "\0surrogate:{}",
                String::from_utf8_lossy(&escaped)
            )))
        }
    }
}

/// `identity=` or a key's answer: a str (UTF-8, lone surrogates escaped) or bytes.
pub fn identity_bytes(arg: &str, value: &Bound<'_, PyAny>) -> PyResult<Arc<[u8]>> {
    if let Ok(text) = value.cast::<PyString>() {
        return Ok(Arc::from(scope_key(text)?.as_bytes()));
    }
    if let Ok(bytes) = value.cast::<PyBytes>() {
        return Ok(Arc::from(bytes.as_bytes()));
    }
    let kind = value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    // The value itself is never shown: it may be an API key.
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{arg} must be a str or bytes, got a {kind}"
    )))
}
