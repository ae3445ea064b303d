"""The broker with priority classes in front of an agent it knows nothing about. People chatting
(`x-priority: interactive`) are guaranteed half of the agent's 2 runs and go first; a batch
job takes the rest. The agent's `POST /message:send` takes half a second. Two batch requests
run and two wait (queue depth 2); then a person's request arrives at the full queue: the oldest
waiting batch request is shed (its 429 names its class) and the person runs at the next free
slot, before the other batch waiter. A request naming no class, or one the broker does not
have, runs as batch (the default class) and is counted in /metrics."""

import http.server
import json
import os
import signal
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request

import admitgate.broker

started: list[str] = []


class Agent(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
        started.append(body["message"]["parts"][0]["text"])
        time.sleep(0.5)  # the agent's run: an LLM call
        self.answer(b'{"ok": true}')

    def do_GET(self) -> None:  # the agent card, and the broker's readiness probe
        self.answer(b'{"name": "any-language agent"}')

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def send(url: str, text: str, priority: str | None, results: dict[str, str]) -> None:
    headers = {"content-type": "application/json"}
    if priority is not None:
        headers["x-priority"] = priority
    request = urllib.request.Request(
        url + "/message:send",
        data=json.dumps({"message": {"parts": [{"text": text}]}}).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            results[text] = f"{response.status}"
    except urllib.error.HTTPError as refused:
        info = json.load(refused)["error"]["details"][0]["metadata"]
        results[text] = f"{refused.code} {info['reason']} (class {info['priority']})"


def client(url: str, metrics: str) -> None:
    while True:
        try:
            urllib.request.urlopen(url + "/.well-known/agent-card.json", timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    results: dict[str, str] = {}
    threads = []
    for text, priority in [
        ("batch-1", "batch"),
        ("batch-2", "batch"),
        ("batch-3", "batch"),
        ("batch-4", "batch"),
        ("chat-1", "interactive"),
    ]:
        threads.append(threading.Thread(target=send, args=(url, text, priority, results)))
        threads[-1].start()
        time.sleep(0.05)  # in this order
    for thread in threads:
        thread.join()
    for text in sorted(results):
        print(f"{text}: {results[text]}")
    print("the agent ran:", ", ".join(started))
    send(url, "unnamed", None, results)
    send(url, "unknown", "urgent", results)
    with urllib.request.urlopen(metrics + "/metrics") as scrape:
        for line in scrape.read().decode().splitlines():
            if line.startswith(("broker_class_admitted_total", "broker_priority_defaulted")):
                print(line)
    os.kill(os.getpid(), signal.SIGTERM)  # drain, then stop


agent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Agent)
threading.Thread(target=agent.serve_forever, daemon=True).start()
listen, metrics_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
    # The same settings as flags: --priority interactive:min=0.5 --priority batch
    # --priority-from header:x-priority
    config.write(
        "priorities:\n"
        "  - {name: interactive, min_share: 0.5}\n"
        "  - batch\n"
        "priority_from: header:x-priority\n"
    )
threading.Thread(
    target=client, args=(f"http://{listen}", f"http://{metrics_listen}"), daemon=True
).start()
admitgate.broker.serve(
    upstream=f"http://127.0.0.1:{agent.server_address[1]}",
    listen=listen,
    metrics_listen=metrics_listen,
    max_in_flight=2,
    queue_depth=2,
    drain_timeout=5,
    config=config.name,
)
os.unlink(config.name)
print("broker drained and stopped")
agent.shutdown()
