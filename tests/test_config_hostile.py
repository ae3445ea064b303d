"""``admitgate.config.load`` and ``check-config`` on hostile YAML: every bad file ends with a
:class:`admitgate.config.ConfigError` (exit 2) that names the problem, in bounded time, with a
bounded message.

Time is the CPU time of the loading thread (``time.thread_time``), so a busy machine does not
fail the bound; the bound is a second, and the measured worst case is a few tenths of that.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from admitgate import config
from admitgate.config.document import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, MAX_NUMBER_CHARS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BOUND_S = 1.0
# The longest message a refusal may print: the path, a line, the bound or a cut value.
MESSAGE_CHARS = 600


def alias_bomb(levels: int, fan: int, target: str = "max_concurrent_runs") -> str:
    """A "billion laughs": each level a list of ``fan`` aliases of the level below."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fan)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]")
    lines.append(f"{target}: *l{levels - 1}")
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int, fan: int) -> str:
    """The same with merge keys: each mapping merges ``fan`` copies of the one below."""
    keys = ", ".join(f"k{i}: {i}" for i in range(fan))
    lines = [f"m0: &m0 {{{keys}}}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * fan)}]}}")
    return "\n".join(lines) + "\nmax_concurrent_runs: 4\n"


# name -> (file text, a fragment the message must hold)
HOSTILE: dict[str, tuple[str, str]] = {
    "alias bomb as a value": (alias_bomb(9, 9), f"more than {MAX_NODES} values"),
    "alias bomb elsewhere": (
        alias_bomb(9, 9, "agents") + "max_concurrent_runs: 4\n",
        f"more than {MAX_NODES} values",
    ),
    "merge-key bomb": (merge_bomb(9, 9), f"more than {MAX_NODES} values"),
    "50,000-deep flow lists": (
        "max_concurrent_runs: " + "[" * 50_000 + "]" * 50_000 + "\n",
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    "30,000-deep block lists": (
        "max_concurrent_runs:\n" + "- " * 30_000 + "1\n",
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    "20,000-deep flow mappings": (
        "gateway: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
        f"nested deeper than {MAX_DEPTH} levels",
    ),
    "5,000-digit count": (
        "gateway:\n  max_concurrent_runs: " + "9" * 5000 + "\n",
        "a number written with 5000 characters",
    ),
    "5,000-digit number elsewhere": (
        "agents: " + "9" * 5000 + "\nmax_concurrent_runs: 4\n",
        "a number written with 5000 characters",
    ),
    "base-60 integer of 40,000 places": (
        "max_concurrent_runs: " + "1:" * 40_000 + "0\n",
        f"(at most {MAX_NUMBER_CHARS})",
    ),
    "5,000-digit float": ("max_rss_mb: " + "9" * 5000 + ".5\n", "a number written with"),
    "200,000-character string": (
        "queue_depth: '" + "a" * 200_000 + "'\n",
        "not a string of 200000 characters",
    ),
    "a file past the size bound": (
        "# " + "x" * MAX_FILE_BYTES + "\nmax_concurrent_runs: 1\n",
        f"larger than {MAX_FILE_BYTES // 1024} KiB",
    ),
    "3,000 duplicate keys": (
        "max_concurrent_runs: 1\n" * 3_000,
        f"more than {MAX_NODES} values",
    ),
    "a recursive alias as a value": (
        "max_concurrent_runs: &a [*a, *a]\n",
        "must be an integer, not a list",
    ),
    "an undefined alias with a 100,000-character name": (
        "max_concurrent_runs: *" + "x" * 100_000 + "\n",
        "not valid YAML: found undefined alias",
    ),
    "a control character (the reader refused it before the loader's try)": (
        "max_concurrent_runs: 4\x08\n",
        "not valid YAML: unacceptable character #x0008",
    ),
    "a small alias bomb, under the bounds, as a value": (
        alias_bomb(4, 6),
        "must be an integer, not a list",
    ),
}


def timed_load(path: Path) -> tuple[float, config.ConfigError | None]:
    """Loads ``path``; returns the thread's CPU seconds and the ConfigError, if any."""
    started = time.thread_time()
    try:
        config.load(path)
    except config.ConfigError as exc:
        return time.thread_time() - started, exc
    return time.thread_time() - started, None


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_is_refused_promptly_with_a_short_message(tmp_path: Path, name: str) -> None:
    text, fragment = HOSTILE[name]
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    elapsed, error = timed_load(path)
    assert error is not None, name
    message = str(error)
    assert fragment in message, message[:MESSAGE_CHARS]
    assert message.startswith(str(path)), message[:MESSAGE_CHARS]
    assert len(message) < MESSAGE_CHARS, message[:MESSAGE_CHARS]
    assert elapsed < BOUND_S, (name, elapsed)


def test_check_config_exits_2_on_each_hostile_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (an uncaught exception would escape ``main``); JSON for a few."""
    for i, (name, (text, fragment)) in enumerate(HOSTILE.items()):
        path = tmp_path / "gateway.yaml"
        path.write_text(text)
        assert config.main([str(path)]) == config.EXIT_INVALID, name
        err = capsys.readouterr().err
        assert fragment in err and len(err) < MESSAGE_CHARS + 20, err[:MESSAGE_CHARS]
        if i % 8 == 0:
            assert config.main([str(path), "--json"]) == config.EXIT_INVALID, name
            assert len(capsys.readouterr().out) < 4 * MESSAGE_CHARS


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("alias bomb as a value", "more than"),
        ("50,000-deep flow lists", "nested deeper"),
        ("5,000-digit count", "a number written with 5000 characters"),
    ],
)
def test_the_command_line_exits_2_on_the_reported_files(
    tmp_path: Path, name: str, fragment: str
) -> None:
    """The three files of issue 15 through ``python -m admitgate check-config``: they hung
    past 20 s, or exited 1 with a traceback (RecursionError, ValueError)."""
    path = tmp_path / "gateway.yaml"
    path.write_text(HOSTILE[name][0])
    run = subprocess.run(
        [sys.executable, "-m", "admitgate", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("check-config: ") and fragment in run.stderr
    assert "Traceback" not in run.stderr


@st.composite
def hostile_documents(draw: st.DrawFn) -> str:
    """A gateway file with a setting (or an unrelated key) written in an adversarial shape."""
    key = draw(st.sampled_from(["max_concurrent_runs", "queue_depth", "max_rss_mb", "agents"]))
    kind = draw(
        st.sampled_from(["bomb", "merge", "flow", "block", "mapping", "number", "string", "dups"])
    )
    n = draw(st.integers(1, 6))
    if kind == "bomb":
        body = alias_bomb(draw(st.integers(2, 12)), draw(st.integers(1, 12)), key)
    elif kind == "merge":
        body = merge_bomb(draw(st.integers(2, 10)), draw(st.integers(1, 10)))
    elif kind == "flow":
        depth = draw(st.integers(1, 20_000))
        body = f"{key}: " + "[" * depth + "]" * depth + "\n"
    elif kind == "block":
        body = f"{key}:\n" + "- " * draw(st.integers(1, 20_000)) + "1\n"
    elif kind == "mapping":
        depth = draw(st.integers(1, 5_000))
        body = f"{key}: " + "{a: " * depth + "1" + "}" * depth + "\n"
    elif kind == "number":
        digits = "9" * draw(st.integers(1, 6000))
        body = f"{key}: " + draw(
            st.sampled_from([digits, f"-{digits}", f"{digits}.5", f"{digits}e9", "1:" * n * 999])
        )
        body += "\n"
    elif kind == "string":
        body = f"{key}: '" + "a" * draw(st.integers(0, 150_000)) + "'\n"
    else:
        body = f"{key}: 1\n" * draw(st.integers(1, 4_000))
    return body * (1 if kind in ("bomb", "merge") else min(n, 2))


@given(text=hostile_documents())
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_any_adversarial_shape_loads_or_is_refused_promptly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    elapsed, error = timed_load(path)
    assert elapsed < BOUND_S, (text[:200], elapsed)
    if error is not None:
        assert len(str(error)) < MESSAGE_CHARS, str(error)[:MESSAGE_CHARS]
        assert str(error).startswith(str(path))


_YAMLISH = st.text(
    st.sampled_from(list("[]{}:,-?&*!|>'\"#%@ \t\n.0123456789abkeymaxq_<=~\\")) | st.characters(),
    max_size=400,
)


@given(text=_YAMLISH)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_any_text_loads_or_raises_the_config_error(tmp_path: Path, text: str) -> None:
    """Fuzz: whatever the bytes, the loader returns settings or raises ConfigError, nothing
    else (a YAML library error, ValueError, RecursionError, TypeError...)."""
    path = tmp_path / "gateway.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    elapsed, error = timed_load(path)
    assert elapsed < BOUND_S
    if error is not None:
        assert len(str(error)) < MESSAGE_CHARS, str(error)[:MESSAGE_CHARS]
