"""Budgets at the broker: 3 requests per minute per API key, and 1,000 tokens per minute,
for an agent that reports what each run used in the admitgate-usage-tokens response header.

The agent is a plain HTTP server from the standard library (any language would do). Each run
"uses" 500 tokens and says so; the broker reserves 100 per request (cost=100) and settles
each to the reported 500, so key-a's third request is refused by the token budget (1,000
used), although the request budget still had room; key-b has budgets of its own. Refusals are 429 rate_limited
with the exact Retry-After and the RateLimit fields of the IETF draft; the usage header
never reaches the client."""

import http.server
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import admitgate.broker


class Agent(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.answer(b'{"answer": "done"}', usage="500")  # what the LLM said it used

    def do_GET(self) -> None:  # the broker's readiness probe and the agent card
        self.answer(b'{"name": "budgeted agent"}')

    def answer(self, body: bytes, usage: str | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if usage is not None:
            self.send_header("admitgate-usage-tokens", usage)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def send(url: str, api_key: str) -> str:
    request = urllib.request.Request(
        url + "/message:send",
        data=json.dumps({"message": {"parts": [{"text": "hello"}]}}).encode(),
        headers={"content-type": "application/json", "x-api-key": api_key},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            usage = response.headers.get("admitgate-usage-tokens", "not shown")
            return f"{api_key}: {response.status} (usage header: {usage})"
    except urllib.error.HTTPError as refused:
        h = refused.headers
        policies.append(h["ratelimit-policy"])
        return f"{api_key}: {refused.code} {h['admitgate-reason']}, Retry-After {h['retry-after']}, RateLimit {h['ratelimit']}"


policies: list[str] = []


def client(url: str) -> None:
    while True:
        try:
            urllib.request.urlopen(url + "/.well-known/agent-card.json", timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    for api_key in ["key-a", "key-a", "key-a", "key-b"]:
        print(send(url, api_key))
    print("RateLimit-Policy:", policies[0])
    os.kill(os.getpid(), signal.SIGTERM)  # drain, then stop


agent = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Agent)
threading.Thread(target=agent.serve_forever, daemon=True).start()
listen = f"127.0.0.1:{free_port()}"
threading.Thread(target=client, args=(f"http://{listen}",), daemon=True).start()

admitgate.broker.serve(
    upstream=f"http://127.0.0.1:{agent.server_address[1]}",
    listen=listen,
    max_in_flight=8,
    rate_limit="requests=3/min,tokens=1000/min,cost=100",
    rate_key="header:x-api-key",
    drain_timeout=5,
)
print("broker drained and stopped")
agent.shutdown()
