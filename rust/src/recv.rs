//! A thread that reads the engine core's output socket off the event loop.
//!
//! The socket is pyzmq's: the caller hands over its libzmq handle and the path of the
//! libzmq pyzmq loaded, and this module calls that same library (looked up with
//! `dlopen(RTLD_NOLOAD)`, so never a second copy of libzmq). From then on only this
//! thread may touch the socket: it waits with `zmq_poll`, takes every waiting message
//! whole (all its frames, copied out), and queues it. The consumer pops messages in
//! order; when it found the queue empty it asked to be woken, and the thread writes an
//! eventfd the event loop watches. No Python here: the binding is `recv/py.rs`.
//!
//! The owner must `stop` (which joins the thread) before the socket is closed.

use std::collections::VecDeque;
use std::ffi::{c_int, c_long, c_short, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// One message: its frames, in order.
pub type Message = Vec<Vec<u8>>;

const ZMQ_DONTWAIT: c_int = 1;
const ZMQ_POLLIN: c_short = 1;
/// How long one wait lasts, so a stop is seen within it (milliseconds).
const POLL_MS: c_long = 20;
/// At most this many messages are taken per wake-up before they are handed over.
const BATCH: usize = 256;

/// `zmq_msg_t`: 64 opaque bytes, pointer-aligned.
#[repr(C, align(8))]
struct ZmqMsg([u8; 64]);

/// `zmq_pollitem_t`.
#[repr(C)]
struct PollItem {
    socket: *mut c_void,
    fd: c_int,
    events: c_short,
    revents: c_short,
}

/// The libzmq functions the thread calls, from the library pyzmq loaded.
#[derive(Clone, Copy)]
struct Libzmq {
    msg_init: unsafe extern "C" fn(*mut ZmqMsg) -> c_int,
    msg_recv: unsafe extern "C" fn(*mut ZmqMsg, *mut c_void, c_int) -> c_int,
    msg_data: unsafe extern "C" fn(*mut ZmqMsg) -> *mut c_void,
    msg_size: unsafe extern "C" fn(*const ZmqMsg) -> usize,
    msg_more: unsafe extern "C" fn(*const ZmqMsg) -> c_int,
    msg_close: unsafe extern "C" fn(*mut ZmqMsg) -> c_int,
    poll: unsafe extern "C" fn(*mut PollItem, c_int, c_long) -> c_int,
    errno: unsafe extern "C" fn() -> c_int,
}

/// Looks up `name` in `lib`, as a function of type `T`.
///
/// SAFETY: the caller names a libzmq function whose C signature is `T`.
unsafe fn symbol<T: Copy>(lib: *mut c_void, name: &str) -> Result<T, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    let p = libc::dlsym(lib, c.as_ptr());
    if p.is_null() {
        return Err(format!("libzmq has no {name}"));
    }
    Ok(std::mem::transmute_copy::<*mut c_void, T>(&p))
}

/// libzmq's major version, from its `zmq_version`.
fn major_version(lib: *mut c_void) -> Result<c_int, String> {
    // SAFETY: zmq_version(int*, int*, int*) in every libzmq; it writes the three ints.
    unsafe {
        let version: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int) =
            symbol(lib, "zmq_version")?;
        let (mut major, mut minor, mut patch) = (0, 0, 0);
        version(&mut major, &mut minor, &mut patch);
        Ok(major)
    }
}

impl Libzmq {
    /// The functions of the libzmq already loaded from `path` (never loads another).
    fn loaded(path: &str) -> Result<Self, String> {
        let c = CString::new(path).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated path; RTLD_NOLOAD only returns a library already mapped.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return Err(format!("{path} is not a loaded library"));
        }
        // The layouts above (zmq_msg_t, zmq_pollitem_t) are libzmq 4's.
        let major = major_version(lib)?;
        if major != 4 {
            return Err(format!("libzmq {major} is not libzmq 4"));
        }
        // SAFETY: each name is the libzmq 4 function of the declared signature. The
        // handle is not closed: the library stays loaded as long as pyzmq is.
        unsafe {
            Ok(Self {
                msg_init: symbol(lib, "zmq_msg_init")?,
                msg_recv: symbol(lib, "zmq_msg_recv")?,
                msg_data: symbol(lib, "zmq_msg_data")?,
                msg_size: symbol(lib, "zmq_msg_size")?,
                msg_more: symbol(lib, "zmq_msg_more")?,
                msg_close: symbol(lib, "zmq_msg_close")?,
                poll: symbol(lib, "zmq_poll")?,
                errno: symbol(lib, "zmq_errno")?,
            })
        }
    }

    fn last_error(&self) -> c_int {
        // SAFETY: zmq_errno takes nothing and reads this thread's errno.
        unsafe { (self.errno)() }
    }

    /// Waits up to `POLL_MS` for a message: Ok(true) when one is waiting.
    fn wait(&self, socket: *mut c_void) -> Result<bool, c_int> {
        let mut item = PollItem {
            socket,
            fd: 0,
            events: ZMQ_POLLIN,
            revents: 0,
        };
        // SAFETY: one valid poll item on a socket only this thread uses.
        let rc = unsafe { (self.poll)(&mut item, 1, POLL_MS) };
        match rc {
            r if r < 0 => Err(self.last_error()),
            0 => Ok(false),
            _ => Ok(item.revents & ZMQ_POLLIN != 0),
        }
    }

    /// One waiting message, all its frames; Ok(None) when none is waiting.
    fn take(&self, socket: *mut c_void) -> Result<Option<Message>, c_int> {
        let mut frames = Vec::new();
        loop {
            let mut msg = ZmqMsg([0; 64]);
            // SAFETY: `msg` is initialised before use and closed on every path below;
            // only this thread uses `socket`.
            unsafe {
                (self.msg_init)(&mut msg);
                if (self.msg_recv)(&mut msg, socket, ZMQ_DONTWAIT) < 0 {
                    let errno = self.last_error();
                    (self.msg_close)(&mut msg);
                    // A message's later frames arrive with its first (zmq is atomic),
                    // so EAGAIN after the first is an error; EINTR retries this frame.
                    match (errno, frames.is_empty()) {
                        (libc::EINTR, _) => continue,
                        (libc::EAGAIN, true) => return Ok(None),
                        _ => return Err(errno),
                    }
                }
                let size = (self.msg_size)(&msg);
                let data = (self.msg_data)(&mut msg) as *const u8;
                let bytes = if size == 0 {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(data, size).to_vec()
                };
                let more = (self.msg_more)(&msg) != 0;
                (self.msg_close)(&mut msg);
                frames.push(bytes);
                if !more {
                    return Ok(Some(frames));
                }
            }
        }
    }
}

/// What the thread and the consumer share.
struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    /// The eventfd the consumer's event loop watches; -1 once closed (after the thread).
    wake_fd: AtomicI32,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Message>,
    /// The consumer found the queue empty and waits for the eventfd.
    waiting: bool,
    /// The libzmq errno that ended the thread, if one did.
    failed: Option<c_int>,
    /// Messages taken from the socket so far.
    received: u64,
}

impl Shared {
    fn wake_fd(&self) -> c_int {
        self.wake_fd.load(Ordering::Acquire)
    }

    /// Closes the eventfd once; later reads and writes of -1 fail harmlessly (EBADF).
    fn close_wake_fd(&self) {
        let fd = self.wake_fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: our eventfd, taken out of `wake_fd` so it is closed exactly once.
            unsafe { libc::close(fd) };
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the queue half-changed.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes to our own eventfd; a full counter (EAGAIN) is already awake.
        unsafe { libc::write(self.wake_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Queues `batch` and wakes a waiting consumer.
    fn hand_over(&self, batch: Vec<Message>) {
        let mut state = self.lock();
        state.received += batch.len() as u64;
        state.queue.extend(batch);
        if std::mem::take(&mut state.waiting) {
            self.wake();
        }
    }

    fn fail(&self, errno: c_int) {
        let mut state = self.lock();
        state.failed = Some(errno);
        state.waiting = false;
        self.wake();
    }
}

/// What `pop` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Popped {
    Message(Message),
    /// None waiting: the eventfd will be written when one is.
    Empty,
    /// None waiting and the thread has stopped on this libzmq errno.
    Failed(c_int),
}

/// A socket read by a thread of its own.
pub struct Receiver {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The socket handle, moved to the reading thread.
struct SocketHandle(*mut c_void);
// SAFETY: libzmq sockets may move between threads; from `start` on only that thread uses it.
unsafe impl Send for SocketHandle {}

impl Receiver {
    /// Starts reading `socket` (a libzmq socket handle from the libzmq at `lib_path`).
    pub fn start(lib_path: &str, socket: usize) -> Result<Self, String> {
        if socket == 0 {
            return Err("no socket".into());
        }
        let lib = Libzmq::loaded(lib_path)?;
        // SAFETY: plain eventfd creation; the fd is closed by `stop` (or Drop).
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            stop: AtomicBool::new(false),
            wake_fd: AtomicI32::new(wake_fd),
        });
        let handle = SocketHandle(socket as *mut c_void);
        let for_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("mmretry-recv".into())
            .spawn(move || read_socket(lib, handle, &for_thread))
            .map_err(|e| {
                // SAFETY: our fd, not handed out yet.
                unsafe { libc::close(wake_fd) };
                format!("thread: {e}")
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// The eventfd to watch for "a message is waiting" (after `pop` said Empty).
    pub fn wake_fd(&self) -> c_int {
        self.shared.wake_fd()
    }

    /// The next message in order, or why there is none.
    pub fn pop(&self) -> Popped {
        let mut state = self.shared.lock();
        if let Some(message) = state.queue.pop_front() {
            return Popped::Message(message);
        }
        if let Some(errno) = state.failed {
            return Popped::Failed(errno);
        }
        state.waiting = true;
        Popped::Empty
    }

    /// Returns a popped message to the front of the queue (its consumer failed on it).
    pub fn put_back(&self, message: Message) {
        self.shared.lock().queue.push_front(message);
    }

    /// Reads the eventfd down to zero (its readiness has been seen).
    pub fn clear_wake(&self) {
        let mut counter: u64 = 0;
        // SAFETY: reads 8 bytes from our own non-blocking eventfd; EAGAIN when already clear.
        unsafe { libc::read(self.shared.wake_fd(), (&mut counter as *mut u64).cast(), 8) };
    }

    /// Messages taken from the socket, and messages taken but not popped yet.
    pub fn counts(&self) -> (u64, usize) {
        let state = self.shared.lock();
        (state.received, state.queue.len())
    }

    /// Stops the thread and waits for it, then closes the eventfd (the thread was its
    /// only writer); the socket is the caller's again.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            // The thread's own code does not panic; a join error would mean it did.
            let _ = thread.join();
        }
        self.shared.close_wake_fd();
    }

    pub fn running(&self) -> bool {
        self.thread.is_some()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: wait, take everything waiting, hand it over; until stopped or failed.
fn read_socket(lib: Libzmq, socket: SocketHandle, shared: &Shared) {
    let socket = socket.0;
    while !shared.stop.load(Ordering::Acquire) {
        match lib.wait(socket) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(libc::EINTR) => continue,
            Err(errno) => return shared.fail(errno),
        }
        let mut batch = Vec::new();
        while batch.len() < BATCH {
            match lib.take(socket) {
                Ok(Some(message)) => batch.push(message),
                Ok(None) => break,
                Err(errno) => {
                    shared.hand_over(batch);
                    return shared.fail(errno);
                }
            }
        }
        if !batch.is_empty() {
            shared.hand_over(batch);
        }
    }
}

pub mod py;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_is_not_loaded_is_refused() {
        let err = Receiver::start("/nonexistent/libzmq.so.5", 1).err();
        assert!(err.is_some_and(|e| e.contains("not a loaded library")));
    }

    #[test]
    fn a_null_socket_is_refused() {
        assert_eq!(
            Receiver::start("libc.so.6", 0).err().as_deref(),
            Some("no socket")
        );
    }

    #[test]
    fn a_library_without_zmq_is_refused() {
        // libc is loaded in every process; it has no zmq functions.
        let err = Receiver::start("libc.so.6", 1).err();
        assert_eq!(err.as_deref(), Some("libzmq has no zmq_version"));
    }
}
