//! A client's socket as hyper sees it: bytes already read are replayed first, and a shutdown
//! is skipped when the connection is being handed back between exchanges.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

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
    stream: TcpStream,
    replay: Bytes,
    hand_back: HandBack,
}

impl ClientIo {
    /// `stream`, with `replay` (bytes already read from it) to be read first.
    pub fn new(stream: TcpStream, replay: Bytes) -> Self {
        Self {
            stream,
            replay,
            hand_back: HandBack(Arc::new(AtomicU8::new(SERVING))),
        }
    }

    /// The socket.
    pub fn stream(&self) -> &TcpStream {
        &self.stream
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
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.hand_back.asked() {
            // hyper has flushed everything (its shutdown flushes first); the socket stays
            // open for the client's next request.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
