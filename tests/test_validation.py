"""Bad input: every constructor argument, wrong types and wrong values.

Three kinds of case:

* parity errors: both implementations raise ``ValueError`` (admitgate may raise
  ``TypeError`` for a wrong type) with a message naming the argument and the bad value;
  for negative counts the message is the reference's, word for word.
* parity acceptance: both accept the value and end up with the same setting
  (integer strings from YAML or a CLI, integral floats, ``2**31 - 1``).
* known divergences (issue 2, divergence 4): admitgate raises ``ValueError`` naming the
  argument, while the reference accepts the value or fails with an error that does not
  (each test asserts what the reference really does).
"""

from __future__ import annotations

import math
import types

import pytest

NAN = float("nan")
INF = float("inf")
INT32_MAX = 2**31 - 1
COUNT_ARGS = ("max_concurrent_runs", "queue_depth", "max_concurrent_runs_per_scope")


def check_message(exc: BaseException, argument: str, bad) -> None:
    """The message names the argument and shows the bad value."""
    msg = str(exc)
    assert argument in msg, msg
    shown = (repr(bad), str(bad), type(bad).__name__)
    assert any(s.lower() in msg.lower() for s in shown), (msg, bad)


def make_policy(impl, **kwargs):
    return impl.ConcurrencyLimitPolicy(**{"max_concurrent_runs": 4, **kwargs})


def make_gate(impl, **kwargs):
    return impl.build_admission_gate(**{"max_concurrent_runs": 4, **kwargs})


def setting(obj, argument):
    """The value a policy or gate ended up with for ``argument``."""
    if hasattr(obj, "stats"):
        return obj.stats()[argument]
    return getattr(obj, argument)


FACTORIES = {"policy": make_policy, "build": make_gate}
FACTORY_ARGS = [
    pytest.param(factory, argument, id=f"{factory}-{argument}")
    for factory in FACTORIES
    for argument in COUNT_ARGS
]


# --- counts: parity errors ---------------------------------------------------


@pytest.mark.parametrize("factory,argument", FACTORY_ARGS)
@pytest.mark.parametrize("bad", [-1, -5, -(2**40)])
def test_negative_count_message_matches_ref(ag, ref, factory, argument, bad):
    build = FACTORIES[factory]
    with pytest.raises(ValueError) as theirs:
        build(ref, **{argument: bad})
    with pytest.raises(ValueError) as mine:
        build(ag, **{argument: bad})
    assert str(theirs.value) == f"{argument} must be >= 0, got {bad}"
    assert str(mine.value) == str(theirs.value)


def count_cases(values):
    """(factory, argument, bad) for every count argument, except that a falsy
    ``max_concurrent_runs`` means "unset" to ``build_admission_gate``."""
    return [
        pytest.param(factory, argument, bad, id=f"{factory}-{argument}-{bad!r}")
        for factory in FACTORIES
        for argument in COUNT_ARGS
        for bad in values
        if not (factory == "build" and argument == "max_concurrent_runs" and not bad)
    ]


@pytest.mark.parametrize("factory,argument,bad", count_cases(["x", "1.5", "", "32 runs", NAN]))
def test_non_integer_count_value(impl, factory, argument, bad):
    with pytest.raises(ValueError) as info:
        FACTORIES[factory](impl, **{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize("factory,argument,bad", count_cases([object(), [], [4], {"n": 4}, 1 + 2j]))
def test_wrong_type_count(impl, factory, argument, bad):
    errors = ValueError if impl.is_reference else (ValueError, TypeError)
    with pytest.raises(errors) as info:
        FACTORIES[factory](impl, **{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize("argument", COUNT_ARGS)
def test_none_count_on_policy(impl, argument):
    with pytest.raises((ValueError, TypeError)) as info:
        make_policy(impl, **{argument: None})
    check_message(info.value, argument, None)


@pytest.mark.parametrize("argument", ["queue_depth", "max_concurrent_runs_per_scope"])
def test_builder_treats_none_as_unset(impl, argument):
    """Divergence (admitgate's choice): the builders read ``None`` as "not configured"."""
    if impl.is_reference:
        with pytest.raises(ValueError) as info:
            make_gate(impl, **{argument: None})
        assert str(info.value) == f"{argument} must be an integer, got None"
        return
    assert make_gate(impl, **{argument: None}).stats()[argument] == 0


# --- counts: parity acceptance ---------------------------------------------------


@pytest.mark.parametrize("factory,argument", FACTORY_ARGS)
@pytest.mark.parametrize(
    "value,expected",
    [
        (0, 0),
        (3, 3),
        ("32", 32),
        (" 32 ", 32),
        ("0", 0),
        (7.0, 7),
        (INT32_MAX, INT32_MAX),
        (str(INT32_MAX), INT32_MAX),
    ],
    ids=repr,
)
def test_count_accepted_like_ref(ag, ref, factory, argument, value, expected):
    build = FACTORIES[factory]
    theirs = build(ref, **{argument: value})
    mine = build(ag, **{argument: value})
    if theirs is None:  # build_admission_gate(max_concurrent_runs=0): no gate
        assert (factory, argument, expected) == ("build", "max_concurrent_runs", 0)
        assert mine is None
        return
    assert setting(theirs, argument) == expected
    got = setting(mine, argument)
    assert got == expected and type(got) is int


def test_build_none_ceiling_is_disabled(impl):
    assert impl.build_admission_gate(max_concurrent_runs=None) is None


# --- counts: stricter than the reference (divergence 4) ---------------------------

STRICT_COUNT_VALUES = [True, False, 1.5, 2.5, -0.5, 2**31, 2**63, 10**30]


@pytest.mark.parametrize("factory,argument", FACTORY_ARGS)
@pytest.mark.parametrize("bad", STRICT_COUNT_VALUES, ids=repr)
def test_strict_count_divergence(impl, factory, argument, bad):
    build = FACTORIES[factory]
    if impl.is_reference:
        result = build(impl, **{argument: bad})  # known divergence: accepted, truncated
        if factory == "build" and argument == "max_concurrent_runs" and int(bad) == 0:
            assert result is None  # False or -0.5 silently switched the gate off
        else:
            assert setting(result, argument) == int(bad)
        return
    with pytest.raises(ValueError) as info:
        build(impl, **{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize("factory,argument", FACTORY_ARGS)
@pytest.mark.parametrize("bad", [INF, -INF], ids=repr)
def test_infinite_count(impl, factory, argument, bad):
    build = FACTORIES[factory]
    if impl.is_reference:
        with pytest.raises(OverflowError):  # not a ValueError naming the argument
            build(impl, **{argument: bad})
        return
    with pytest.raises(ValueError) as info:
        build(impl, **{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize("factory,argument", FACTORY_ARGS)
def test_bytes_count_is_a_known_divergence(ag, ref, factory, argument):
    build = FACTORIES[factory]
    assert setting(build(ref, **{argument: b"4"}), argument) == 4
    with pytest.raises((ValueError, TypeError)):
        build(ag, **{argument: b"4"})


# --- overflow_policy ---------------------------------------------------------------


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize(
    "value,expected",
    [
        ("reject", "reject"),
        ("queue", "queue"),
        ("shed_oldest", "shed_oldest"),
        (" Queue ", "queue"),
        ("SHED_OLDEST", "shed_oldest"),
        ("\tReject\n", "reject"),
        (None, "reject"),
        ("", "reject"),
    ],
    ids=repr,
)
def test_overflow_policy_accepted_like_ref(impl, factory, value, expected):
    obj = FACTORIES[factory](impl, overflow_policy=value)
    if factory == "policy":
        assert obj.overflow_policy == expected
    else:
        assert obj.enabled is True


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize(
    "bad", ["bogus", "shed-oldest", "drop_newest", "rejects", "re ject"], ids=repr
)
def test_unknown_overflow_policy(ag, ref, factory, bad):
    build = FACTORIES[factory]
    with pytest.raises(ValueError) as theirs:
        build(ref, overflow_policy=bad)
    with pytest.raises(ValueError) as mine:
        build(ag, overflow_policy=bad)
    check_message(mine.value, "overflow_policy", bad)
    for name in ("reject", "queue", "shed_oldest"):
        assert name in str(mine.value)
    assert "overflow_policy must be one of" in str(theirs.value)


@pytest.mark.parametrize("factory", FACTORIES)
def test_blank_overflow_policy_is_refused_like_ref(impl, factory):
    """Only an empty (or None) overflow_policy means the default; "  " is a typo."""
    with pytest.raises(ValueError, match="overflow_policy") as info:
        FACTORIES[factory](impl, overflow_policy="  ")
    if not impl.is_reference:
        check_message(info.value, "overflow_policy", "  ")


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("bad", [1, True, b"reject", object(), ["reject"]], ids=repr)
def test_wrong_type_overflow_policy(impl, factory, bad):
    build = FACTORIES[factory]
    if impl.is_reference:
        # "'int' object has no attribute 'strip'" (bytes get a ValueError)
        with pytest.raises((AttributeError, ValueError)):
            build(impl, overflow_policy=bad)
        return
    with pytest.raises((ValueError, TypeError)) as info:
        build(impl, overflow_policy=bad)
    check_message(info.value, "overflow_policy", bad)


# --- build_admission_gate with ceiling 0 still validates (divergence 4) -----------

CEILING_ZERO_MISCONFIG = [
    pytest.param({"queue_depth": -1}, "queue_depth", ValueError, id="negative-depth"),
    pytest.param({"queue_depth": "deep"}, "queue_depth", ValueError, id="text-depth"),
    pytest.param({"queue_depth": 1.5}, "queue_depth", ValueError, id="float-depth"),
    pytest.param({"queue_depth": True}, "queue_depth", ValueError, id="bool-depth"),
    pytest.param({"queue_depth": 2**31}, "queue_depth", ValueError, id="huge-depth"),
    pytest.param({"overflow_policy": "bogus"}, "overflow_policy", ValueError, id="bad-overflow"),
    pytest.param(
        {"overflow_policy": 3},
        "overflow_policy",
        (ValueError, TypeError),
        id="int-overflow",
    ),
    pytest.param(
        {"max_concurrent_runs_per_scope": -1},
        "max_concurrent_runs_per_scope",
        ValueError,
        id="negative-scope",
    ),
]


@pytest.mark.parametrize("ceiling", [0, "0", None])
@pytest.mark.parametrize("kwargs,argument,errors", CEILING_ZERO_MISCONFIG)
def test_ceiling_zero_still_validates(impl, ceiling, kwargs, argument, errors):
    if impl.is_reference:
        assert impl.build_admission_gate(max_concurrent_runs=ceiling, **kwargs) is None
        return
    with pytest.raises(errors) as info:
        impl.build_admission_gate(max_concurrent_runs=ceiling, **kwargs)
    check_message(info.value, argument, kwargs[argument])


def test_ceiling_zero_with_resource_policy_still_validates(impl):
    policy = impl.MemoryPressurePolicy(hard_rss_mb=100)
    if impl.is_reference:
        gate = impl.build_admission_gate(0, -1, "bogus", resource_policy=policy)
        assert gate is not None and gate.enabled
        return
    with pytest.raises(ValueError):
        impl.build_admission_gate(0, -1, "bogus", resource_policy=policy)


def test_policy_ceiling_zero_validates_in_both(impl):
    """ConcurrencyLimitPolicy itself always validated every argument."""
    with pytest.raises(ValueError, match="queue_depth"):
        impl.ConcurrencyLimitPolicy(0, -1)
    with pytest.raises(ValueError, match="overflow_policy"):
        impl.ConcurrencyLimitPolicy(0, 0, "bogus")
    with pytest.raises(ValueError, match="max_concurrent_runs_per_scope"):
        impl.ConcurrencyLimitPolicy(0, 0, "reject", -1)


# --- MemoryPressurePolicy ------------------------------------------------------------

THRESHOLDS = ("soft_rss_mb", "hard_rss_mb")


@pytest.mark.parametrize("argument", THRESHOLDS)
@pytest.mark.parametrize("bad", [-1, -0.5, -(10**6)], ids=repr)
def test_negative_threshold_message_matches_ref(ag, ref, argument, bad):
    with pytest.raises(ValueError) as theirs:
        ref.MemoryPressurePolicy(**{argument: bad})
    with pytest.raises(ValueError) as mine:
        ag.MemoryPressurePolicy(**{argument: bad})
    assert str(theirs.value) == f"{argument} must be >= 0, got {bad!r}"
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("argument", THRESHOLDS)
@pytest.mark.parametrize("bad", ["x", "1gb", object(), -INF], ids=repr)
def test_bad_threshold(impl, argument, bad):
    errors = ValueError if impl.is_reference else (ValueError, TypeError)
    with pytest.raises(errors) as info:
        impl.MemoryPressurePolicy(**{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize("argument", THRESHOLDS)
@pytest.mark.parametrize("bad", [NAN, INF, True, False, [], [5]], ids=repr)
def test_strict_threshold_divergence(impl, argument, bad):
    if impl.is_reference:
        if bad == [5]:
            with pytest.raises(ValueError):  # float([5]) fails, but [] slips through
                impl.MemoryPressurePolicy(**{argument: bad})
            return
        impl.MemoryPressurePolicy(**{argument: bad})  # known divergence: accepted
        return
    with pytest.raises((ValueError, TypeError) if isinstance(bad, list) else ValueError) as info:
        impl.MemoryPressurePolicy(**{argument: bad})
    check_message(info.value, argument, bad)


@pytest.mark.parametrize(
    "soft,hard",
    [(10, 5), (100.5, 100), ("200", "100"), (1024, 1023.999)],
    ids=repr,
)
def test_inverted_thresholds(impl, soft, hard):
    with pytest.raises(ValueError) as info:
        impl.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard)
    msg = str(info.value)
    assert "soft_rss_mb" in msg and "hard_rss_mb" in msg
    assert str(soft) in msg and str(hard) in msg


@pytest.mark.parametrize(
    "soft,hard",
    [
        (0, 0),
        (100, 0),
        (0, 100),
        (100, 100),
        (0.5, 0.75),
        ("100", "200"),
        (" 100 ", " 200 "),
        (None, 200),
        (100, None),
        (None, None),
        (2**31, 2**40),
    ],
    ids=repr,
)
def test_thresholds_accepted_like_ref(ag, ref, soft, hard):
    theirs = ref.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard)
    mine = ag.MemoryPressurePolicy(soft_rss_mb=soft, hard_rss_mb=hard)
    assert (mine.soft_rss_mb, mine.hard_rss_mb) == (
        theirs.soft_rss_mb,
        theirs.hard_rss_mb,
    )
    assert type(mine.soft_rss_mb) is float and type(mine.hard_rss_mb) is float
    assert mine.enabled is theirs.enabled


# --- build_memory_pressure_policy ----------------------------------------------------


@pytest.mark.parametrize(
    "bad", [-1, -0.5, -INF, "x", "1gb", object(), [], [1024], NAN, INF, True], ids=repr
)
def test_build_memory_policy_max_rss_mb_divergence(impl, bad):
    if impl.is_reference:
        # Known divergence: the reference never raises here.
        result = impl.build_memory_pressure_policy(bad)
        nonsense = isinstance(bad, float) and (math.isnan(bad) or bad == INF)
        if bad is True or nonsense:
            assert result is not None  # nonsense thresholds (1.0, nan or inf MiB)
        else:
            assert result is None  # memory protection silently off
        return
    errors = ValueError if isinstance(bad, (int, float, str)) else (ValueError, TypeError)
    with pytest.raises(errors) as info:
        impl.build_memory_pressure_policy(bad)
    check_message(info.value, "max_rss_mb", bad)


def test_build_memory_policy_nan_ratio_divergence(impl):
    if impl.is_reference:
        policy = impl.build_memory_pressure_policy(1000, NAN)
        assert policy.soft_rss_mb == 1000.0  # NaN silently became ratio 1.0
        return
    with pytest.raises(ValueError) as info:
        impl.build_memory_pressure_policy(1000, NAN)
    check_message(info.value, "soft_ratio", NAN)


def test_build_memory_policy_none_ratio_is_refused(impl):
    """``soft_ratio=None`` is an error on both; admitgate's names the argument."""
    if impl.is_reference:
        with pytest.raises(TypeError):
            impl.build_memory_pressure_policy(1000, None)
        return
    with pytest.raises(ValueError) as info:
        impl.build_memory_pressure_policy(1000, None)
    check_message(info.value, "soft_ratio", None)


@pytest.mark.parametrize("bad", [object(), [], "lots"], ids=repr)
def test_build_memory_policy_wrong_type_ratio(impl, bad):
    if impl.is_reference:
        # "'<' not supported between ...": a TypeError that does not name soft_ratio
        with pytest.raises(TypeError):
            impl.build_memory_pressure_policy(1000, bad)
        return
    with pytest.raises((ValueError, TypeError)) as info:
        impl.build_memory_pressure_policy(1000, bad)
    check_message(info.value, "soft_ratio", bad)


@pytest.mark.parametrize(
    "ratio,soft", [(0.5, 500.0), (1.5, 1000.0), (-0.5, 0.0), (0, 0.0), (1, 1000.0)]
)
def test_build_memory_policy_ratio_is_clamped(impl, ratio, soft):
    policy = impl.build_memory_pressure_policy(1000, soft_ratio=ratio)
    assert policy.soft_rss_mb == soft
    assert policy.hard_rss_mb == 1000.0


def test_build_memory_policy_keyword_names(impl):
    policy = impl.build_memory_pressure_policy(max_rss_mb="2048", soft_ratio=0.5)
    assert (policy.soft_rss_mb, policy.hard_rss_mb) == (1024.0, 2048.0)


# --- AdmissionGate with a duck-typed policy carrying garbage ---------------------------


def duck_policy(**attrs):
    from praisonaiagents.gateway import AdmissionDecision

    base = {
        "max_concurrent_runs": 2,
        "queue_depth": 2,
        "overflow_policy": "reject",
        "max_concurrent_runs_per_scope": 0,
    }
    base.update(attrs)
    return types.SimpleNamespace(decide=lambda **_: AdmissionDecision.ADMIT, **base)


# (attribute, bad value, what the reference does: "raises" or "accepts")
GARBAGE_ATTRIBUTES = [
    ("max_concurrent_runs", "abc", "raises"),
    ("max_concurrent_runs", object(), "raises"),
    ("max_concurrent_runs", NAN, "raises"),
    ("max_concurrent_runs", INF, "raises"),
    ("max_concurrent_runs", -1, "accepts"),
    ("max_concurrent_runs", True, "accepts"),
    ("max_concurrent_runs", 1.5, "accepts"),
    ("max_concurrent_runs", 2**31, "accepts"),
    ("queue_depth", "abc", "raises"),
    ("queue_depth", -3, "accepts"),
    ("queue_depth", 2.5, "accepts"),
    ("queue_depth", True, "accepts"),
    ("max_concurrent_runs_per_scope", "abc", "raises"),
    ("max_concurrent_runs_per_scope", -1, "accepts"),
    ("max_concurrent_runs_per_scope", True, "accepts"),
    ("overflow_policy", "bogus", "accepts"),
    ("overflow_policy", 7, "accepts"),
]


@pytest.mark.parametrize(
    "attribute,bad,ref_does",
    GARBAGE_ATTRIBUTES,
    ids=[f"{a}={b!r}" for a, b, _ in GARBAGE_ATTRIBUTES],
)
def test_gate_rejects_garbage_policy_attributes(impl, attribute, bad, ref_does):
    policy = duck_policy(**{attribute: bad})
    if impl.is_reference:
        if ref_does == "raises":
            with pytest.raises((ValueError, TypeError, OverflowError)):
                impl.AdmissionGate(policy)
        else:
            impl.AdmissionGate(policy)  # known divergence: the garbage is used as is
        return
    with pytest.raises((ValueError, TypeError)) as info:
        impl.AdmissionGate(policy)
    check_message(info.value, attribute, bad)


@pytest.mark.parametrize(
    "attrs,enabled,ceiling",
    [
        ({"max_concurrent_runs": "3"}, True, 3),
        ({"max_concurrent_runs": 0}, False, 0),
        ({"max_concurrent_runs": None}, False, 0),
        (
            {
                "queue_depth": None,
                "overflow_policy": None,
                "max_concurrent_runs_per_scope": None,
            },
            True,
            2,
        ),
    ],
    ids=repr,
)
def test_gate_accepts_plain_policy_attributes(impl, attrs, enabled, ceiling):
    gate = impl.AdmissionGate(duck_policy(**attrs))
    assert gate.enabled is enabled
    assert gate.stats()["max_concurrent_runs"] == ceiling


def test_gate_accepts_policy_without_attributes(impl):
    from praisonaiagents.gateway import AdmissionDecision

    gate = impl.AdmissionGate(types.SimpleNamespace(decide=lambda **_: AdmissionDecision.ADMIT))
    assert gate.enabled is False
    stats = gate.stats()
    assert (
        stats["max_concurrent_runs"],
        stats["queue_depth"],
        stats["max_concurrent_runs_per_scope"],
    ) == (0, 0, 0)


# --- signatures ---------------------------------------------------------------------------


def test_gate_options_are_keyword_only(impl):
    policy = impl.ConcurrencyLimitPolicy(1)
    with pytest.raises(TypeError):
        impl.AdmissionGate(policy, impl.MemoryPressurePolicy(hard_rss_mb=10))
    with pytest.raises(TypeError):
        impl.AdmissionGate(policy, resource_polisy=None)
    with pytest.raises(TypeError):
        impl.AdmissionGate()


def test_admit_session_id_is_keyword_only(impl):
    gate = impl.build_admission_gate(1)
    with pytest.raises(TypeError):
        gate.admit("session")


def test_unknown_keyword_arguments(impl):
    with pytest.raises(TypeError):
        impl.ConcurrencyLimitPolicy(max_runs=3)
    with pytest.raises(TypeError):
        impl.MemoryPressurePolicy(max_rss_mb=3)
    with pytest.raises(TypeError):
        impl.build_admission_gate(max_runs=3)
    with pytest.raises(TypeError):
        impl.build_memory_pressure_policy(1024, ratio=0.5)
    with pytest.raises(TypeError):
        impl.ResourceSample(rss=1.0)
