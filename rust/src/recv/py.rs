//! Thin PyO3 view of the socket reader thread (`_core.SocketReceiver`).
//! `vllm_mmretry.receive` decides when it is used and owns the socket's lifecycle.

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use pyo3::{PyTraverseError, PyVisit};

use super::{Popped, Receiver};
use crate::core::guarded;

/// Reads one libzmq socket in a thread of its own; messages are popped in order.
#[pyclass(module = "vllm_mmretry._core")]
pub struct SocketReceiver {
    inner: Receiver,
    /// The pyzmq socket, kept alive while the thread may poll it (until `stop`).
    socket: Option<Py<PyAny>>,
}

#[pymethods]
impl SocketReceiver {
    /// Starts the thread on the pyzmq `socket` (its `underlying` libzmq handle), calling
    /// the libzmq already loaded from `libzmq_path`.
    #[new]
    fn new(libzmq_path: &str, socket: &Bound<'_, PyAny>) -> PyResult<Self> {
        let handle: usize = socket.getattr("underlying")?.extract()?;
        let inner = guarded("SocketReceiver()", || Receiver::start(libzmq_path, handle))?
            .map_err(PyOSError::new_err)?;
        Ok(Self {
            inner,
            socket: Some(socket.clone().unbind()),
        })
    }

    /// The eventfd that becomes readable once a message waits after `pop` gave None.
    fn fileno(&self) -> i32 {
        self.inner.wake_fd()
    }

    /// The next message as a list of frames, each `bytes` or `wrap(bytes)`; None when
    /// none waits (the eventfd will say when one does); an int, libzmq's errno, when
    /// none waits and the thread has stopped on that error.
    #[pyo3(signature = (wrap=None))]
    fn pop<'py>(&self, py: Python<'py>, wrap: Option<&Bound<'py, PyAny>>) -> PyResult<Py<PyAny>> {
        let popped = guarded("SocketReceiver.pop", || self.inner.pop())?;
        match popped {
            Popped::Message(frames) => match frames_list(py, &frames, wrap) {
                Ok(list) => Ok(list.into_any().unbind()),
                Err(e) => {
                    // `wrap` raised: the message stays first in line, not lost.
                    self.inner.put_back(frames);
                    Err(e)
                }
            },
            Popped::Empty => Ok(py.None()),
            Popped::Failed(errno) => Ok(errno.into_pyobject(py)?.into_any().unbind()),
        }
    }

    /// Reads the eventfd down (the loop's reader saw it readable).
    fn clear_wake(&self) {
        self.inner.clear_wake();
    }

    /// (messages taken from the socket, messages taken and not popped yet)
    fn counts(&self) -> (u64, usize) {
        self.inner.counts()
    }

    /// Stops and joins the thread (without the GIL) and closes the eventfd (`fileno` is
    /// -1 after); the socket may be closed after.
    fn stop(&mut self, py: Python<'_>) {
        let inner = &mut self.inner;
        py.detach(|| inner.stop());
        self.socket = None;
    }

    #[getter]
    fn running(&self) -> bool {
        self.inner.running()
    }

    /// The socket held is visible to the garbage collector, so an abandoned socket and
    /// its receiver (they refer to each other through the socket's `close`) are collected.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(socket) = &self.socket {
            visit.call(socket)?;
        }
        Ok(())
    }

    /// The collector breaks the cycle: the thread stops before the socket is let go
    /// (pyzmq's finalizer, which closes the socket, has already stopped it).
    fn __clear__(&mut self) {
        self.inner.stop();
        self.socket = None;
    }
}

/// A message's frames as a list of `bytes`, or of `wrap(bytes)`.
fn frames_list<'py>(
    py: Python<'py>,
    frames: &[Vec<u8>],
    wrap: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for frame in frames {
        let bytes = PyBytes::new(py, frame);
        match wrap {
            Some(w) => list.append(w.call1((bytes,))?)?,
            None => list.append(bytes)?,
        }
    }
    Ok(list)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SocketReceiver>()
}
