"""The broker in front of an agent it knows nothing about, run inside this Python process with
admitgate.broker.serve(). The agent here is a plain HTTP server from the standard library (it
could be written in any language): its `POST /message:send` takes half a second, as an LLM run
would. The broker caps it at 2 runs at once with no queue, so of 5 sends at once 2 run and 3 are
refused with 429 and a Retry-After; the agent card passes through untouched. A SIGTERM then
drains the broker and serve() returns."""

import http.server
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import admitgate.broker


class Agent(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        time.sleep(0.5)  # the agent's run: an LLM call
        self.answer(json.dumps({"echo": json.loads(body or b"{}")}).encode())

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


def send(url: str, n: int) -> str:
    request = urllib.request.Request(
        url + "/message:send",
        data=json.dumps({"message": {"parts": [{"text": f"hello {n}"}]}}).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return f"{response.status} from the agent"
    except urllib.error.HTTPError as refused:
        return f"{refused.code} {refused.headers['admitgate-reason']}, retry after {refused.headers['retry-after']} s"


def client(url: str) -> None:
    """Waits for the broker, sends 5 at once, reads the card, then stops the broker."""
    while True:
        try:
            urllib.request.urlopen(url + "/.well-known/agent-card.json", timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    with ThreadPoolExecutor(5) as pool:
        for answer in sorted(pool.map(lambda n: send(url, n), range(5))):
            print(answer)
    with urllib.request.urlopen(url + "/.well-known/agent-card.json") as card:
        print("agent card:", json.load(card)["name"])
    os.kill(os.getpid(), signal.SIGTERM)  # what an orchestrator sends: drain, then stop


agent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Agent)
threading.Thread(target=agent.serve_forever, daemon=True).start()
listen = f"127.0.0.1:{free_port()}"
threading.Thread(target=client, args=(f"http://{listen}",), daemon=True).start()

# Blocks with the GIL released (the threads above keep running); SIGTERM drains and returns.
admitgate.broker.serve(
    upstream=f"http://127.0.0.1:{agent.server_address[1]}",
    listen=listen,
    max_in_flight=2,
    queue_depth=0,
    drain_timeout=5,
)
print("broker drained and stopped")
agent.shutdown()
