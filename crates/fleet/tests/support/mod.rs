//! Real redis-server instances for the tests (never a mock): started on a free loopback port with
//! persistence off, killed when the test binary exits (the kernel kills them: they are spawned
//! with PR_SET_PDEATHSIG from a thread that lives as long as the process).
//!
//! redis-server is found through `ADMITGATE_REDIS_SERVER`, then `PATH`, then
//! `/usr/bin/redis-server`; `scripts/redis-server` installs Debian's package when it is missing.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use admitgate_fleet::{FleetConfig, FleetLimit};

/// One redis-server process (restartable on the same port).
pub struct RedisServer {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Mutex<Option<Child>>,
    starts: Mutex<u32>,
    tls: bool,
    password: Option<String>,
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns children from one thread that never exits, so PR_SET_PDEATHSIG (which follows the
/// spawning thread) fires only when the whole test process ends.
fn spawn(command: Command) -> Child {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("redis-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    // Safety: prctl is async-signal-safe and touches no memory of the parent.
                    unsafe {
                        command.pre_exec(|| {
                            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                                return Err(std::io::Error::last_os_error());
                            }
                            Ok(())
                        });
                    }
                    let _ = reply.send(command.spawn());
                }
                // Keep this thread alive for the rest of the process.
                loop {
                    std::thread::park();
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::channel();
    spawner.lock().unwrap().send((command, tx)).unwrap();
    rx.recv().unwrap().expect("redis-server should start")
}

pub fn redis_server_path() -> PathBuf {
    if let Some(path) = std::env::var_os("ADMITGATE_REDIS_SERVER") {
        return PathBuf::from(path);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("redis-server");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    let fallback = PathBuf::from("/usr/bin/redis-server");
    assert!(
        fallback.is_file(),
        "redis-server not found (PATH, ADMITGATE_REDIS_SERVER): run scripts/redis-server"
    );
    fallback
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scratch_dir(name: &str) -> PathBuf {
    static COUNTER: Mutex<u32> = Mutex::new(0);
    let n = {
        let mut c = COUNTER.lock().unwrap();
        *c += 1;
        *c
    };
    let dir =
        std::env::temp_dir().join(format!("admitgate-fleet-{}-{name}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

impl RedisServer {
    /// A plain instance on a free loopback port.
    pub fn start() -> Self {
        Self::launch("plain", false, None)
    }

    /// A TLS-only instance with a throwaway CA and server certificate (made with the openssl
    /// CLI) that also requires `password`.
    pub fn start_tls(password: &str) -> Self {
        Self::launch("tls", true, Some(password.to_owned()))
    }

    fn launch(name: &str, tls: bool, password: Option<String>) -> Self {
        let dir = scratch_dir(name);
        let port = free_port();
        let mut args: Vec<String> = vec![
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--protected-mode".into(),
            "no".into(),
        ];
        if tls {
            make_certificates(&dir);
            for (flag, value) in [
                ("--port", "0".to_owned()),
                ("--tls-port", port.to_string()),
                (
                    "--tls-cert-file",
                    dir.join("server.crt").display().to_string(),
                ),
                (
                    "--tls-key-file",
                    dir.join("server.key").display().to_string(),
                ),
                (
                    "--tls-ca-cert-file",
                    dir.join("ca.crt").display().to_string(),
                ),
                ("--tls-auth-clients", "no".to_owned()),
            ] {
                args.push(flag.into());
                args.push(value);
            }
        } else {
            args.push("--port".into());
            args.push(port.to_string());
        }
        if let Some(password) = &password {
            args.push("--requirepass".into());
            args.push(password.clone());
        }
        let server = RedisServer {
            port,
            dir,
            args,
            child: Mutex::new(None),
            starts: Mutex::new(0),
            tls,
            password,
        };
        server.run();
        server
    }

    fn run(&self) {
        let mut starts = self.starts.lock().unwrap();
        *starts += 1;
        let log = self.dir.join(format!("redis-{}.log", *starts));
        let mut command = Command::new(redis_server_path());
        command
            .args(&self.args)
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn(command);
        *self.child.lock().unwrap() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Ready to accept connections") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {}:\n{text}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>/0` (or `rediss://:<password>@127.0.0.1:<port>/0`).
    pub fn url(&self) -> String {
        let auth = match &self.password {
            Some(password) => format!(":{password}@"),
            None => String::new(),
        };
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://{auth}127.0.0.1:{}/0", self.port)
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// SIGKILL: the process dies with everything in memory (persistence is off).
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port, empty.
    pub fn restart(&self) {
        self.kill();
        self.run();
    }

    /// SIGSTOP: the socket stays open and nothing answers (a dead peer, not a refused one).
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`freeze`](Self::freeze).
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        let guard = self.child.lock().unwrap();
        let pid = guard.as_ref().expect("server running").id() as i32;
        // Safety: signalling our own child process.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Sends one command over a raw RESP connection (plain instances only) and returns the
    /// reply's text, for looking at Redis without going through the crate under test.
    pub fn command(&self, args: &[&str]) -> String {
        assert!(!self.tls, "raw commands are for plain instances");
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).unwrap();
        read_reply(&mut stream)
    }

    /// The number of members of a sorted set.
    pub fn zcard(&self, key: &str) -> i64 {
        self.command(&["ZCARD", key]).parse().unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.lock() {
            if let Some(mut child) = child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads one RESP reply and renders it as text (arrays as lines).
fn read_reply(stream: &mut TcpStream) -> String {
    let line = read_line(stream);
    let (kind, rest) = line.split_at(1);
    match kind {
        "+" | "-" | ":" => rest.to_owned(),
        "$" => {
            let len: i64 = rest.parse().unwrap();
            if len < 0 {
                return String::new();
            }
            let mut buf = vec![0; len as usize + 2];
            stream.read_exact(&mut buf).unwrap();
            String::from_utf8_lossy(&buf[..len as usize]).into_owned()
        }
        "*" => {
            let n: i64 = rest.parse().unwrap();
            (0..n.max(0))
                .map(|_| read_reply(stream))
                .collect::<Vec<_>>()
                .join("\n")
        }
        _ => panic!("unexpected RESP reply {line:?}"),
    }
}

fn read_line(stream: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        stream.read_exact(&mut byte).unwrap();
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).unwrap()
}

/// A throwaway CA and a server certificate for 127.0.0.1 / localhost, valid for a day.
fn make_certificates(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl CLI (Debian package openssl) is needed for the TLS test");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=admitgate test CA",
    ]);
    openssl(&ca);
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(&csr);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "server.ext",
    ]);
}

/// The instance shared by the tests of one binary (each test uses its own limit key).
pub fn shared() -> &'static RedisServer {
    static SHARED: OnceLock<RedisServer> = OnceLock::new();
    SHARED.get_or_init(RedisServer::start)
}

/// A limit key no other test uses.
pub fn unique_key(name: &str) -> String {
    static N: Mutex<u32> = Mutex::new(0);
    let mut n = N.lock().unwrap();
    *n += 1;
    format!("test:{name}:{}:{}", std::process::id(), *n)
}

/// A config with short timings suited to tests.
pub fn config(server: &RedisServer, key: &str, cap: u32) -> FleetConfig {
    let mut config = FleetConfig::new(server.url(), key, cap);
    config.lease_ttl = Duration::from_secs(3);
    config.connect_timeout = Duration::from_millis(300);
    config.command_timeout = Duration::from_millis(300);
    config.recheck_interval = Duration::from_millis(200);
    config.probe_interval = Duration::from_millis(100);
    config
}

/// A limit on the current runtime.
pub fn limit(config: FleetConfig) -> FleetLimit {
    FleetLimit::new(config, tokio::runtime::Handle::current()).expect("valid config")
}

/// Polls `check` every 10 ms until it holds or `within` passes.
pub async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Median and 99th percentile of durations.
pub fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}
