//! Seeing an HTTP/1.1 client leave while nothing reads its socket.
//!
//! hyper reads a client's connection only as the request body is asked for. A gated request
//! whose body is longer than what the broker buffers before it queues (`--max-buffered-body`)
//! waits for its slot with the rest of its body unread, so a client that closes meanwhile
//! is not seen by hyper: the request would be admitted, counted, and fail while forwarding.
//! The kernel knows (a FIN is queued behind the unread bytes, or a reset arrived), and
//! tokio's readiness says so (`is_read_closed`, from `EPOLLRDHUP`): the waiting request
//! watches it and withdraws. What the client still had to send must fit in the broker's
//! socket receive buffer for its FIN to arrive; a client whose unsent rest is larger is seen
//! only when its body is read, after admission.

use std::sync::Weak;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// How often a waiting request looks again whether its client has closed: the socket is
/// readable all that time (bytes wait unread), so readiness alone cannot wake it.
const LOOK_EVERY: Duration = Duration::from_millis(50);

/// A client's socket, watched by a request that waits with the client's bytes unread.
#[derive(Clone, Debug)]
pub struct ClientSocket(Weak<TcpStream>);

impl ClientSocket {
    /// The socket `stream` (not kept open by this).
    pub fn new(stream: Weak<TcpStream>) -> Self {
        Self(stream)
    }

    /// Resolves once the client has closed its side of the connection (a FIN, even behind
    /// bytes not read yet, or a reset), or the connection is gone.
    pub async fn closed(&self) {
        loop {
            let Some(stream) = self.0.upgrade() else {
                return;
            };
            match stream.ready(Interest::READABLE).await {
                Ok(ready) if !ready.is_read_closed() && !ready.is_error() => {}
                _ => return,
            }
            drop(stream);
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }
}
