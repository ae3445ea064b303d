"""Priority classes and fair queuing through the Python API: construction and validation,
``admit(priority=...)`` / ``admit_sync(priority=...)``, ``stats()["classes"]``,
``AdmissionRejected.priority``, ``reconfigure``, and bursts far past the cap."""

from __future__ import annotations

import asyncio
import threading
import time

import admitgate
import pytest
from admitgate import PriorityClass
from conftest import run, settle

CLASSES = [PriorityClass("interactive", min_share=0.5), PriorityClass("batch", min_share=0.2)]
KEYS = ("in_flight", "queued", "admitted", "rejected", "shed", "cancelled")


def gate(**kwargs):
    kwargs.setdefault("max_concurrent_runs", 2)
    kwargs.setdefault("queue_depth", 10)
    return admitgate.build_admission_gate(priorities=CLASSES, **kwargs)


def adds_up(stats: dict) -> None:
    classes = stats["classes"]
    for key in KEYS:
        assert stats[key] == sum(c[key] for c in classes.values()), key


# -- construction and validation -----------------------------------------------------------


def test_priority_class_checks_its_own_arguments():
    assert PriorityClass("a") == PriorityClass("a", min_share=0.0, max_share=1.0)
    with pytest.raises(ValueError, match=r"min_share must be a number from 0 to 1, got 1\.5"):
        PriorityClass("a", min_share=1.5)
    with pytest.raises(TypeError, match=r"max_share must be a number from 0 to 1, got '1'"):
        PriorityClass("a", max_share="1")
    with pytest.raises(TypeError, match="got True"):
        PriorityClass("a", min_share=True)
    with pytest.raises(ValueError, match=r"min_share \(0\.6\) of priority class 'a' must be <="):
        PriorityClass("a", min_share=0.6, max_share=0.5)
    with pytest.raises(ValueError, match="non-empty str, got ''"):
        PriorityClass("")
    with pytest.raises(TypeError, match="non-empty str, got 3"):
        PriorityClass(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("classes", "kwargs", "message"),
    [
        (
            [PriorityClass("a", min_share=0.6), PriorityClass("b", min_share=0.5)],
            {},
            r"min_share values sum to 1\.1",
        ),
        ([PriorityClass("a"), PriorityClass("a")], {}, "names the class 'a' twice"),
        ([], {}, "at least one class"),
        (
            CLASSES,
            {"default_priority": "vip"},
            r"default_priority 'vip' is not a priority class; known: 'interactive', 'batch'",
        ),
        (
            CLASSES,
            {"fairness": "fifo"},
            r"fairness must be one of \('tenant', 'none'\) or None, got 'fifo'",
        ),
        (CLASSES, {"tenant_weights": {"a": 0}}, r"tenant_weights\['a'\] must be a whole number"),
    ],
)
def test_bad_priorities_are_refused_with_a_clear_message(classes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        admitgate.build_admission_gate(max_concurrent_runs=2, priorities=classes, **kwargs)


def test_rounding_is_forgiven_and_types_are_checked():
    thirds = [PriorityClass(n, min_share=0.1) for n in "abc"] + [PriorityClass("d", min_share=0.7)]
    assert admitgate.build_admission_gate(max_concurrent_runs=4, priorities=thirds) is not None
    with pytest.raises(TypeError, match="list of admitgate.PriorityClass, got 'abc'"):
        admitgate.build_admission_gate(max_concurrent_runs=2, priorities="abc")
    with pytest.raises(TypeError, match="must hold admitgate.PriorityClass values, got 'a'"):
        admitgate.build_admission_gate(max_concurrent_runs=2, priorities=["a"])
    with pytest.raises(ValueError, match="default_priority='x' needs priorities"):
        admitgate.build_admission_gate(max_concurrent_runs=2, default_priority="x")


def test_unknown_priority_raises_from_admit_naming_it_and_the_known_ones():
    g = gate()
    with pytest.raises(ValueError, match=r"unknown priority 'vip'; known: 'interactive', 'batch'"):
        g.admit(priority="vip")
    with pytest.raises(ValueError, match="unknown priority 'vip'"):
        g.admit_sync(priority="vip")
    with pytest.raises(TypeError, match="priority must be a str"):
        g.admit(priority=1)
    plain = admitgate.build_admission_gate(max_concurrent_runs=2)
    with pytest.raises(ValueError, match="priority='interactive' given, but this gate has no"):
        plain.admit(priority="interactive")
    assert "classes" not in plain.stats()


# -- order, shares and shedding ------------------------------------------------------------


def test_interactive_goes_first_and_batch_keeps_its_guarantee():
    # Capacity 4: interactive guaranteed 2, batch 1 (0.2 * 4 rounds down to 0, at least 1).
    g = gate(max_concurrent_runs=4, queue_depth=50)
    order: list[str] = []

    async def main():
        release = asyncio.Event()

        async def turn(priority: str, tag: str):
            async with g.admit(session_id=tag, priority=priority):
                order.append(tag)
                await release.wait()

        tasks = [asyncio.create_task(turn("batch", f"b{i}")) for i in range(4)]
        await settle()
        assert order == ["b0", "b1", "b2", "b3"], "idle interactive lends its share"
        tasks += [asyncio.create_task(turn("batch", f"b{i}")) for i in range(4, 6)]
        tasks += [asyncio.create_task(turn("interactive", f"i{i}")) for i in range(3)]
        await settle()
        stats = g.stats()
        assert stats["classes"]["interactive"]["queued"] == 3
        adds_up(stats)
        release.set()
        await asyncio.gather(*tasks)

    run(main())
    # Each release went to interactive first (below its guarantee, then by priority).
    assert order[4:7] == ["i0", "i1", "i2"]
    stats = g.stats()
    adds_up(stats)
    assert stats["classes"]["interactive"]["admitted"] == 3
    assert stats["classes"]["batch"]["admitted"] == 6


def test_a_full_queue_sheds_batch_for_interactive_and_the_refusal_names_the_class():
    g = gate(max_concurrent_runs=1, queue_depth=2)

    async def main():
        release = asyncio.Event()
        outcomes: dict[str, str] = {}

        async def turn(priority: str, tag: str):
            try:
                async with g.admit(priority=priority):
                    outcomes[tag] = "ran"
                    await release.wait()
            except admitgate.AdmissionRejected as exc:
                outcomes[tag] = f"{exc.reason}:{exc.priority}"

        tasks = [asyncio.create_task(turn("batch", f"b{i}")) for i in range(3)]
        await settle()
        tasks.append(asyncio.create_task(turn("interactive", "i0")))
        await settle()
        assert outcomes == {"b0": "ran", "b1": "shed:batch"}
        tasks.append(asyncio.create_task(turn("batch", "b3")))
        await settle()
        assert outcomes["b3"] == "queue_full:batch", "a batch newcomer never evicts interactive"
        release.set()
        await asyncio.gather(*tasks)
        return outcomes

    outcomes = run(main())
    assert outcomes["i0"] == "ran" and outcomes["b2"] == "ran"
    stats = g.stats()
    adds_up(stats)
    assert stats["classes"]["batch"]["shed"] == 1
    assert stats["classes"]["batch"]["rejected"] == 1


def test_max_share_caps_a_class_even_with_slots_free():
    g = admitgate.build_admission_gate(
        max_concurrent_runs=4,
        queue_depth=10,
        priorities=[PriorityClass("hi"), PriorityClass("lo", max_share=0.25)],
    )

    async def main():
        release = asyncio.Event()

        async def turn(priority):
            async with g.admit(priority=priority):
                await release.wait()

        tasks = [asyncio.create_task(turn("lo")) for _ in range(3)]
        await settle()
        assert g.stats()["classes"]["lo"] == {
            "in_flight": 1,
            "queued": 2,
            "admitted": 1,
            "rejected": 0,
            "shed": 0,
            "cancelled": 0,
        }
        tasks += [asyncio.create_task(turn("hi")) for _ in range(3)]
        await settle()
        assert g.in_flight == 4
        release.set()
        await asyncio.gather(*tasks)

    run(main())
    adds_up(g.stats())


def test_fair_queuing_lets_a_quiet_tenant_past_a_noisy_burst():
    g = admitgate.build_admission_gate(max_concurrent_runs=1, queue_depth=100, fairness="tenant")
    order: list[str] = []

    async def main():
        gate_open = asyncio.Event()

        async def turn(tenant):
            async with g.admit(session_id=tenant):
                order.append(tenant)
                await gate_open.wait()

        first = asyncio.create_task(turn("noisy"))
        await settle()
        tasks = [asyncio.create_task(turn("noisy")) for _ in range(20)]
        tasks += [asyncio.create_task(turn("quiet")) for _ in range(2)]
        await settle()
        gate_open.set()
        await asyncio.gather(first, *tasks)

    run(main())
    # The noisy tenant already runs one turn: the quiet one goes next, then they alternate.
    assert order[:6] == ["noisy", "quiet", "noisy", "quiet", "noisy", "noisy"]


def test_admit_sync_takes_a_priority_and_shares_the_order():
    g = gate(max_concurrent_runs=1)
    done: list[str] = []
    hold = threading.Event()

    def turn(priority, tag):
        with g.admit_sync(priority=priority, timeout=10):
            done.append(tag)
            if tag == "first":
                hold.wait(10)

    first = threading.Thread(target=turn, args=("batch", "first"))
    first.start()
    while g.in_flight == 0:
        time.sleep(0.001)
    threads = [threading.Thread(target=turn, args=("batch", "b"))]
    threads[0].start()
    while g.queued < 1:
        time.sleep(0.001)
    threads.append(threading.Thread(target=turn, args=("interactive", "i")))
    threads[1].start()
    while g.queued < 2:
        time.sleep(0.001)
    hold.set()
    for t in [first, *threads]:
        t.join(10)
    assert done == ["first", "i", "b"]
    adds_up(g.stats())


def test_reconfigure_keeps_classes_and_follows_the_limit():
    g = gate(max_concurrent_runs=10)
    g.reconfigure(
        max_concurrent_runs=4,
        priorities=[
            PriorityClass("interactive", min_share=0.25),
            PriorityClass("batch", min_share=0.5),
        ],
        default_priority="interactive",
    )
    with pytest.raises(ValueError, match="not their names or order"):
        g.reconfigure(priorities=[PriorityClass("batch"), PriorityClass("interactive")])
    with pytest.raises(ValueError, match="sum to"):
        g.reconfigure(
            priorities=[
                PriorityClass("interactive", min_share=0.8),
                PriorityClass("batch", min_share=0.5),
            ]
        )
    with pytest.raises(ValueError, match="not a priority class"):
        g.reconfigure(default_priority="vip")

    async def main():
        async with g.admit():
            stats = g.stats()
            assert stats["classes"]["interactive"]["in_flight"] == 1

    run(main())
    assert g.stats()["classes"]["interactive"]["admitted"] == 1


def test_a_burst_100_times_the_cap_and_thousands_of_waiters_settle_and_add_up():
    cap = 8
    g = admitgate.build_admission_gate(
        max_concurrent_runs=cap,
        queue_depth=200,
        overflow_policy="shed_oldest",
        priorities=[
            PriorityClass("interactive", min_share=0.25),
            PriorityClass("agent", min_share=0.25, max_share=0.5),
            PriorityClass("batch", min_share=0.2),
        ],
    )
    peak_per_class = {"interactive": 0, "agent": 0, "batch": 0}

    async def main():
        async def turn(i):
            priority = ("interactive", "agent", "batch")[i % 3]
            try:
                async with g.admit(session_id=f"t{i % 50}", priority=priority):
                    stats = g.stats()
                    assert stats["in_flight"] <= cap
                    assert stats["classes"]["agent"]["in_flight"] <= cap // 2
                    peak_per_class[priority] = max(
                        peak_per_class[priority], stats["classes"][priority]["in_flight"]
                    )
                    await asyncio.sleep(0)
            except admitgate.AdmissionRejected as exc:
                assert exc.priority == priority

        await asyncio.gather(*(turn(i) for i in range(100 * cap)))

    run(main(), timeout=60)
    stats = g.stats()
    adds_up(stats)
    assert (stats["in_flight"], stats["queued"]) == (0, 0)
    assert stats["admitted"] + stats["shed"] + stats["rejected"] == 100 * cap
    assert stats["shed"] > 0, "the burst overflowed the queue"
    assert all(peak > 0 for peak in peak_per_class.values())


# -- YAML and check-config -----------------------------------------------------------------


def write(tmp_path, text: str):
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_a_gateway_config_declares_classes_that_check_config_reports_and_the_gate_uses(
    tmp_path,
):
    from admitgate import config

    path = write(
        tmp_path,
        "gateway:\n  max_concurrent_runs: 4\n  queue_depth: 8\n"
        "priorities:\n  - name: interactive\n    min_share: 0.5\n"
        "  - {name: batch, min_share: 0.25, max_share: 0.75}\n"
        "default_priority: batch\nfairness: tenant\n",
    )
    settings = config.load(path)
    assert settings.settings["priorities"].line == 4
    assert settings.gate_kwargs()["priorities"] == [
        PriorityClass("interactive", min_share=0.5),
        PriorityClass("batch", min_share=0.25, max_share=0.75),
    ]
    text = settings.format_text()
    assert "interactive (0.5..1), batch (0.25..0.75)" in text
    assert "Priority classes, most important first: interactive, batch" in text
    g = settings.build_gate()
    assert g is not None

    async def main():
        async with g.admit():  # the default class: batch
            assert g.stats()["classes"]["batch"]["in_flight"] == 1

    run(main())


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("priorities: interactive\n", "priorities must be a list of classes"),
        (
            "priorities:\n  - name: a\n    share: 0.5\n",
            r"priorities\[0\] has unknown keys \['share'\]",
        ),
        ("priorities:\n  - name: a\n    min_share: 2\n", r"priorities\[0\]: min_share must be"),
        (
            "priorities:\n  - {name: a, min_share: 0.7}\n  - {name: b, min_share: 0.5}\n",
            "sum to 1.2",
        ),
        ("priorities:\n  - {name: a}\ndefault_priority: b\n", "default_priority 'b' is not"),
        ("priorities:\n  - {name: a}\nfairness: fifo\n", "fairness must be one of"),
    ],
)
def test_bad_priorities_in_a_config_are_refused_with_the_line(tmp_path, yaml_text, message):
    from admitgate import config

    with pytest.raises(config.ConfigError, match=message) as caught:
        config.load(write(tmp_path, "gateway:\n  max_concurrent_runs: 2\n" + yaml_text))
    assert ":3:" in str(caught.value) or ":4:" in str(caught.value)
