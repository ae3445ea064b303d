//! The A2A classification rules (`crates/classify`) for the HTTP front door: the route table
//! matched as Starlette matches it, the JSON-RPC body read as `json.loads` reads it, and the
//! method rule on top. `admitgate.asgi` and the broker run the same code, so the rules exist
//! once.
//!
//! Every entry point takes plain values (str, bytes) and returns plain values, computed with
//! the GIL held: a parse is bounded by `max_peek_bytes` and linear in it (tens of
//! microseconds for the default 64 KiB), which is less than handing the GIL over and taking
//! it back would cost, and nothing here locks or calls into Python.

use admitgate_classify::{parse_request, RpcId, Rules, Verdict};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyString;

use super::errors::guard;

/// The rules of one front door: the A2A SDK's routes for one `path_prefix` and JSON-RPC
/// endpoint, in every layout the SDK builds (see `admitgate._a2a_routes`), `gate_methods`
/// and the JSON-RPC peek limit.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct A2ARules {
    rules: Rules,
}

#[pymethods]
impl A2ARules {
    #[new]
    #[pyo3(signature = (path_prefix, jsonrpc_path, *, gate_all, max_peek_bytes))]
    fn new(
        path_prefix: &str,
        jsonrpc_path: Option<&str>,
        gate_all: bool,
        max_peek_bytes: usize,
    ) -> PyResult<Self> {
        guard(|| {
            Ok(Self {
                rules: Rules::new(path_prefix, jsonrpc_path, gate_all, max_peek_bytes),
            })
        })
    }

    /// What `method path` below `root_path` reaches: 0 passthrough, 1 read, 2 work,
    /// 3 the JSON-RPC endpoint (the strongest verdict of every layout).
    fn kind(&self, method: &str, path: &str, root_path: &str) -> PyResult<u8> {
        guard(|| Ok(self.rules.kind(method, path, root_path) as u8))
    }

    /// The verdict on a JSON-RPC request whose body starts with `body` (`complete`: it ends
    /// there): `(gated, id)`, `id` being what a refusal echoes (a str, an int or `None`).
    fn jsonrpc(
        &self,
        py: Python<'_>,
        body: PyBackedBytes,
        complete: bool,
    ) -> PyResult<(bool, Py<PyAny>)> {
        guard(|| match self.rules.jsonrpc_verdict(&body, complete) {
            Verdict::Pass => Ok((false, py.None())),
            Verdict::Gate { id } => Ok((true, id_object(py, id.as_ref())?)),
        })
    }

    /// The tenant the SDK's router takes from the path of `method path` below `root_path`
    /// (its `Mount("/{tenant}", ...)`), in the layout that gives [`A2ARules::kind`]'s
    /// verdict; `None` off the tenant routes. The broker's `--tenant-from path`.
    fn tenant(&self, method: &str, path: &str, root_path: &str) -> PyResult<Option<String>> {
        guard(|| Ok(self.rules.route(method, path, root_path).tenant))
    }
}

/// The id as Python holds it: a str, an int (of any size) or `None`.
fn id_object(py: Python<'_>, id: Option<&RpcId>) -> PyResult<Py<PyAny>> {
    Ok(match id {
        Some(RpcId::Str(text)) => PyString::new(py, text).into_any().unbind(),
        // Most ids fit an i64; the rest (JSON allows any size) go through int().
        Some(RpcId::Int(digits)) => match digits.parse::<i64>() {
            Ok(small) => small.into_pyobject(py)?.into_any().unbind(),
            Err(_) => py
                .get_type::<pyo3::types::PyInt>()
                .call1((digits.as_str(),))?
                .unbind(),
        },
        Some(RpcId::Null) | None => py.None(),
    })
}

/// The JSON-RPC reader's view of a whole body, for the differential test against
/// `json.loads` and the A2A SDK: `(method, id)` of a JSON object (`method` only when a
/// string, `id` as a refusal echoes it), `None` when it is not one.
#[pyfunction]
pub fn _jsonrpc_request(py: Python<'_>, body: PyBackedBytes) -> PyResult<Py<PyAny>> {
    guard(|| {
        Ok(match parse_request(&body) {
            None => py.None(),
            Some(request) => (request.method, id_object(py, request.id.as_ref())?)
                .into_pyobject(py)?
                .into_any()
                .unbind(),
        })
    })
}
