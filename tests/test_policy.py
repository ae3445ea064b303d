"""The pure policies, compared value for value with the reference's.

``ConcurrencyLimitPolicy.decide`` and ``MemoryPressurePolicy.evaluate`` are pure
functions, so admitgate must return exactly what praisonaiagents returns for the same
facts, as the very same ``AdmissionDecision`` member (``is``, not just ``==``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types

import pytest
from conftest import FakeSampler

OVERFLOW_POLICIES = ("reject", "queue", "shed_oldest")
SMALL = range(5)  # in_flight, queued, scope_in_flight, scope_queued

POLICY_CONFIGS = [
    pytest.param(
        ceiling,
        depth,
        per_scope,
        overflow,
        id=f"c{ceiling}-d{depth}-s{per_scope}-{overflow}",
    )
    for ceiling, depth, per_scope, overflow in itertools.product(
        range(4), range(4), range(3), OVERFLOW_POLICIES
    )
]


def facts_grid():
    for in_flight, queued, scope_in_flight, scope_queued, scope in itertools.product(
        SMALL, SMALL, SMALL, SMALL, ("", "t")
    ):
        yield {
            "in_flight": in_flight,
            "queued": queued,
            "session_id": scope,
            "scope": scope,
            "scope_in_flight": scope_in_flight,
            "scope_queued": scope_queued,
        }


# --- ConcurrencyLimitPolicy -------------------------------------------------


@pytest.mark.parametrize("ceiling,depth,per_scope,overflow", POLICY_CONFIGS)
def test_decide_matches_ref_for_every_fact(ag, ref, ceiling, depth, per_scope, overflow):
    kwargs = {
        "max_concurrent_runs": ceiling,
        "queue_depth": depth,
        "overflow_policy": overflow,
        "max_concurrent_runs_per_scope": per_scope,
    }
    mine = ag.ConcurrencyLimitPolicy(**kwargs)
    theirs = ref.ConcurrencyLimitPolicy(**kwargs)
    mismatches = []
    for facts in facts_grid():
        want = theirs.decide(**facts)
        got = mine.decide(**facts)
        if got is not want:
            mismatches.append((facts, want, got))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"


def test_decide_defaults_and_session_id_ignored(ag, ref):
    """Only the keyword facts matter; the optional ones default like the reference's."""
    for ceiling, depth, per_scope, overflow in itertools.product(
        range(3), range(3), range(3), OVERFLOW_POLICIES
    ):
        mine = ag.ConcurrencyLimitPolicy(ceiling, depth, overflow, per_scope)
        theirs = ref.ConcurrencyLimitPolicy(ceiling, depth, overflow, per_scope)
        for in_flight, queued in itertools.product(SMALL, SMALL):
            want = theirs.decide(in_flight=in_flight, queued=queued)
            assert mine.decide(in_flight=in_flight, queued=queued) is want
            for session_id in ("", "s", "other"):
                got = mine.decide(in_flight=in_flight, queued=queued, session_id=session_id)
                assert got is want


def test_decide_is_keyword_only(ag, ref):
    for impl in (ag, ref):
        policy = impl.ConcurrencyLimitPolicy(1)
        with pytest.raises(TypeError):
            policy.decide(0, 0)
        with pytest.raises(TypeError):
            policy.decide(in_flight=0)  # queued is required


@pytest.mark.parametrize(
    "args",
    [
        (),
        (0,),
        (3,),
        (32, 128, "reject", 4),
        (8, 64, "queue"),
        (16, 32, "shed_oldest"),
        (2, 0, " Queue "),
        (2, 0, "SHED_OLDEST"),
        ("32", "128", "reject", "4"),
    ],
)
def test_policy_attributes_match_ref(ag, ref, args):
    mine = ag.ConcurrencyLimitPolicy(*args)
    theirs = ref.ConcurrencyLimitPolicy(*args)
    for attr in (
        "max_concurrent_runs",
        "queue_depth",
        "overflow_policy",
        "max_concurrent_runs_per_scope",
        "enabled",
    ):
        want = getattr(theirs, attr)
        got = getattr(mine, attr)
        assert got == want, attr
        assert type(got) is type(want), attr


def test_policy_defaults(impl):
    policy = impl.ConcurrencyLimitPolicy()
    assert policy.max_concurrent_runs == 0
    assert policy.queue_depth == 0
    assert policy.overflow_policy == "reject"
    assert policy.max_concurrent_runs_per_scope == 0
    assert policy.enabled is False
    assert impl.ConcurrencyLimitPolicy(1).enabled is True


def test_policy_attributes_read_only(ag):
    policy = ag.ConcurrencyLimitPolicy(4, 8, "queue", 2)
    for attr, value in (
        ("max_concurrent_runs", 99),
        ("queue_depth", 99),
        ("overflow_policy", "reject"),
        ("max_concurrent_runs_per_scope", 99),
    ):
        with pytest.raises(AttributeError):
            setattr(policy, attr, value)
    assert (policy.max_concurrent_runs, policy.queue_depth) == (4, 8)


# --- MemoryPressurePolicy ----------------------------------------------------

THRESHOLDS = [
    (0, 0),
    (0, 100),
    (100, 0),
    (100, 100),
    (100, 200),
    (0.5, 0.75),
    (99.5, 100.25),
    (921.6, 1024),
]
RSS_SAMPLES = [
    None,
    0,
    0.0,
    0.25,
    0.5,
    0.75,
    1,
    50,
    99.5,
    99.999,
    100,
    100.0,
    100.25,
    150,
    199.999,
    200,
    200.0,
    200.001,
    921.6,
    1023.99,
    1024,
    10**9,
    math.inf,
]


@pytest.mark.parametrize("soft,hard", THRESHOLDS, ids=[f"{s}-{h}" for s, h in THRESHOLDS])
def test_evaluate_matches_ref(ag, ref, soft, hard):
    mine = ag.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard)
    theirs = ref.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard)
    assert mine.soft_rss_mb == theirs.soft_rss_mb
    assert mine.hard_rss_mb == theirs.hard_rss_mb
    assert type(mine.soft_rss_mb) is float and type(mine.hard_rss_mb) is float
    assert mine.enabled is theirs.enabled
    for rss in RSS_SAMPLES:
        want = theirs.evaluate(ref.ResourceSample(rss_mb=rss))
        for sample in (
            ag.ResourceSample(rss_mb=rss),
            ref.ResourceSample(rss_mb=rss),
            types.SimpleNamespace(rss_mb=rss),
        ):
            got = mine.evaluate(sample)
            assert got is want, (soft, hard, rss, type(sample), want, got)


def test_evaluate_ladder(impl):
    """The documented ladder, spelled out: below soft admit, soft..hard queue, >= hard reject."""
    decision = impl.AdmissionDecision
    policy = impl.MemoryPressurePolicy(soft_rss_mb=800, hard_rss_mb=1024)
    sample = impl.ResourceSample
    assert policy.enabled is True
    assert policy.evaluate(sample(rss_mb=None)) is decision.ADMIT
    assert policy.evaluate(sample()) is decision.ADMIT
    assert policy.evaluate(sample(rss_mb=799.9)) is decision.ADMIT
    assert policy.evaluate(sample(rss_mb=800)) is decision.QUEUE
    assert policy.evaluate(sample(rss_mb=1023.9)) is decision.QUEUE
    assert policy.evaluate(sample(rss_mb=1024)) is decision.REJECT
    assert policy.evaluate(sample(rss_mb=4096)) is decision.REJECT
    # Soft-only: queue above soft, never reject. Hard-only: reject at hard.
    soft_only = impl.MemoryPressurePolicy(soft_rss_mb=100)
    assert soft_only.evaluate(sample(rss_mb=10**6)) is decision.QUEUE
    hard_only = impl.MemoryPressurePolicy(hard_rss_mb=100)
    assert hard_only.evaluate(sample(rss_mb=99)) is decision.ADMIT
    assert hard_only.evaluate(sample(rss_mb=100)) is decision.REJECT
    # Disabled: everything admits.
    off = impl.MemoryPressurePolicy()
    assert off.enabled is False
    assert off.evaluate(sample(rss_mb=10**9)) is decision.ADMIT


def test_fake_sampler_feeds_evaluate(impl, sampler):
    policy = impl.MemoryPressurePolicy(soft_rss_mb=10, hard_rss_mb=20)
    sampler.rss_mb = 15
    assert policy.evaluate(sampler.read()) is impl.AdmissionDecision.QUEUE
    assert isinstance(sampler.read(), impl.ResourceSample)
    assert sampler.reads == 2
    assert isinstance(FakeSampler(1.0).read().rss_mb, float)


# --- build_memory_pressure_policy ---------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        (1024,),
        (1024.0,),
        ("1024",),
        (" 1024 ",),
        (700,),
        (0.5,),
        (1000, 0.9),
        (1000, 0.0),
        (1000, 0),
        (1000, 1),
        (1000, 1.0),
        (1000, 1.5),
        (1000, -0.5),
        (1000, 0.5),
        (1e6, 0.75),
    ],
)
def test_build_memory_pressure_policy_matches_ref(ag, ref, args):
    mine = ag.build_memory_pressure_policy(*args)
    theirs = ref.build_memory_pressure_policy(*args)
    assert isinstance(mine, ag.MemoryPressurePolicy)
    assert mine.soft_rss_mb == pytest.approx(theirs.soft_rss_mb, rel=1e-12)
    assert mine.hard_rss_mb == theirs.hard_rss_mb
    assert type(mine.hard_rss_mb) is float and type(mine.soft_rss_mb) is float
    assert mine.enabled is theirs.enabled


@pytest.mark.parametrize("max_rss_mb", [0, 0.0, None, "0"])
def test_build_memory_pressure_policy_unset_is_none(impl, max_rss_mb):
    assert impl.build_memory_pressure_policy(max_rss_mb) is None


def test_build_memory_pressure_policy_default_ratio(impl):
    policy = impl.build_memory_pressure_policy(1024)
    assert policy.hard_rss_mb == 1024.0
    assert policy.soft_rss_mb == pytest.approx(921.6)
    assert policy.evaluate(impl.ResourceSample(rss_mb=921.5)) is impl.AdmissionDecision.ADMIT
    assert policy.evaluate(impl.ResourceSample(rss_mb=921.7)) is impl.AdmissionDecision.QUEUE
    assert policy.evaluate(impl.ResourceSample(rss_mb=1024)) is impl.AdmissionDecision.REJECT


# --- ResourceSample ------------------------------------------------------------


def test_resource_sample_is_frozen_dataclass(impl):
    cls = impl.ResourceSample
    assert dataclasses.is_dataclass(cls)
    assert cls().rss_mb is None
    assert cls(rss_mb=12.5).rss_mb == 12.5
    assert cls(12.5) == cls(rss_mb=12.5)
    assert cls(1.0) != cls(2.0)
    assert hash(cls(3.0)) == hash(cls(3.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls(1.0).rss_mb = 2.0
    assert [f.name for f in dataclasses.fields(cls)] == ["rss_mb"]


# --- AdmissionDecision ----------------------------------------------------------


def test_admission_decision_is_the_core_enum(ag, ref):
    assert ag.AdmissionDecision is ref.AdmissionDecision
    import admitgate
    from praisonaiagents.gateway import AdmissionDecision

    assert admitgate.AdmissionDecision is AdmissionDecision


def test_admission_decision_values(impl):
    decision = impl.AdmissionDecision
    assert [(m.name, m.value) for m in decision] == [
        ("ADMIT", "admit"),
        ("QUEUE", "queue"),
        ("REJECT", "reject"),
    ]
    assert issubclass(decision, str)
    assert decision.ADMIT == "admit" and decision("queue") is decision.QUEUE
    assert decision["REJECT"] is decision.REJECT


# --- AdmissionRejected ------------------------------------------------------------

DEFAULT_BUSY = "Busy right now — please resend in a moment."


def test_admission_rejected_default_message(impl):
    exc = impl.AdmissionRejected()
    assert isinstance(exc, Exception)
    assert exc.message == DEFAULT_BUSY
    assert str(exc) == DEFAULT_BUSY
    assert exc.args == (DEFAULT_BUSY,)
    with pytest.raises(impl.AdmissionRejected) as info:
        raise impl.AdmissionRejected()
    assert info.value.message == DEFAULT_BUSY


def test_admission_rejected_custom_message(impl):
    exc = impl.AdmissionRejected("go away")
    assert exc.message == "go away"
    assert str(exc) == "go away"
    exc = impl.AdmissionRejected(message="later")
    assert exc.message == "later" and str(exc) == "later"


def test_admission_rejected_reason_is_none_when_user_built(ag):
    assert ag.AdmissionRejected().reason is None
    assert ag.AdmissionRejected("x").reason is None


def test_admitgate_exports():
    import admitgate

    for name in (
        "AdmissionGate",
        "AdmissionRejected",
        "AdmissionDecision",
        "ConcurrencyLimitPolicy",
        "MemoryPressurePolicy",
        "ResourceSample",
        "build_admission_gate",
        "build_memory_pressure_policy",
    ):
        assert hasattr(admitgate, name), name
