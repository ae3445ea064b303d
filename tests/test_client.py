"""admitgate.client.RetryingTransport against a scripted server on loopback.

The server (raw ASGI on uvicorn, started once for the module) refuses the first ``refuse``
attempts of each request key with the status, ``Retry-After`` and body the query asks for,
then answers 200 with the attempt count and a digest of the body it received. The
middleware-end-to-end case (the A2A SDK's client through a saturated AdmissionMiddleware) is
in tests/test_asgi.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from email.utils import formatdate, parsedate_to_datetime
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
import pytest
from _a2a_app import ServerThread
from admitgate.client import RetryingTransport, _retry_after, is_admission_refusal
from conftest import run
from hypothesis import given, settings
from hypothesis import strategies as st

RPC_REFUSAL = {
    "jsonrpc": "2.0",
    "id": "1",
    "error": {"code": -32029, "message": "busy", "data": {"reason": "queue_full"}},
}
REST_REFUSAL = {
    "error": {
        "code": 429,
        "status": "RESOURCE_EXHAUSTED",
        "message": "busy",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "QUEUE_FULL",
                "domain": "admitgate",
                "metadata": {},
            }
        ],
    }
}
OTHER_ERROR = {"jsonrpc": "2.0", "id": "1", "error": {"code": -32001, "message": "not found"}}


class Scripted:
    """Refuses the first ``refuse`` attempts per ``key`` (query parameters), then says 200."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        key = query["key"]
        attempt = self.attempts[key] = self.attempts.get(key, 0) + 1
        if attempt <= int(query.get("refuse", "0")):
            payload = {"rpc": RPC_REFUSAL, "rest": REST_REFUSAL, "other": OTHER_ERROR}.get(
                query.get("marker", ""), {"plain": True}
            )
            content = json.dumps(payload).encode()
            if query.get("marker") == "deep":  # 16,000 nested arrays: json.loads recurses
                content = b"[" * 16_000
            headers = [(b"content-type", b"application/json")]
            if query.get("gzip"):
                content = gzip.compress(content)
                headers.append((b"content-encoding", b"gzip"))
            headers.append((b"content-length", str(len(content)).encode()))
            retry_after = query.get("ra")
            if retry_after == "date":
                retry_after = formatdate(time.time() + 1, usegmt=True)
            if retry_after is not None:
                headers.append((b"retry-after", retry_after.encode()))
            if "reason" in query:
                headers.append((b"admitgate-reason", query["reason"].encode()))
            status = int(query.get("status", "429"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        content = json.dumps(
            {"attempts": attempt, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": content})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """The scripted server on uvicorn, once for the module."""
    thread = ServerThread()
    thread.start(Scripted())
    yield thread
    thread.stop()


def url(server: ServerThread, **query: Any) -> str:
    query.setdefault("key", uuid.uuid4().hex)
    return f"{server.url}/x?" + "&".join(f"{k}={v}" for k, v in query.items())


async def call(
    transport: RetryingTransport, method: str, target: str, **kwargs: Any
) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport, timeout=10) as http:
        return await http.request(method, target, **kwargs)


def transport(**kwargs: Any) -> RetryingTransport:
    kwargs.setdefault("jitter", 0.0)
    return RetryingTransport(**kwargs)


def test_idempotent_requests_are_retried(server: ServerThread) -> None:
    async def main() -> None:
        for method in ("GET", "DELETE", "PUT"):
            t = transport()
            response = await call(t, method, url(server, refuse=2, ra=0))
            assert response.status_code == 200 and response.json()["attempts"] == 3
            assert t.retries == 2
        t = transport()
        response = await call(t, "GET", url(server, refuse=1, ra=0, status=503))
        assert response.status_code == 200 and t.retries == 1

    run(main())


def test_the_retry_after_delay_is_waited(server: ServerThread) -> None:
    async def main() -> None:
        t = transport()
        started = time.monotonic()
        response = await call(t, "GET", url(server, refuse=1, ra=1))
        elapsed = time.monotonic() - started
        assert response.json()["attempts"] == 2
        assert 1.0 <= elapsed < 3.0
        # An HTTP-date works too (one second ahead, at one-second resolution).
        t = transport()
        response = await call(t, "GET", url(server, refuse=1, ra="date"))
        assert response.json()["attempts"] == 2 and t.retries == 1
        # Without Retry-After there is no hint: the refusal is returned as is.
        t = transport()
        response = await call(t, "GET", url(server, refuse=1))
        assert response.status_code == 429 and t.retries == 0
        response = await call(t, "GET", url(server, refuse=1, ra="soon"))
        assert response.status_code == 429 and t.retries == 0

    run(main(), timeout=10)


def test_a_post_is_retried_only_when_admitgate_refused_it(server: ServerThread) -> None:
    body = {"jsonrpc": "2.0", "id": "1", "method": "SendMessage", "params": {"x": "y" * 1000}}
    sent = json.dumps(body).encode()

    async def main() -> None:
        for marker, status, zipped in (
            ("rpc", 429, ""),
            ("rest", 429, ""),
            ("rest", 503, ""),
            ("rpc", 429, "1"),
        ):
            t = transport()
            target = url(server, refuse=1, ra=0, marker=marker, status=status, gzip=zipped)
            response = await call(t, "POST", target, content=sent)
            assert response.status_code == 200, (marker, status)
            result = response.json()
            assert result["attempts"] == 2
            # The body was sent again, whole.
            assert result["size"] == len(sent)
            assert result["sha256"] == hashlib.sha256(sent).hexdigest()
        # The admitgate-reason header alone marks a refusal (no body read).
        t = transport()
        response = await call(t, "POST", url(server, refuse=1, ra=0, reason="shed"), content=sent)
        assert response.status_code == 200 and t.retries == 1
        for marker in ("", "other"):
            t = transport()
            response = await call(
                t, "POST", url(server, refuse=1, ra=0, marker=marker), content=sent
            )
            assert response.status_code == 429 and t.retries == 0
            assert response.json() in ({"plain": True}, OTHER_ERROR)

    run(main())


def test_a_streaming_upload_is_not_retried(server: ServerThread) -> None:
    async def upload() -> AsyncIterator[bytes]:
        yield b'{"jsonrpc": "2.0", '
        yield b'"method": "SendMessage", "id": 1}'

    async def main() -> None:
        t = transport()
        response = await call(
            t, "POST", url(server, refuse=1, ra=0, marker="rpc"), content=upload()
        )
        assert response.status_code == 429 and t.retries == 0
        assert response.json() == RPC_REFUSAL

    run(main())


def test_limits_max_retries_deadline_and_budget(server: ServerThread) -> None:
    async def main() -> None:
        t = transport(max_retries=2)
        response = await call(t, "GET", url(server, refuse=10, ra=0))
        assert response.status_code == 429 and t.retries == 2
        # A delay that would end past the deadline is not waited for.
        t = transport(deadline_s=1.0)
        started = time.monotonic()
        response = await call(t, "POST", url(server, refuse=1, ra=5, marker="rpc"), json={})
        assert time.monotonic() - started < 1.0
        assert response.status_code == 429 and t.retries == 0
        assert response.json() == RPC_REFUSAL  # inspected, and still readable
        # Budget: 0.5 retries per request, a reserve of 1.
        t = transport(retry_budget=0.5, budget_reserve=1)
        assert (await call(t, "GET", url(server, refuse=1, ra=0))).status_code == 200
        assert (await call(t, "GET", url(server, refuse=1, ra=0))).status_code == 429
        assert (await call(t, "GET", url(server, refuse=1, ra=0))).status_code == 200
        assert t.retries == 2
        # No budget at all.
        t = transport(retry_budget=None, budget_reserve=0)
        for _ in range(3):
            assert (await call(t, "GET", url(server, refuse=1, ra=0))).status_code == 200
        assert t.retries == 3
        # Other statuses are never retried.
        t = transport()
        assert (await call(t, "GET", url(server, refuse=1, status=500))).status_code == 500
        assert t.retries == 0

    run(main(), timeout=10)


def test_is_admission_refusal() -> None:
    assert is_admission_refusal(RPC_REFUSAL)
    assert is_admission_refusal(REST_REFUSAL)
    assert not is_admission_refusal(OTHER_ERROR)
    assert not is_admission_refusal({"jsonrpc": "2.0", "error": {"code": True}})
    assert not is_admission_refusal({"error": {"details": [{"domain": "admitgate"}]}})
    assert not is_admission_refusal([RPC_REFUSAL])
    assert not is_admission_refusal({"error": "busy"})


def test_arguments_are_validated() -> None:
    with pytest.raises(TypeError, match="wrapped"):
        RetryingTransport(object())  # type: ignore[arg-type]
    for name, bad in (
        ("max_retries", -1),
        ("max_retries", 1.5),
        ("max_retries", True),
        ("retry_budget", -0.1),
        ("retry_budget", math.nan),
        ("budget_reserve", -1),
        ("deadline_s", math.inf),
        ("deadline_s", -1),
        ("jitter", -0.5),
        ("jitter", 11),
        ("jitter", "1"),
    ):
        with pytest.raises(ValueError, match=name):
            RetryingTransport(**{name: bad})

    async def close() -> None:
        await RetryingTransport(httpx.AsyncHTTPTransport()).aclose()

    run(close())


# -- Retry-After from a hostile server -----------------------------------------------------


def test_an_unusable_retry_after_returns_the_refusal(server: ServerThread) -> None:
    """Issue 15: ``"²".isdigit()`` is true and ``float("²")`` raises; the transport crashed.
    A hint that is not ASCII digits or an HTTP date is no hint: the refusal comes back."""

    async def main() -> None:
        for hint in ("²", "٣", "1e999", "-1", "9" * 5000, "Fri, 31 Dec 99999 23:59:59 GMT"):
            t = transport()
            response = await call(t, "GET", url(server, refuse=1, ra=quote(hint)))
            assert response.status_code == 429 and t.retries == 0, hint
            assert response.json() == {"plain": True}

    run(main(), timeout=10)


_HEADER_TEXT = st.text(
    st.characters(codec="latin-1", exclude_characters="\r\n\x00"), max_size=40
) | st.sampled_from(
    [
        "²",
        "١٢",
        "٣",
        "𝟗",
        "1e999",
        "1E3",
        "inf",
        "nan",
        "-0",
        "-1",
        "+5",
        "0x10",
        "1_000",
        "1.5",
        " 7 ",
        "\t3\t",
        "9" * 5000,
        "9" * 400,
        "",
        " ",
        "Thu, 01 Jan 1970 00:00:00 GMT",
        "Mon, 01 Jan 0001 00:00:00 GMT",
        "Fri, 31 Dec 9999 23:59:59 GMT",
        "Fri, 31 Dec 10000 23:59:59 GMT",
        "Fri, 31 Dec 99999999999999999999 23:59:59 GMT",
        "Fri, 31 Dec 2100 99:99:99 GMT",
        "Sun, 06 Nov 1994 08:49:37 +99999999999",
        "Sun, 06 Nov 1994 08:49:37",
        "Sunday, 06-Nov-94 08:49:37 GMT",
        "Sun Nov  6 08:49:37 1994",
        "Sun, 06 Nov 1994 08:49:37 GMT" + " x" * 3000,
        ", " * 3000,
    ]
)


_HTTP_DATES = st.builds(
    lambda day, month, year, h, m, sec, zone, weekday: (
        f"{weekday}, {day:02d} {month} {year} {h:02d}:{m:02d}:{sec:02d} {zone}".strip()
    ),
    st.integers(0, 40),
    st.sampled_from("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec Foo".split()),
    st.integers(0, 10**21),
    st.integers(0, 99),
    st.integers(0, 99),
    st.integers(0, 99),
    st.sampled_from(["GMT", "UTC", "+0000", "-2359", "+9999", "-99999999", "EST", "", "Z"]),
    st.sampled_from(["Mon", "Sun", "Xyz", ""]),
)


@given(hint=_HEADER_TEXT | _HTTP_DATES | st.text(max_size=80))
@settings(max_examples=300, deadline=None)
def test_any_retry_after_is_parsed_quickly_or_refused(hint: str) -> None:
    """Every header value gives a finite delay >= 0 or no hint, in well under a few ms of
    this thread's CPU time (measured worst over 6000 values: 0.12 ms); a
    delay is given only for ASCII digits or an HTTP date with a time zone. Through the
    transport, an unusable hint returns the refusal as it is."""
    response = httpx.Response(429, headers={b"retry-after": hint.encode()})
    started = time.thread_time()
    delay = _retry_after(response)
    elapsed = time.thread_time() - started
    assert elapsed < 0.005, (hint[:40], elapsed)
    stripped = response.headers["retry-after"].strip()
    if delay is not None:
        assert math.isfinite(delay) and delay >= 0.0
        assert (stripped.isascii() and stripped.isdigit()) or parsedate_to_datetime(stripped)
    if stripped.isascii() and stripped.isdigit() and len(stripped) <= 10:
        assert delay == int(stripped)

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={b"retry-after": hint.encode()}, content=b"no")

    async def main() -> None:
        t = RetryingTransport(httpx.MockTransport(refuse), deadline_s=0.0, max_retries=1)
        response = await call(t, "GET", "http://127.0.0.1:9/x")
        assert response.status_code == 429 and t.retries == 0
        assert response.content == b"no"

    run(main())


def test_a_deeply_nested_refusal_body_is_returned_as_is(server: ServerThread) -> None:
    """A small body (under 16 KiB) of 16,000 nested arrays: json.loads raised RecursionError
    (not ValueError) out of the transport. Not JSON it can use: the refusal comes back."""

    async def main() -> None:
        t = transport()
        response = await call(t, "POST", url(server, refuse=1, ra=0, marker="deep"), content=b"{}")
        assert response.status_code == 429 and t.retries == 0
        assert response.content == b"[" * 16_000

    run(main())


def test_a_hostile_content_length_is_not_read() -> None:
    """A refusal of a POST with a Content-Length of unicode or huge digits is returned as it
    is (its body is not inspected), not raised."""

    def refuse_with(length: str) -> Any:
        def refuse(request: httpx.Request) -> httpx.Response:
            return httpx.Response(
                429,
                headers={b"retry-after": b"0", b"content-length": length.encode()},
                content=json.dumps(RPC_REFUSAL).encode(),
            )

        return refuse

    async def main() -> None:
        for length in ("²", "٣", "9" * 5000):
            t = transport(wrapped=httpx.MockTransport(refuse_with(length)))
            response = await call(t, "POST", "http://127.0.0.1:9/x", content=b"{}")
            assert response.status_code == 429 and t.retries == 0, length

    run(main())
