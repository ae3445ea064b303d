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
use socket2::SockRef;
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
    /// made every page of it resident for the connection's life and cost an 8 KiB memset per
    /// read. A read that does not fill the room shows the socket drained, so its readiness is
    /// cleared (returning `WouldBlock` from `try_io` clears it), as tokio's own
    /// `TcpStream::poll_read` does: otherwise the next read is a `recvfrom` that only says
    /// `EAGAIN`, one per request. Both measured in BENCHMARKS.md.
    fn recv_now(&self, buf: &mut ReadBuf<'_>) -> io::Result<()> {
        let stream = &*self.stream;
        let room = buf.remaining();
        let mut read = None;
        let tried = stream.try_io(Interest::READABLE, || {
            // Safety: `recv` only writes bytes into the slice (it never de-initializes
            // any), as `unfilled_mut` requires.
            let unfilled = unsafe { buf.unfilled_mut() };
            let n = SockRef::from(stream).recv(unfilled)?;
            read = Some(n);
            if n > 0 && n < room {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        });
        if let Some(n) = read {
            // Safety: `recv` initialized the first `n` bytes of the unfilled part (socket2's
            // contract: it returns how many bytes it wrote).
            unsafe { buf.assume_init(n) };
            buf.advance(n);
            return Ok(());
        }
        tried.map(drop)
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

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
    use tokio::net::{TcpListener, TcpStream};

    use super::ClientIo;

    const REQUEST: &[u8] =
        b"POST /message:stream HTTP/1.1\r\nHost: x\r\ncontent-length: 2\r\n\r\n{}";

    /// The server's end of a connection whose client sent `REQUEST`, with its first `split`
    /// bytes already read (as the HTTP/2 preface check reads them) and the rest waiting.
    async fn sent(split: usize) -> (ClientIo, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        client.write_all(REQUEST).await.unwrap();
        let mut first = vec![0; split];
        server.read_exact(&mut first).await.unwrap();
        // The rest has arrived in the server's socket.
        server.readable().await.unwrap();
        let io = ClientIo::new(server, Bytes::from(first), Duration::from_secs(5));
        (io, client)
    }

    /// One `poll_read` of `io` into a fresh, uninitialized 8 KiB buffer, as hyper reads.
    async fn read_once(io: &mut ClientIo) -> (Vec<u8>, usize) {
        let mut storage = [MaybeUninit::<u8>::uninit(); 8192];
        let mut buf = ReadBuf::uninit(&mut storage);
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut *io).poll_read(cx, &mut buf))
            .await
            .unwrap();
        (buf.filled().to_vec(), buf.initialized().len())
    }

    #[tokio::test]
    async fn a_replay_and_what_the_socket_holds_come_in_one_read() {
        let (mut io, _client) = sent(24).await;
        // One read: hyper parses the head at once and never reserves a second buffer.
        assert_eq!(read_once(&mut io).await.0, REQUEST);
    }

    #[tokio::test]
    async fn a_read_initializes_only_what_it_fills() {
        let (mut io, _client) = sent(0).await;
        let (filled, initialized) = read_once(&mut io).await;
        assert_eq!(filled, REQUEST);
        // The rest of hyper's buffer is left as it was: never written, never made resident.
        assert_eq!(initialized, REQUEST.len());
    }
}
