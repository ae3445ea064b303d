"""No Redis password ever shows: not in an error, a repr, a stat, a log record, nor in what
``check-config`` prints, whatever the password holds (``/ ? # @ : %``, escapes, non-ASCII) and
whether the URL around it is valid or not.

Passwords are drawn from the URL alphabet with a ``Q`` at least every fourth character, and
nothing else these tests show holds a ``Q``: so text without a ``Q`` shows no four characters
of the password, as written or percent-decoded (a ``Q`` is never escaped). The Rust redaction
itself has the same property test in ``crates/fleet/src/config.rs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import quote

import admitgate
import pytest
from admitgate import config
from conftest import run
from fleet_support import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MARK = "Q"
_PIECES = st.sampled_from(
    ["/", "?", "#", "@", ":", "%", "%2F", "%40", "%3", "%%", "+", "=", "&", "a", "z", "0", "9"]
    + [".", "-", "_", "~", "!", "$", "'", "(", ")", "*", ",", ";", "[", "]", " ", "é", "€"]
    + ["//", "://", "@@", "\\", "\t"]
)


@st.composite
def passwords(draw: st.DrawFn) -> str:
    """``Q``, then up to 12 groups of 0 to 3 pieces of the URL alphabet, each ended by ``Q``."""
    groups = draw(st.lists(st.lists(_PIECES, max_size=3), max_size=12))
    return MARK + "".join("".join(group) + MARK for group in groups)


def urls(password: str, port: int = 6379) -> list[str]:
    """The password in URLs that parse and in ones that do not."""
    encoded = quote(password, safe="")
    token = password.replace(":", "")  # a lone token: a colon would make it user:password
    return [
        f"redis://admin:{encoded}@127.0.0.1:{port}/0",  # valid: the careful user
        f"redis://:{encoded}@127.0.0.1:{port}",
        f"redis://{quote(token, safe='')}@127.0.0.1:{port}",
        f"redis://admin:{password}@127.0.0.1:{port}/0",  # as typed: may not parse
        f"rediss://admin:{password}@127.0.0.1:{port}",
        f"redis://{token}@127.0.0.1:{port}",
        f"redis://admin:{password.replace('@', '')}",  # no host
        f"redis:/admin:{password}@127.0.0.1",
        f"http://admin:{password}@127.0.0.1",
        f"redis://admin:{password}@127.0.0.1:{port}/0?protocol=resp3",
        # Sentinel and Cluster: several hosts after the user-info.
        f"redis+sentinel://admin:{encoded}@127.0.0.1:{port},127.0.0.1:{port + 1}/mymaster/0",
        f"rediss+sentinel://admin:{password}@127.0.0.1:{port}/mymaster",
        f"redis+cluster://:{encoded}@127.0.0.1:{port},127.0.0.1:{port + 1}",
        f"rediss+cluster://admin:{password}@127.0.0.1:{port},127.0.0.1:{port + 1}",
        f"redis+cluster://{token}@127.0.0.1:{port}",
    ]


def assert_hidden(*shown: object) -> None:
    for text in shown:
        assert MARK not in str(text), text


def fleet_limit(url: str, **kwargs: Any) -> admitgate.FleetLimit:
    return admitgate.FleetLimit(url, "secret-test", 4, replica_id="r-1", **kwargs)


@given(password=passwords())
@settings(max_examples=40, deadline=None)
def test_no_password_in_errors_reprs_or_stats(password: str) -> None:
    for url in urls(password):
        try:
            limit = fleet_limit(url)
        except ValueError as exc:
            assert_hidden(exc, repr(exc))
            continue
        assert_hidden(repr(limit), str(limit), limit.url, json.dumps(limit.stats()))
        gate = admitgate.build_admission_gate(max_concurrent_runs=2, fleet=limit)
        assert gate is not None
        assert_hidden(repr(gate), repr(gate.fleet), json.dumps(gate.stats(), default=str))
    # Valid settings with one bad one: the message names that one, never the URL's password.
    encoded = urls(password)[0]
    with pytest.raises(ValueError, match="^max_in_flight_per_scope ") as caught:
        admitgate.FleetLimit(encoded, "k", 4, max_in_flight_per_scope=5)
    assert_hidden(caught.value)
    with pytest.raises(ValueError, match="^tls_ca_file ") as caught:
        admitgate.FleetLimit(encoded, "k", 4, tls_ca_file="/nonexistent/ca.pem")
    assert_hidden(caught.value)


def test_the_reported_password_with_a_slash() -> None:
    """Issue 15: ``'redis://:Zm9v/YmFy+cXV4@127.0.0.1:6379/0'`` came back whole in the error."""
    with pytest.raises(ValueError, match=r"^url has an @ after a /, \? or #") as caught:
        fleet_limit("redis://:Zm9v/YmFy+cXV4@127.0.0.1:6379/0")
    message = str(caught.value)
    for piece in ("Zm9v", "YmFy", "cXV4"):
        assert piece not in message, message
    assert "percent-encode" in message and "not shown" in message
    limit = fleet_limit("redis://:Zm9v%2FYmFy%2BcXV4@127.0.0.1:6379/0")
    assert limit.url == "redis://:***@127.0.0.1:6379/0"


def test_an_unescaped_delimiter_before_the_last_at_is_refused() -> None:
    """``redis://tok?en@h`` parses with host ``tok`` and no password: the driver would dial
    (and print) a piece of the token. An @ after a / ? or # is refused with the fix."""
    for url in ("redis://tok?en@127.0.0.1", "redis://admin:pa/ss@127.0.0.1:6379/0"):
        with pytest.raises(ValueError, match=r"^url has an @ after a /, \? or #") as caught:
            fleet_limit(url)
        assert "tok" not in str(caught.value) and "pa/ss" not in str(caught.value)
        assert "percent-encode" in str(caught.value)


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    out = []
    for rec in caplog.records:
        if rec.name.startswith("admitgate"):
            out += [rec.getMessage(), repr(rec.args), repr(rec.__dict__)]
    return out


@given(password=passwords())
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_no_password_in_the_logs_of_an_unreachable_redis(
    password: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A closed loopback port: the limit admits locally and logs the outage."""
    caplog.set_level(logging.DEBUG, logger="admitgate")
    caplog.clear()
    port = free_port()
    limit = fleet_limit(
        f"redis://admin:{quote(password, safe='')}@127.0.0.1:{port}/0",
        connect_timeout_s=0.2,
        command_timeout_s=0.2,
        lease_ttl_s=1.0,
    )

    async def scenario() -> None:
        lease = await asyncio.wait_for(limit.acquire(), 5)
        assert limit.stats()["fleet_backend_up"] == 0
        for _ in range(100):
            if any("unreachable" in m for m in _records(caplog)):
                break
            await asyncio.sleep(0.02)
        await lease.release()
        await limit.shutdown()

    run(scenario(), timeout=10)
    records = _records(caplog)
    assert any("unreachable" in m for m in records), records
    assert_hidden(*records, json.dumps(limit.stats()), repr(limit))


def test_no_password_in_the_logs_of_a_refused_login(
    redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A real redis-server without a password refuses AUTH: the driver's error is logged
    without the password, as written or decoded."""
    caplog.set_level(logging.DEBUG, logger="admitgate")
    password = "Q/x?Q#y@Q%41Q:Q"
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    limit = fleet_limit(
        f"redis://admin:{quote(password, safe='')}@127.0.0.1:{port}/0",
        connect_timeout_s=0.5,
        command_timeout_s=0.5,
    )

    async def scenario() -> None:
        lease = await asyncio.wait_for(limit.acquire(), 5)
        for _ in range(100):
            if _records(caplog):
                break
            await asyncio.sleep(0.02)
        await lease.release()
        await limit.shutdown()

    run(scenario(), timeout=10)
    records = _records(caplog)
    assert any("unreachable" in m for m in records), records
    assert_hidden(*records, json.dumps(limit.stats()))


_CONFIG_TEXTS = (
    "gateway:\n  max_concurrent_runs: {url}\n",
    "max_concurrent_runs: {url}\nqueue_depth: 4\n",
    "overflow_policy: {url}\n",
    "max_rss_mb: [{url}, {{{url}: {url}}}]\n",
    "fleet_url: {url}\nmax_concurrent_runs: 4\n",
)


@given(
    password=passwords(),
    shape=st.integers(0, len(urls("Q")) - 1),
    text=st.sampled_from(_CONFIG_TEXTS),
)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_check_config_never_prints_a_password(
    password: str, shape: int, text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gateway YAML naming a Redis URL: as a setting's (invalid) value, inside a list or
    mapping, and under a key check-config does not read; text and JSON reports."""
    path = tmp_path / "gateway.yaml"
    path.write_text(text.format(url=json.dumps(urls(password)[shape])))  # YAML double-quoted
    for flags in ([], ["--json"]):
        code = config.main([str(path), *flags])
        out = capsys.readouterr()
        assert code in (config.EXIT_OK, config.EXIT_INVALID), (text, out)
        assert_hidden(out.out, out.err)
    try:
        config.load(path)
    except config.ConfigError as exc:
        assert_hidden(exc, *(p.describe(str(path)) for p in exc.problems))
