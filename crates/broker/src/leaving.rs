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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::ClientSocket;

    /// A connected pair: the client's end and the server's (shared, as `ClientIo` holds it).
    async fn pair() -> (TcpStream, Arc<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, Arc::new(server))
    }

    #[tokio::test]
    async fn a_client_that_closes_behind_unread_bytes_is_seen() {
        let (mut client, server) = pair().await;
        let watched = ClientSocket::new(Arc::downgrade(&server));
        client.write_all(&[b'x'; 8192]).await.unwrap();
        // Bytes wait unread and the client is still there: not closed.
        let early = tokio::time::timeout(Duration::from_millis(200), watched.closed()).await;
        assert!(early.is_err(), "an open client was taken for gone");
        drop(client);
        let seen = tokio::time::timeout(Duration::from_secs(2), watched.closed()).await;
        assert!(
            seen.is_ok(),
            "the client's close behind unread bytes was not seen"
        );
    }

    #[tokio::test]
    async fn a_connection_that_is_gone_counts_as_closed() {
        let (_client, server) = pair().await;
        let watched = ClientSocket::new(Arc::downgrade(&server));
        drop(server);
        let seen = tokio::time::timeout(Duration::from_millis(200), watched.closed()).await;
        assert!(seen.is_ok());
    }
}
