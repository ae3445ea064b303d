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
    /// redis-server, or redis-sentinel.
    binary: PathBuf,
    args: Vec<String>,
    child: Mutex<Option<Child>>,
    starts: Mutex<u32>,
    tls: bool,
    password: Option<String>,
    /// What its log says once it serves.
    ready: &'static str,
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

/// Debian's `redis-sentinel` (installed by `scripts/redis-server`), next to redis-server or on
/// `PATH`.
pub fn redis_sentinel_path() -> PathBuf {
    let beside = redis_server_path().with_file_name("redis-sentinel");
    if beside.is_file() {
        return beside;
    }
    let fallback = PathBuf::from("/usr/bin/redis-sentinel");
    assert!(
        fallback.is_file(),
        "redis-sentinel not found: run scripts/redis-server (it installs Debian's redis-sentinel)"
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

    /// A plain instance with extra arguments (`--replicaof`, `--cluster-enabled`, ...).
    pub fn start_with(name: &str, extra: &[String]) -> Self {
        Self::launch_with(name, false, None, extra)
    }

    /// A sentinel (Debian's `redis-sentinel`, the same binary in sentinel mode) monitoring the
    /// primary on `primary_port` as `mymaster`, with `down-after-milliseconds 1000` and a
    /// quorum of 2.
    pub fn start_sentinel(primary_port: u16) -> Self {
        let dir = scratch_dir("sentinel");
        let port = free_port();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\n\
                 sentinel monitor mymaster 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 4000\n\
                 sentinel parallel-syncs mymaster 1\n",
                dir.display()
            ),
        )
        .unwrap();
        let server = RedisServer {
            port,
            dir,
            binary: redis_sentinel_path(),
            args: vec![conf.display().to_string()],
            child: Mutex::new(None),
            starts: Mutex::new(0),
            tls: false,
            password: None,
            ready: "+monitor master",
        };
        server.run();
        server
    }

    fn launch(name: &str, tls: bool, password: Option<String>) -> Self {
        Self::launch_with(name, tls, password, &[])
    }

    /// A TLS-only instance that requires a client certificate signed by its CA
    /// (`tls-auth-clients yes`, mutual TLS as managed services offer) and `password`.
    pub fn start_mtls(password: &str) -> Self {
        Self::launch_with(
            "mtls",
            true,
            Some(password.to_owned()),
            &["--tls-auth-clients".into(), "yes".into()],
        )
    }

    /// The client certificate and its key, signed by the instance's CA.
    pub fn client_cert(&self) -> (PathBuf, PathBuf) {
        (self.dir.join("client.crt"), self.dir.join("client.key"))
    }

    fn launch_with(name: &str, tls: bool, password: Option<String>, extra: &[String]) -> Self {
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
        args.extend(extra.iter().cloned());
        let server = RedisServer {
            port,
            dir,
            binary: redis_server_path(),
            args,
            child: Mutex::new(None),
            starts: Mutex::new(0),
            tls,
            password,
            ready: "Ready to accept connections",
        };
        server.run();
        server
    }

    fn run(&self) {
        let mut starts = self.starts.lock().unwrap();
        *starts += 1;
        let log = self.dir.join(format!("redis-{}.log", *starts));
        let mut command = Command::new(&self.binary);
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
            if text.contains(self.ready) {
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

    /// Whether the process is running (not killed).
    pub fn is_running(&self) -> bool {
        self.child.lock().unwrap().is_some()
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
    let mut client = vec!["req"];
    client.extend(ec);
    client.extend([
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
        "-subj",
        "/CN=admitgate test client",
    ]);
    openssl(&client);
    std::fs::write(
        dir.join("client.ext"),
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.crt",
        "-days",
        "1",
        "-extfile",
        "client.ext",
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

/// A Sentinel deployment on loopback: a primary, a replica and three sentinels
/// (`down-after-milliseconds 1000`, quorum 2), the service named `mymaster`.
pub struct SentinelSet {
    /// The data nodes; `nodes[0]` starts as the primary, `nodes[1]` as its replica.
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<RedisServer>,
}

impl SentinelSet {
    /// Starts the five processes and waits until the sentinels know each other and the replica.
    pub fn start() -> Self {
        // A replica's first sync starts at once (Redis 7 waits 5 s for more replicas).
        let quick = ["--repl-diskless-sync-delay".to_owned(), "0".to_owned()];
        let primary = RedisServer::start_with("primary", &quick);
        let mut replica_args = quick.to_vec();
        replica_args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.port.to_string(),
        ]);
        let replica = RedisServer::start_with("replica", &replica_args);
        let sentinels = (0..3)
            .map(|_| RedisServer::start_sentinel(primary.port))
            .collect();
        let set = SentinelSet {
            nodes: vec![primary, replica],
            sentinels,
        };
        set.wait_settled(Duration::from_secs(20));
        set
    }

    /// `redis+sentinel://127.0.0.1:<s1>,127.0.0.1:<s2>,127.0.0.1:<s3>/mymaster/0`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        format!("redis+sentinel://{}/mymaster/0", hosts.join(","))
    }

    /// What a live sentinel reports about `mymaster`, as field → value.
    pub fn master_info(&self) -> std::collections::HashMap<String, String> {
        for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
            let text = sentinel.command(&["SENTINEL", "MASTER", "mymaster"]);
            let lines: Vec<&str> = text.lines().collect();
            if lines.len() >= 2 {
                return lines
                    .chunks(2)
                    .filter(|pair| pair.len() == 2)
                    .map(|pair| (pair[0].to_owned(), pair[1].to_owned()))
                    .collect();
            }
        }
        panic!("no sentinel answered");
    }

    /// The port of the primary the sentinels name now, once every live sentinel names the same
    /// one (right after a failover, the sentinels that did not lead it learn of it within a
    /// couple of seconds).
    pub fn primary_port(&self) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let named: Vec<String> = self
                .sentinels
                .iter()
                .filter(|s| s.is_running())
                .map(|s| s.command(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"]))
                .collect();
            if named.windows(2).all(|pair| pair[0] == pair[1]) {
                if let Some(port) = named.first().and_then(|n| n.lines().nth(1)) {
                    return port.parse().unwrap();
                }
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels disagree: {named:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The data node on `port`.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// Until every live sentinel sees the two others and a replica that is up, and the
    /// primary it names answers as a primary with a connected replica.
    pub fn wait_settled(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let settled = self.sentinels.iter().filter(|s| s.is_running()).all(|s| {
                let text = s.command(&["SENTINEL", "MASTER", "mymaster"]);
                let lines: Vec<&str> = text.lines().collect();
                let field = |name: &str| {
                    lines
                        .chunks(2)
                        .find(|p| p.len() == 2 && p[0] == name)
                        .map(|p| p[1].to_owned())
                        .unwrap_or_default()
                };
                let live = self.sentinels.iter().filter(|s| s.is_running()).count();
                field("num-other-sentinels") == (live - 1).to_string()
                    && field("num-slaves") != "0"
                    && field("flags") == "master"
            }) && {
                let port = self.primary_port();
                let node = self.node(port);
                node.is_running()
                    && node
                        .command(&["INFO", "replication"])
                        .contains("state=online")
            };
            if settled {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels did not settle within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Polls `check` every 50 ms (blocking the thread) until it holds or `within` passes.
pub fn eventually_blocking(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A cluster primary: its node id, its port, the slot ranges it serves.
pub type Primary = (String, u16, Vec<(u16, u16)>);

/// A Redis Cluster on loopback: three primaries and three replicas (`--cluster-enabled yes`,
/// made with `redis-cli --cluster create`).
pub struct ClusterSet {
    pub nodes: Vec<RedisServer>,
}

/// `redis-cli`, next to redis-server (Debian's redis-tools, a dependency of redis-server).
pub fn redis_cli_path() -> PathBuf {
    let server = redis_server_path();
    let beside = server.with_file_name("redis-cli");
    if beside.is_file() {
        beside
    } else {
        PathBuf::from("/usr/bin/redis-cli")
    }
}

impl ClusterSet {
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with(
                    "cluster",
                    &[
                        "--cluster-enabled".into(),
                        "yes".into(),
                        "--cluster-node-timeout".into(),
                        "2000".into(),
                        // A replica's first sync starts at once (Redis 7 waits 5 s).
                        "--repl-diskless-sync-delay".into(),
                        "0".into(),
                    ],
                )
            })
            .collect();
        let mut create = Command::new(redis_cli_path());
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let set = ClusterSet { nodes };
        eventually_blocking(Duration::from_secs(30), "the cluster is ok", || {
            set.nodes
                .iter()
                .all(|n| n.command(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        });
        eventually_blocking(
            Duration::from_secs(30),
            "every primary has its replica",
            || {
                set.primaries().iter().all(|(_, port, _)| {
                    set.node(*port)
                        .command(&["INFO", "replication"])
                        .contains("state=online")
                })
            },
        );
        set
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,127.0.0.1:<p3>` (three seeds).
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .take(3)
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        self.nodes[0]
            .command(&["CLUSTER", "KEYSLOT", key])
            .parse()
            .unwrap()
    }

    /// Each primary: (its node id, its port, the slot ranges it serves).
    pub fn primaries(&self) -> Vec<Primary> {
        let text = self.nodes[0].command(&["CLUSTER", "NODES"]);
        text.lines()
            .filter(|line| line.contains("master") && !line.contains("fail"))
            .map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let port: u16 = fields[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
                let ranges = fields[8..]
                    .iter()
                    .filter(|f| !f.starts_with('['))
                    .map(|f| match f.split_once('-') {
                        Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                        None => (f.parse().unwrap(), f.parse().unwrap()),
                    })
                    .collect();
                (fields[0].to_owned(), port, ranges)
            })
            .collect()
    }

    /// The primary serving `slot`: (node id, port).
    pub fn owner(&self, slot: u16) -> (String, u16) {
        self.primaries()
            .into_iter()
            .find(|(_, _, ranges)| ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .map(|(id, port, _)| (id, port))
            .expect("every slot is served")
    }

    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// Moves `slot` to the primary `to` as `redis-cli --cluster reshard` does (IMPORTING,
    /// MIGRATING, MIGRATE of its keys, SETSLOT NODE everywhere), pausing `pause` between the
    /// steps so that calls meet the slot mid-migration (ASK, TRYAGAIN).
    pub fn migrate_slot(&self, slot: u16, to: &(String, u16), pause: Duration) {
        let (from_id, from_port) = self.owner(slot);
        let (to_id, to_port) = to;
        let slot_text = slot.to_string();
        let source = self.node(from_port);
        let target = self.node(*to_port);
        assert_eq!(
            target.command(&["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &from_id]),
            "OK"
        );
        assert_eq!(
            source.command(&["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", to_id]),
            "OK"
        );
        std::thread::sleep(pause);
        let keys = source.command(&["CLUSTER", "GETKEYSINSLOT", &slot_text, "1000"]);
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if !keys.is_empty() {
            // One MIGRATE for all of them (atomic): a script never sees half of its keys.
            let port = to_port.to_string();
            let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            migrate.extend(keys.iter().copied());
            let reply = source.command(&migrate);
            assert!(reply == "OK" || reply == "NOKEY", "MIGRATE: {reply}");
        }
        std::thread::sleep(pause);
        for (_, port, _) in self.primaries() {
            let reply = self
                .node(port)
                .command(&["CLUSTER", "SETSLOT", &slot_text, "NODE", to_id]);
            assert_eq!(reply, "OK", "SETSLOT NODE on {port}");
        }
    }
}

/// When the first of the sentinels on `ports` named a primary other than the one on `old`.
pub fn first_naming(ports: &[u16], old: u16, within: Duration) -> Instant {
    let deadline = Instant::now() + within;
    loop {
        for port in ports {
            let Ok(mut stream) = TcpStream::connect(("127.0.0.1", *port)) else {
                continue;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
            let request =
                "*3\r\n$8\r\nSENTINEL\r\n$23\r\nget-master-addr-by-name\r\n$8\r\nmymaster\r\n";
            if stream.write_all(request.as_bytes()).is_err() {
                continue;
            }
            let reply = read_reply(&mut stream);
            if reply.lines().nth(1).is_some_and(|p| p != old.to_string()) {
                return Instant::now();
            }
        }
        assert!(Instant::now() < deadline, "no sentinel named a new primary");
        std::thread::sleep(Duration::from_millis(10));
    }
}
