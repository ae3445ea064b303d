//! A client's socket as hyper sees it: bytes already read are replayed first, a shutdown is
//! skipped when the connection is being handed back between exchanges, and a client that
//! accepts none of the bytes the broker has for it for `--send-timeout` fails the
//! connection (nginx's `send_timeout`): a client that stops reading cannot hold a slot for
//! ever (its response is then read on and discarded, as for a client that left).
//!
//! The socket is shared (an `Arc`) with [`ClientSocket`], through which a request waiting
//! for a slot with the rest of its body unread sees its client close the connection: hyper
//! reads the socket only as the body is asked for, so nothing else would see it.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use std::future::Future;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

use crate::leaving::ClientSocket;

const SERVING: u8 = 0;
const ASKED: u8 = 1;
const REFUSED: u8 = 2;

/// Whether the hyper connection serving a socket is to hand it back when it ends.
#[derive(Clone)]
pub struct HandBack(Arc<AtomicU8>);

impl HandBack {
    /// Hand the socket back: hyper's shutdown of it is skipped.
    pub fn ask(&self) {
        let _ = self
            .0
            .compare_exchange(SERVING, ASKED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Never hand it back (the drain): hyper shuts the socket down as usual.
    pub fn refuse(&self) {
        self.0.store(REFUSED, Ordering::Release);
    }

    /// Whether the socket is to be handed back.
    pub fn asked(&self) -> bool {
        self.0.load(Ordering::Acquire) == ASKED
    }
}

/// A client socket with bytes to replay before reading from it again.
pub struct ClientIo {
    stream: Arc<TcpStream>,
    replay: Bytes,
    hand_back: HandBack,
    /// How long a write may stay blocked (the client reads nothing) before it fails.
    send_timeout: Duration,
    /// Running while a write is blocked.
    write_stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl ClientIo {
    /// `stream`, with `replay` (bytes already read from it) to be read first; a write
    /// blocked for `send_timeout` fails.
    pub fn new(stream: TcpStream, replay: Bytes, send_timeout: Duration) -> Self {
        Self {
            stream: Arc::new(stream),
            replay,
            hand_back: HandBack(Arc::new(AtomicU8::new(SERVING))),
            send_timeout,
            write_stall: None,
        }
    }

    /// A write is blocked: pending until `send_timeout` has passed since it first blocked,
    /// then an error (hyper ends the connection).
    fn blocked<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let timeout = self.send_timeout;
        let stall = self
            .write_stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stall.as_mut().poll(cx).is_ready() {
            self.write_stall = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client accepted none of its response within send_timeout",
            )));
        }
        Poll::Pending
    }

    /// What a write polled: progress ends a stall, a block starts or continues one.
    fn wrote<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending => self.blocked(cx),
            ready => {
                self.write_stall = None;
                ready
            }
        }
    }

    /// The socket.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// The socket as a request may watch it for its client's leaving.
    pub fn watch(&self) -> ClientSocket {
        ClientSocket::new(Arc::downgrade(&self.stream))
    }

    /// Whether bytes are waiting to be replayed.
    pub fn has_buffered(&self) -> bool {
        !self.replay.is_empty()
    }

    /// Puts `read` (what hyper had read but not used) before what is left to replay.
    pub fn replay(&mut self, read: Bytes) {
        if read.is_empty() {
            return;
        }
        if self.replay.is_empty() {
            self.replay = read;
            return;
        }
        let mut joined = BytesMut::with_capacity(read.len().saturating_add(self.replay.len()));
        joined.extend_from_slice(&read);
        joined.extend_from_slice(&self.replay);
        self.replay = joined.freeze();
    }

    /// A fresh hand-back decision for the next hyper connection on this socket.
    pub fn hand_back_flag(&mut self) -> HandBack {
        self.hand_back = HandBack(Arc::new(AtomicU8::new(SERVING)));
        self.hand_back.clone()
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.replay.is_empty() {
            let n = self.replay.len().min(buf.remaining());
            if let Some(chunk) = self.replay.get(..n) {
                buf.put_slice(chunk);
            }
            self.replay.advance(n);
            if self.replay.is_empty() && buf.remaining() > 0 {
                // What the socket holds already, in the same read: hyper reserves 8 KiB more
                // for each read that leaves a request head incomplete, so a request read in
                // two parts (the replayed first bytes, then the rest) grew its read buffer
                // to 16 KiB for the connection's life. Nothing there yet (or an error): the
                // next read waits for it (or meets it).
                let _ = self.recv_now(buf);
            }
            return Poll::Ready(Ok(()));
        }
        loop {
            ready!(self.stream.poll_read_ready(cx))?;
            match self.recv_now(buf) {
                Ok(()) => return Poll::Ready(Ok(())),
                // The readiness was stale (it is cleared): wait for the next.
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Poll::Ready(Err(error)),
            }
        }
    }
}

impl ClientIo {
    /// Reads what the socket holds now into `buf`'s unfilled part, which is left
    /// uninitialized until then: `try_read(buf.initialize_unfilled())` zeroed the whole of
    /// hyper's read buffer before every read (hyper hands a fresh `ReadBuf` each time), which
    /// made every page of it resident for the connection's life and cost a memset per read.
    fn recv_now(&self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        let stream = &*self.stream;
        let n = stream.try_io(Interest::READABLE, || {
            // Safety: `recv` only writes bytes into the slice (it never de-initializes
            // any), as `unfilled_mut` requires.
            let unfilled = unsafe { buf.unfilled_mut() };
            socket2::SockRef::from(stream).recv(unfilled)
        })?;
        // Safety: `recv` initialized the first `n` bytes of the unfilled part (socket2's
        // contract: it returns how many bytes it wrote).
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        Ok(())
    }
}

/// Writes `write` once the socket is writable (pending while it is not).
fn poll_write_with<T>(
    stream: &TcpStream,
    cx: &mut Context<'_>,
    mut write: impl FnMut(&TcpStream) -> io::Result<T>,
) -> Poll<io::Result<T>> {
    loop {
        ready!(stream.poll_write_ready(cx))?;
        match write(stream) {
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            done => return Poll::Ready(done),
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = poll_write_with(&self.stream, cx, |stream| stream.try_write(buf));
        self.wrote(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = poll_write_with(&self.stream, cx, |stream| stream.try_write_vectored(bufs));
        self.wrote(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // A TCP socket has nothing of its own to flush.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.hand_back.asked() {
            // hyper has flushed everything (its shutdown flushes first); the socket stays
            // open for the client's next request.
            return Poll::Ready(Ok(()));
        }
        // What tokio's own `poll_shutdown` does: the write side is shut down at once.
        Poll::Ready(socket2::SockRef::from(&*self.stream).shutdown(std::net::Shutdown::Write))
    }
}
