//! `rediss://` with credentials in the URL, against a TLS-only redis-server with a throwaway CA
//! and `requirepass`; and the password never shows in an error, an event or a `Debug`.

mod support;

use std::sync::OnceLock;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use admitgate_fleet::{FleetError, FleetEvent, FleetLimit};
use support::{config, limit, RedisServer};

const PASSWORD: &str = "s3cret-Pa55word";

/// A TLS handshake in an unoptimised test build takes longer than the plain tests' 300 ms.
fn tls_config(server: &RedisServer, key: &str) -> admitgate_fleet::FleetConfig {
    let mut c = config(server, key, 1);
    c.connect_timeout = Duration::from_secs(3);
    c.command_timeout = Duration::from_secs(1);
    c
}

fn server() -> &'static RedisServer {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    SERVER.get_or_init(|| RedisServer::start_tls(PASSWORD))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_password_takes_hands_off_and_releases() {
    let server = server();
    let url = server.url();
    assert!(url.starts_with("rediss://:") && url.contains(PASSWORD));
    let mut c = tls_config(server, "agent:tls");
    c.tls_ca_file = Some(server.ca_file());
    let (a, b) = (limit(c.clone()), limit(c));
    a.connect().await.unwrap();
    let held = a.acquire("").await.unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("").await.unwrap() })
    };
    support::eventually(Duration::from_secs(2), "queued", || b.stats().waiting == 1).await;
    held.release().await;
    let lease = tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .expect("hand-off over TLS")
        .unwrap();
    assert_eq!(b.stats().fleet_in_flight, 1);
    lease.release().await;
    assert!(a.backend_up() && b.backend_up());
    for shown in [
        format!("{a:?}"),
        format!("{}", a.config()),
        a.config().redacted_url(),
    ] {
        assert!(!shown.contains(PASSWORD), "{shown}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_never_shows_in_errors_events_or_debug() {
    let server = server();
    let wrong = "wr0ng-Secret-Value";
    let mut c = tls_config(server, "agent:tls");
    c.url = server.url().replace(PASSWORD, wrong);
    c.tls_ca_file = Some(server.ca_file());
    let a = limit(c);
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    a.set_event_handler(Arc::new(move |e: &FleetEvent| {
        sink.lock().unwrap().push(e.clone())
    }));
    let err = a.connect().await.unwrap_err();
    let FleetError::Backend(message) = &err else {
        panic!("{err:?}")
    };
    let mut shown = vec![
        message.clone(),
        err.to_string(),
        format!("{err:?}"),
        format!("{a:?}"),
    ];
    shown.extend(events.lock().unwrap().iter().map(|e| format!("{e} {e:?}")));
    assert!(shown.len() >= 5, "the outage was announced: {shown:?}");
    for text in shown {
        assert!(!text.contains(wrong) && !text.contains(PASSWORD), "{text}");
    }
    assert!(
        message.contains("WRONGPASS") || message.contains("uthentication"),
        "{message}"
    );
    eprintln!("wrong password reported as: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_is_refused() {
    let server = server();
    // No tls_ca_file: the throwaway CA is not among the system's roots.
    let a: FleetLimit = limit(tls_config(server, "agent:tls-untrusted"));
    let err = a.connect().await.unwrap_err();
    assert_eq!(err.reason(), "fleet_unavailable");
    let text = err.to_string();
    assert!(
        text.contains("certificate") || text.contains("UnknownIssuer"),
        "{text}"
    );
    eprintln!("untrusted certificate reported as: {text}");
    assert!(!text.contains(PASSWORD), "{text}");
}

/// Mutual TLS (a managed service's client certificates): without the certificate the server
/// refuses the handshake; with it, leases are taken and given back. A key file that holds no
/// key is refused by name, without its content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_presented_where_the_server_requires_one() {
    let server = RedisServer::start_mtls(PASSWORD);
    let (cert, key) = server.client_cert();
    let mut without = tls_config(&server, "agent:mtls");
    without.tls_ca_file = Some(server.ca_file());
    let refused = limit(without.clone()).connect().await.unwrap_err();
    assert!(matches!(refused, FleetError::Backend(_)), "{refused:?}");
    let mut with = without.clone();
    with.tls_cert_file = Some(cert.clone());
    with.tls_key_file = Some(key.clone());
    let fleet = limit(with.clone());
    fleet.connect().await.unwrap();
    let lease = fleet.acquire("").await.unwrap();
    assert_eq!(fleet.stats().fleet_in_flight, 1);
    lease.release().await;
    fleet.shutdown().await;
    // Both files or neither; a key file must hold a key (its content is never shown).
    let mut half = with.clone();
    half.tls_key_file = None;
    assert_eq!(
        FleetLimit::new(half, tokio::runtime::Handle::current())
            .unwrap_err()
            .field,
        "tls_cert_file"
    );
    let mut wrong = with;
    wrong.tls_key_file = Some(cert);
    let err = FleetLimit::new(wrong, tokio::runtime::Handle::current()).unwrap_err();
    assert_eq!(err.field, "tls_key_file");
    assert!(!err.to_string().contains("BEGIN CERTIFICATE"), "{err}");
}
