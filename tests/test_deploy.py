"""What deploy/ ships, checked against the real things.

- The broker as its image runs it: statically linked (``deploy/build-broker``, the
  Dockerfile's build command, here as a debug build), on an empty root filesystem (``chroot``
  into a directory holding only what the image holds) as the image's non-root user, with the
  Kubernetes ConfigMap's ``broker.yaml`` and the Deployment's arguments, in front of a real
  A2A agent (the a2a-sdk on uvicorn). With ``ADMITGATE_BROKER_IMAGE`` set
  (``scripts/build-image`` sets it), the same tests also run the image itself with podman.
- The Kubernetes manifests against the API schemas (``kubernetes-validate``), and the timings
  and ports they must agree on with the broker's config.
- The Grafana dashboard and the KEDA query: every series they query exists in a real scrape
  of the broker's ``/metrics`` and of ``admitgate.metrics`` (``prefix="broker"``), with every
  label they group or filter by, a fleet limit on a real redis-server included.
- The GitHub workflows against their schema (``check-jsonschema``'s vendored one).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import admitgate
import admitgate.metrics
import httpx
import kubernetes_validate
import pytest
import yaml
from _a2a_app import (
    A2A_HEADERS,
    ControlledExecutor,
    Latches,
    ServerThread,
    build_sdk_app,
    jsonrpc,
    send_params,
)
from _broker import ROOT, BrokerProcess, key, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "admitgate.json"
WORKFLOWS = ROOT / ".github" / "workflows"
#: Where the Deployment mounts the ConfigMap, as the broker in the image sees it.
CONFIG_IN_IMAGE = "/etc/admitgate/broker.yaml"
#: The oldest Kubernetes the manifests are for: preStop `sleep` is on by default from 1.30.
OLDEST_KUBERNETES = "1.30"


# -- the manifests as files ----------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """Every object of deploy/kubernetes by ``kind``."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects"
            objects[doc["kind"]] = doc
    return objects


def broker_yaml() -> dict[str, Any]:
    """The ConfigMap's broker.yaml, parsed."""
    return yaml.safe_load(manifests()["ConfigMap"]["data"]["broker.yaml"])


def containers() -> dict[str, dict[str, Any]]:
    spec = manifests()["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def test_manifests_are_valid_for_the_kubernetes_api() -> None:
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version()):
        for doc in manifests().values():
            if doc["apiVersion"].startswith("keda.sh/"):
                continue  # a CRD: kubernetes-validate has no schema; checked below
            kubernetes_validate.validate(doc, version, strict=True)
    # Before 1.30 the preStop sleep the image needs (it has no shell) is not there.
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifests()["Deployment"], "1.28", strict=True)


def test_kustomization_lists_every_manifest_and_names_both_images() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    images = {image["name"] for image in kustomization["images"]}
    assert images == {c["image"] for c in containers().values()}


def test_the_drain_fits_in_the_grace_period_and_the_ports_agree() -> None:
    config = broker_yaml()
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    broker, agent = containers()["broker"], containers()["agent"]
    broker_pre = broker["lifecycle"]["preStop"]["sleep"]["seconds"]
    agent_pre = agent["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = config["drain_timeout"]
    # The agent must keep serving until the broker's drain is over, and the kubelet must not
    # kill either before that (the grace period counts the preStop hooks).
    assert agent_pre >= broker_pre + drain
    assert pod["terminationGracePeriodSeconds"] >= agent_pre + 5
    # The ports: the Service's targets are the broker's, which are the config's addresses.
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert ports["a2a"] == int(config["listen"].rpartition(":")[2])
    assert ports["metrics"] == int(config["metrics_listen"].rpartition(":")[2])
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        assert broker[probe]["httpGet"] == {"path": path, "port": "metrics"}
    service = manifests()["Service"]["spec"]
    assert {p["targetPort"] for p in service["ports"]} <= set(ports)
    # The agent is reached only through the broker: on the pod's loopback.
    assert config["upstream"].startswith("http://127.0.0.1:")
    assert broker["args"] == ["--config", CONFIG_IN_IMAGE]
    mount = broker["volumeMounts"][0]
    assert CONFIG_IN_IMAGE == f"{mount['mountPath']}/broker.yaml" and mount["readOnly"]
    for container in (broker, agent):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert pod["securityContext"]["runAsUser"] == int(image_user().split(":")[0])


def test_the_scaled_object_and_the_disruption_budget_target_the_deployment() -> None:
    objects = manifests()
    deployment = objects["Deployment"]
    scaled = objects["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "broker_inflight_requests" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) <= broker_yaml()["max_in_flight"]
    # Voluntary disruptions (node drains) leave a replica serving.
    assert scaled["spec"]["minReplicaCount"] >= 2
    assert objects["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        objects["Service"]["spec"]["selector"],
        deployment["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()


# -- the Dockerfile ------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments)."""
    stages: list[list[tuple[str, str]]] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def image_user() -> str:
    return dict(dockerfile_stages()[-1])["USER"]


def test_the_image_is_the_static_broker_alone_non_root_and_drains_on_sigterm() -> None:
    build, runtime = dockerfile_stages()
    assert dict(build)["FROM"].endswith(" AS build")
    assert any("deploy/build-broker" in rest for op, rest in build if op == "RUN")
    final = dict(runtime)
    assert final["FROM"] == "scratch"
    assert [op for op, _ in runtime if op == "RUN"] == []  # nothing to run: no shell
    uid, _, gid = final["USER"].partition(":")
    assert int(uid) > 0 and int(gid) > 0
    assert final["STOPSIGNAL"] == "SIGTERM"
    assert json.loads(final["ENTRYPOINT"]) == ["/admitgate-broker"]
    copies = [rest.split() for op, rest in runtime if op == "COPY"]
    assert {c[-1] for c in copies} == {
        "/admitgate-broker",
        "/etc/ssl/certs/ca-certificates.crt",
    }
    assert "target/" in (ROOT / ".dockerignore").read_text().split()


# -- the broker as the image runs it -------------------------------------------------------------


def is_static(binary: Path) -> bool:
    """True when the ELF file has no program interpreter (PT_INTERP): nothing is loaded."""
    data = binary.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit LE ELF"
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    types = [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]
    return 3 not in types  # PT_INTERP


@pytest.fixture(scope="module")
def static_broker() -> Path:
    """``deploy/build-broker dev``: the image's linking, as a debug build."""
    done = subprocess.run(
        [str(ROOT / "deploy" / "build-broker"), "dev"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=1200,
    )
    binary = Path(done.stdout.strip().splitlines()[-1])
    assert is_static(binary), f"{binary} is dynamically linked"
    return binary


def image_rootfs(directory: Path, binary: Path, config: str) -> Path:
    """A root filesystem holding what the image holds, plus what Kubernetes mounts."""
    root = directory / "rootfs"
    (root / "etc" / "ssl" / "certs").mkdir(parents=True)
    (root / "etc" / "admitgate").mkdir()
    shutil.copy2(binary, root / "admitgate-broker")
    shutil.copy2("/etc/ssl/certs/ca-certificates.crt", root / "etc" / "ssl" / "certs")
    (root / CONFIG_IN_IMAGE.lstrip("/")).write_text(config)
    # The kubelet mounts /etc/hosts into every container: names resolve from it with no NSS
    # module on the filesystem (glibc's files and dns lookups are in the static binary).
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n127.0.0.1 agent.local\n")
    root.chmod(0o755)
    return root


LAUNCHERS = ["static"] + (["image"] if os.environ.get("ADMITGATE_BROKER_IMAGE") else [])


def start_broker(
    how: str, binary: Path, tmp: Path, upstream: str, *extra: str, metrics: bool = True
) -> BrokerProcess:
    """The broker with the ConfigMap's broker.yaml and the Deployment's arguments; only the
    addresses are loopback ones (flags win over the file)."""
    config = manifests()["ConfigMap"]["data"]["broker.yaml"]
    args = [*containers()["broker"]["args"], "--upstream", upstream, *extra]
    if how == "image":
        (tmp / "broker.yaml").write_text(config)
        prefix = [
            "--storage-driver", "vfs", "run", "--rm", "--network", "host", "--read-only",
            "-v", f"{tmp / 'broker.yaml'}:{CONFIG_IN_IMAGE}:ro",
            # This sandbox's limits: runc with cgroupfs, and rlimits it may not raise.
            "--runtime", "runc", "--cgroup-manager", "cgroupfs",
            "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
            os.environ["ADMITGATE_BROKER_IMAGE"],
        ]  # fmt: skip
        return BrokerProcess("podman", *args, prefix=prefix, metrics=metrics)
    root = image_rootfs(tmp, binary, config)
    if os.geteuid() == 0:
        # The image's empty filesystem and its non-root user.
        prefix = [f"--userspec={image_user()}", str(root), "/admitgate-broker"]
        return BrokerProcess("chroot", *args, prefix=prefix, metrics=metrics)
    # Without root, no chroot: the same binary and file, from the host's filesystem.
    args[1] = str(root / CONFIG_IN_IMAGE.lstrip("/"))
    return BrokerProcess(root / "admitgate-broker", *args, metrics=metrics)


@pytest.fixture(scope="module")
def agent() -> Iterator[Any]:
    latches = Latches()
    executor = ControlledExecutor(latches)
    server = ServerThread()
    server.start(build_sdk_app(executor, server.url))
    server.latches = latches  # type: ignore[attr-defined]
    server.executor = executor  # type: ignore[attr-defined]
    yield server
    latches.release_all()
    server.stop()


def send_hold(url: str, k: str, results: list[int], rest: bool = False) -> threading.Thread:
    def call() -> None:
        if rest:
            response = httpx.post(
                url + "/message:send", json=send_params(f"hold {k}"), headers=A2A_HEADERS,
                timeout=60,
            )  # fmt: skip
        else:
            response = httpx.post(
                url + "/", json=jsonrpc("SendMessage", send_params(f"hold {k}")),
                headers=A2A_HEADERS, timeout=60,
            )  # fmt: skip
        results.append(response.status_code)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def queued(broker: BrokerProcess) -> float:
    """Requests waiting for a slot, every transport."""
    m = broker.metrics()
    return sum(v for name, v in m.items() if name.startswith("broker_queued_requests{"))


@pytest.mark.parametrize("how", LAUNCHERS)
def test_the_deployed_broker_gates_the_agent_at_its_configured_cap_and_drains(
    how: str, static_broker: Path, agent: Any, tmp_path: Path
) -> None:
    config = broker_yaml()
    cap, depth = config["max_in_flight"], config["queue_depth"]
    # The agent by name, as /etc/hosts gives it.
    upstream = f"http://agent.local:{agent.port}" if how == "static" else agent.url
    broker = start_broker(how, static_broker, tmp_path, upstream)
    try:
        ops = httpx.get(broker.metrics_url + "/livez", timeout=5)
        assert ops.status_code == 200
        wait_until(lambda: httpx.get(broker.metrics_url + "/readyz").status_code == 200, 10)
        executor, latches = agent.executor, agent.latches
        keys = [key() for _ in range(cap + depth)]
        results: list[int] = []
        threads = [send_hold(broker.url, k, results, rest=i % 2 == 1) for i, k in enumerate(keys)]
        wait_until(lambda: executor.running == cap, 20)
        wait_until(lambda: queued(broker) == depth, 20)
        refused = httpx.post(
            broker.url + "/", json=jsonrpc("SendMessage", send_params("echo no")),
            headers=A2A_HEADERS, timeout=10,
        )  # fmt: skip
        assert refused.status_code == 429
        assert refused.headers["admitgate-reason"] == "queue_full"
        assert broker.gauge("broker_limit") == cap
        assert broker.gauge("broker_queue_depth") == depth
        assert executor.running == cap  # nothing more reached the agent
        for k in keys:
            latches[k].release()
        for thread in threads:
            thread.join(30)
        assert results == [200] * len(keys)
        assert executor.peak_running <= cap
        # SIGTERM (the image's STOPSIGNAL) drains and exits 0.
        k = key()
        running: list[int] = []
        held = send_hold(broker.url, k, running)
        wait_until(lambda: latches[k].started.is_set(), 20)
        broker.process.send_signal(15)
        wait_until(lambda: httpx.get(broker.metrics_url + "/readyz").status_code == 503, 10)
        latches[k].release()
        held.join(30)
        assert running == [200]
        assert broker.stop(None) == 0
    finally:
        broker.kill()


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    burst=st.lists(st.sampled_from(["jsonrpc", "rest", "stream", "card"]), min_size=1, max_size=40)
)
def test_any_burst_through_the_deployed_broker_is_admitted_queued_or_refused_as_configured(
    static_broker: Path, agent: Any, tmp_path_factory: Any, burst: list[str]
) -> None:
    """A generated burst of work (blocking and streaming) and agent-card reads, all at once,
    against the manifests' settings: exactly min(cap, work) run at the agent, the next ones up
    to the queue depth wait, the rest are refused with `queue_full`; once released everything
    admitted is served, the agent never ran more than the cap, the card was never gated, and
    admitted + refused adds up to the work sent."""
    config = broker_yaml()
    cap, depth = config["max_in_flight"], config["queue_depth"]
    work = sum(1 for kind in burst if kind != "card")
    broker = start_broker("static", static_broker, tmp_path_factory.mktemp("burst"), agent.url)
    executor, latches = agent.executor, agent.latches
    executor.peak_running = executor.running
    statuses: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def one(kind: str) -> None:
        k = key()
        path, body = {
            "jsonrpc": ("/", jsonrpc("SendMessage", send_params(f"hold {k}"))),
            "rest": ("/message:send", send_params(f"hold {k}")),
            "stream": ("/message:stream", send_params(f"hold {k}")),
            "card": ("/.well-known/agent-card.json", None),
        }[kind]
        with httpx.Client(timeout=60) as client:
            if body is None:
                r = client.get(broker.url + path)
            else:
                r = client.post(broker.url + path, json=body, headers=A2A_HEADERS)
        with lock:
            statuses.append((kind, r.status_code, r.headers.get("admitgate-reason", "")))

    try:
        before = broker.metrics()
        threads = [threading.Thread(target=one, args=(kind,), daemon=True) for kind in burst]
        for thread in threads:
            thread.start()
        refused = max(work - cap - depth, 0)
        wait_until(
            lambda: (
                executor.running == min(cap, work)
                and queued(broker) == min(max(work - cap, 0), depth)
                and sum(1 for _, status, _ in statuses if status == 429) == refused
            ),
            20,
        )
        assert executor.running == min(cap, work)
        stop = threading.Event()

        def release_until_done() -> None:
            while not stop.is_set():
                latches.release_all()
                time.sleep(0.02)

        releaser = threading.Thread(target=release_until_done, daemon=True)
        releaser.start()
        for thread in threads:
            thread.join(60)
        stop.set()
        releaser.join(5)
        assert len(statuses) == len(burst)
        assert executor.peak_running <= cap
        # Every answer is a success or the documented refusal.
        assert all(
            status == 200 or (status == 429 and reason == "queue_full")
            for _, status, reason in statuses
        ), statuses
        assert sum(1 for s in statuses if s[1] == 429) == refused
        assert all(status == 200 for kind, status, _ in statuses if kind == "card")
        after = broker.metrics()

        def delta(name: str) -> float:
            return sum(
                after.get(f'{name}{{transport="{t}"}}', 0)
                - before.get(f'{name}{{transport="{t}"}}', 0)
                for t in ("jsonrpc", "rest", "grpc")
            )

        assert delta("broker_admitted_total") == work - refused
        assert delta("broker_rejected_total") == refused
        broker.wait_for("broker_gate_in_flight", 0, timeout=10)
    finally:
        latches.release_all()
        broker.stop()


# -- the dashboard's and the autoscaler's series -------------------------------------------------


def scraped_series(text: str) -> dict[str, set[str]]:
    """``{sample name: the label names it carries}`` of one exposition."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def exporters(static_broker: Path, agent: Any, redis_server: Any, tmp_path_factory: Any) -> Any:
    """The series of a real broker and of a real gate's collector, both with a fleet limit
    and after admitted, refused and queued work."""
    tmp = tmp_path_factory.mktemp("scrape")
    broker = start_broker(
        "static", static_broker, tmp, agent.url, "--fleet", redis_server.url,
        "--fleet-key", f"deploy:{uuid.uuid4().hex[:8]}", "--max-in-flight", "1",
        "--queue-depth", "0",
    )  # fmt: skip
    try:
        k = key()
        results: list[int] = []
        held = send_hold(broker.url, k, results)
        wait_until(lambda: agent.latches[k].started.is_set(), 20)
        refused = httpx.post(
            broker.url + "/message:send", json=send_params("echo no"), headers=A2A_HEADERS,
            timeout=10,
        )  # fmt: skip
        assert refused.status_code == 429
        agent.latches[k].release()
        held.join(30)
        broker_series = scraped_series(httpx.get(broker.metrics_url + "/metrics").text)
    finally:
        broker.stop()

    async def turns(gate: Any) -> None:
        async with gate.admit(session_id="a"):
            with pytest.raises(admitgate.AdmissionRejected):
                async with gate.admit(session_id="b"):
                    pass

    fleet = admitgate.FleetLimit(redis_server.url, f"deploy:{uuid.uuid4().hex[:8]}", 4)
    gate = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=0, fleet=fleet)
    try:
        asyncio.run(turns(gate))
        registry = CollectorRegistry()
        admitgate.metrics.register(gate, registry, prefix="broker")
        python_series = scraped_series(generate_latest(registry).decode())
    finally:
        gate.close_sync()
    return {"broker": broker_series, "admitgate.metrics": python_series}


#: Labels Prometheus adds at scrape time.
TARGET_LABELS = {"job", "instance"}


def queried(expr: str) -> list[tuple[str, set[str]]]:
    """The metrics ``expr`` reads, each with the labels it groups or filters by."""
    grouped = {
        label.strip()
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr)
        for label in clause.split(",")
        if label.strip()
    }
    found = []
    for name, matchers in re.findall(r"\b(broker_[a-z_]+)\b(?:\{([^}]*)\})?", expr):
        filtered = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""))
        labels = (grouped | filtered) - TARGET_LABELS
        if not name.endswith("_bucket"):
            labels.discard("le")
        found.append((name, labels))
    return found


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]
    found += [
        (f"variable {v['name']}", v["definition"])
        for v in board["templating"]["list"]
        if v["type"] == "query"
    ]
    return found


def test_every_series_the_dashboard_and_the_autoscaler_query_exists(exporters: Any) -> None:
    queries = dashboard_queries()
    (trigger,) = manifests()["ScaledObject"]["spec"]["triggers"]
    queries.append(("KEDA ScaledObject", trigger["metadata"]["query"]))
    missing = []
    for where, expr in queries:
        names = queried(expr)
        assert names, f"{where}: no broker_ series in {expr!r}"
        for name, labels in names:
            if not any(name in series and labels <= series[name] for series in exporters.values()):
                missing.append(f"{where}: {name} with labels {sorted(labels)}")
    assert missing == []
    # What each exporter has that the other lacks is what the panels query in two ways.
    broker, collector = exporters["broker"], exporters["admitgate.metrics"]
    assert "reason" in collector["broker_rejected_total"]
    assert "reason" in broker["broker_rejected_reason_total"]


def test_the_dashboard_has_a_panel_for_each_view_an_operator_needs() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for needed in (
        "broker_inflight_requests",
        "broker_limit",  # the limit in force: learned (adaptive=) or configured
        "broker_fleet_max_in_flight",  # the configured fleet cap
        "broker_queued_requests",
        "broker_rejected_reason_total",  # by reason and transport (the broker)
        "broker_rejected_total",  # with its reason label (admitgate.metrics)
        "broker_fleet_in_flight",
        "broker_fleet_outages_total",
        "broker_queue_wait_seconds_bucket",
        "broker_upstream_up",
    ):
        assert needed in exprs, needed
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "admitgate" and board["title"]


# -- the GitHub workflows ------------------------------------------------------------------------


def test_the_workflows_match_the_github_schema_and_cover_every_platform() -> None:
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    assert {Path(f).name for f in files} == {"ci.yml", "release.yml"}
    for schema in ("vendor.github-workflows", "custom.github-workflows-require-timeout"):
        done = subprocess.run(
            [sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *files],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    ci = (WORKFLOWS / "ci.yml").read_text()
    assert "run: ./.ci/run" in ci
    # The second test command runs too, on the oldest and the newest supported CPython.
    pythons = yaml.safe_load(ci)["jobs"]["pythons"]
    assert pythons["strategy"]["matrix"]["python"] == ["3.10", "3.13"]
    assert any(step.get("run") == "./scripts/test-pythons" for step in pythons["steps"])
    release = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    jobs = release["jobs"]
    linux = jobs["linux"]["strategy"]["matrix"]
    assert set(linux["arch"]) == {"x86_64", "aarch64"}
    assert set(linux["libc"]) == {"manylinux2014", "musllinux_1_2"}
    others = {entry["name"] for entry in jobs["macos-windows"]["strategy"]["matrix"]["include"]}
    assert others == {"macos-x86_64", "macos-arm64", "windows-x64"}
    assert jobs["sdist"]["steps"][1]["with"]["command"] == "sdist"
    targets = {entry["target"] for entry in jobs["broker"]["strategy"]["matrix"]["include"]}
    assert {"x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu"} <= targets
    # Every build job smoke-tests what it built.
    for name in ("linux", "macos-windows", "sdist", "broker"):
        assert any("smoke" in step.get("name", "").lower() for step in jobs[name]["steps"]), name
    # Every action is pinned to a major version.
    for text in (ci, (WORKFLOWS / "release.yml").read_text()):
        for action in re.findall(r"uses:\s*(\S+)", text):
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", action), action
