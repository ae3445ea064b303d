//! The A2A classification rules (`crates/classify`) for the HTTP front door: the route table
//! matched as Starlette matches it, which `admitgate.asgi` and the broker share, so the rules
//! exist once.

use admitgate_classify::routes::strongest;
use admitgate_classify::{parse_request, sdk_routers, Kind, Router, RpcId};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::errors::guard;

/// The A2A SDK's routes for one `path_prefix` and JSON-RPC endpoint, in every layout the SDK
/// builds (see `admitgate._a2a_routes`).
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct A2ARoutes {
    routers: Vec<Router>,
}

#[pymethods]
impl A2ARoutes {
    #[new]
    #[pyo3(signature = (path_prefix, jsonrpc_path))]
    fn new(path_prefix: &str, jsonrpc_path: Option<&str>) -> PyResult<Self> {
        guard(|| {
            Ok(Self {
                routers: sdk_routers(path_prefix.trim_end_matches('/'), jsonrpc_path),
            })
        })
    }

    /// What `method path` below `root_path` reaches: 0 passthrough, 1 read, 2 work,
    /// 3 the JSON-RPC endpoint (the strongest verdict of every layout).
    fn kind(&self, method: &str, path: &str, root_path: &str) -> PyResult<u8> {
        guard(|| {
            let kind = self
                .routers
                .iter()
                .map(|router| router.kind(method, path, root_path))
                .max()
                .unwrap_or(Kind::Pass);
            Ok(kind as u8)
        })
    }

    /// The tenant the SDK's router takes from the path of `method path` below `root_path`
    /// (its `Mount("/{tenant}", ...)`), in the layout that gives [`A2ARoutes::kind`]'s
    /// verdict; `None` off the tenant routes. The broker's `--tenant-from path`.
    fn tenant(&self, method: &str, path: &str, root_path: &str) -> PyResult<Option<String>> {
        guard(|| Ok(strongest(&self.routers, method, path, root_path).tenant))
    }
}

/// The broker's reading of a whole JSON-RPC body: `(method, id)` of a JSON object (`method`
/// only when a string; `id` only when a string or an integer), `None` when it is not one,
/// `False` when the reader cannot tell (UTF-8 holding encoded surrogates). For the
/// differential test against `json.loads`.
#[pyfunction]
pub fn _jsonrpc_request(py: Python<'_>, body: &Bound<'_, PyBytes>) -> PyResult<Py<PyAny>> {
    guard(|| {
        let parsed = parse_request(body.as_bytes());
        Ok(match parsed {
            Err(()) => false.into_pyobject(py)?.to_owned().into_any().unbind(),
            Ok(None) => py.None(),
            Ok(Some(request)) => {
                let id: Py<PyAny> = match request.id {
                    Some(RpcId::Str(text)) => text.into_pyobject(py)?.into_any().unbind(),
                    Some(RpcId::Int(digits)) => py
                        .import("builtins")?
                        .getattr("int")?
                        .call1((digits,))?
                        .unbind(),
                    Some(RpcId::Null) | None => py.None(),
                };
                (request.method, id).into_pyobject(py)?.into_any().unbind()
            }
        })
    })
}
