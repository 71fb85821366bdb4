//! vllm-mmretry core: request state and the per-step output loop for vLLM's V1
//! front end. The Python extension module is `vllm_mmretry._core`.

use pyo3::prelude::*;

pub mod core;
pub mod detok;
pub mod eco;
pub mod inline;
pub mod prefetch;
pub mod prom;
pub mod recv;
pub mod table;
pub mod wire;

/// Version of the compiled core; the Python layer checks it matches its own.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add_class::<core::OutputCore>()?;
    detok::py::register(m)?;
    wire::py::register(m)?;
    prom::py::register(m)?;
    recv::py::register(m)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn version_is_the_crate_version_in_semver_form() {
        // Cargo.toml is the one place the version is written (maturin's dynamic version).
        assert_eq!(super::VERSION, env!("CARGO_PKG_VERSION"));
        let parts: Vec<&str> = super::VERSION.split('.').collect();
        assert_eq!(parts.len(), 3, "{}", super::VERSION);
        let numeric = parts.iter().all(|p| p.parse::<u64>().is_ok());
        assert!(numeric, "{}", super::VERSION);
    }
}
