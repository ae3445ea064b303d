"""``python -m admitgate simulate``: your gate settings against a described provider.

Runs, in the seeded overload simulator (virtual time, the real Rust gate), your
configuration (``--config gateway.yaml`` or flags), admitgate's adaptive configuration (an
:class:`~admitgate.AdaptiveLimit` under your ceiling, ``queue_discipline="adaptive"``) and no
gate at all, side by side on the same arrivals, against a provider of ``--capacity``
concurrent calls of about ``--service-ms`` that answers 429 at once beyond it, with clients
who leave after ``--patience`` seconds, offered ``--load`` times what the provider can
serve. Prints goodput (turns answered to a client still waiting, over the most the provider
could serve), p99 latency, provider 429s, busy acks and the ceiling at the end of each
capacity phase; ``--png`` draws goodput and the ceiling over time (``admitgate[simulate]``).

With ``--class NAME:share=F[,min=F][,max=F][,patience=S]`` (once per class, most important
first) the arrivals are several kinds of traffic, each a priority class of your gate with its
part of the arrivals and its clients' patience, and ``--tenants N`` spreads them over N
tenants (fair queuing within each class); the table then adds each class's goodput and queue
wait for your gate, the same gate without classes (FIFO) and no gate, and the PNG draws them
over time.

A run's time and memory are bounded whatever the flags: the simulated arrivals
(``--load`` x the first capacity / ``--service-ms`` x ``--duration``) may be at most
:data:`MAX_ARRIVALS` per gate compared, and every flag has a range; a flag out of its range,
or a run that would simulate more, exits 2 with one line naming the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import _admitgate
from ._cli import OneLineParser, integer

DEFAULT_UPPER_BOUND = 64
#: The most arrivals one gate's run may simulate (each costs a few events and about 80 bytes
#: until the run ends): a run of three gates at the bound took 33 s and 70 MB with a debug
#: build on a loaded 2-core host.
MAX_ARRIVALS = 500_000
#: The longest simulated run, in seconds of virtual time (a timeline point per 250 ms).
MAX_DURATION_S = 3_600.0
#: The longest simulated run, and the longest of any other time flag, in seconds.
MAX_SECONDS = 86_400.0
#: The largest count the gate takes (``max_concurrent_runs``, ``queue_depth``).
MAX_COUNT = 2**31 - 1
#: The widest log-normal spread of service times: beyond it the mean lies in calls longer
#: than any run, and the served ones are so short that goodput means nothing.
MAX_SIGMA = 2.0


def _capacity(text: str) -> list[tuple[float, int]]:
    """``8`` or ``8,4@10,16@20``: a capacity, then ``capacity@seconds`` changes."""
    phases: list[tuple[float, int]] = []
    for i, part in enumerate(text.split(",")):
        value, _, at = part.strip().partition("@")
        try:
            capacity = int(value)
            start = float(at.rstrip("s")) if at else 0.0
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--capacity must look like 8 or 8,4@10,16@20, got {text!r}"
            ) from None
        if (
            not 1 <= capacity <= MAX_COUNT
            or not math.isfinite(start)
            or not 0 <= start <= MAX_SECONDS
            or (i > 0) != bool(at)
        ):
            raise argparse.ArgumentTypeError(
                f"--capacity must look like 8 or 8,4@10,16@20 (capacities from 1 to "
                f"{MAX_COUNT}, the first without @, each change with @seconds up to "
                f"{MAX_SECONDS:g}), got {text!r}"
            )
        if phases and start <= phases[-1][0]:
            raise argparse.ArgumentTypeError(
                f"--capacity changes must come in time order, got {text!r}"
            )
        phases.append((start, capacity))
    return phases


#: The most classes ``--class`` takes, and tenants ``--tenants``.
MAX_CLASSES = 16
MAX_TENANTS = 10_000


def _traffic_class(text: str) -> dict[str, Any]:
    """``interactive:share=0.1,min=0.5,max=1,patience=2``: a class and its traffic."""
    name, _, rest = text.partition(":")
    spec: dict[str, Any] = {"name": name, "share": None, "min": 0.0, "max": 1.0, "patience": None}
    bad = (
        f"--class must look like NAME:share=F[,min=F][,max=F][,patience=S] (a name of "
        f"letters, digits, '_', '-' or '.'; share, min and max from 0 to 1, patience in "
        f"seconds), got {text!r}"
    )
    if not name or not all(c.isascii() and (c.isalnum() or c in "_-.") for c in name):
        raise argparse.ArgumentTypeError(bad)
    seen: set[str] = set()
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("share", "min", "max", "patience") or key in seen:
            raise argparse.ArgumentTypeError(bad)
        seen.add(key)
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(bad) from None
        top = MAX_SECONDS if key == "patience" else 1.0
        if (
            not math.isfinite(number)
            or not 0 <= number <= top
            or (key == "patience" and number == 0)
        ):
            raise argparse.ArgumentTypeError(bad)
        spec[key] = number
    if spec["min"] > spec["max"]:
        raise argparse.ArgumentTypeError(f"--class {name}: min must be <= max, got {text!r}")
    return spec


def _positive(kind: type, most: float = MAX_SECONDS) -> Any:
    """A number > 0 and <= ``most``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text!r}")
        return value

    return parse


def _sigma(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= MAX_SIGMA):
        raise argparse.ArgumentTypeError(f"must be a number from 0 to {MAX_SIGMA:g}, got {text!r}")
    return value


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=f"A run simulates at most {MAX_ARRIVALS:,} arrivals per gate (--load x the first "
        "capacity / --service-ms x --duration), so its time and memory are bounded; a run that "
        "would simulate more, or a flag out of its range, exits 2 naming it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    yours = parser.add_argument_group("your gate (a gateway YAML, or flags; flags win)")
    yours.add_argument("--config", metavar="GATEWAY_YAML", help="read the admission settings")
    yours.add_argument("--max-concurrent-runs", type=integer(0, MAX_COUNT), metavar="N")
    yours.add_argument("--queue-depth", type=integer(0, MAX_COUNT), metavar="N")
    yours.add_argument("--overflow-policy", choices=("reject", "queue", "shed_oldest"))
    yours.add_argument("--queue-timeout-s", type=_positive(float), metavar="S")
    provider = parser.add_argument_group("the provider and its clients")
    provider.add_argument(
        "--capacity",
        type=_capacity,
        default=[(0.0, 8)],
        metavar="SPEC",
        help="concurrent calls it serves, with changes: 8, or 8,4@10,16@20 (default 8)",
    )
    provider.add_argument(
        "--service-ms", type=_positive(float, MAX_SECONDS * 1000), default=50.0, metavar="MS"
    )
    provider.add_argument(
        "--service-sigma",
        type=_sigma,
        default=0.25,
        metavar="S",
        help=f"log-normal spread, 0 to {MAX_SIGMA:g} (default 0.25)",
    )
    provider.add_argument(
        "--patience", type=_positive(float), default=0.5, metavar="S", help="default 0.5"
    )
    provider.add_argument(
        "--load",
        type=_positive(float, math.inf),
        default=10.0,
        help="x what it serves (default 10)",
    )
    provider.add_argument(
        "--deadlines", action="store_true", help="clients send admit(deadline_s=patience)"
    )
    classes = parser.add_argument_group("priority classes and tenants")
    classes.add_argument(
        "--class",
        dest="classes",
        action="append",
        type=_traffic_class,
        default=[],
        metavar="SPEC",
        help="NAME:share=F[,min=F][,max=F][,patience=S], once per class, most important "
        "first: its part of the arrivals (default: an equal part of what the others leave), "
        "its guaranteed and capped shares of your ceiling, its clients' patience (default "
        "--patience)",
    )
    classes.add_argument(
        "--default-priority", metavar="NAME", help="your gate's default class (the last)"
    )
    classes.add_argument(
        "--tenants",
        type=integer(1, MAX_TENANTS),
        default=1,
        metavar="N",
        help="arrivals spread over N tenants (default 1)",
    )
    classes.add_argument(
        "--fairness",
        choices=("tenant", "none"),
        help="fair queuing across tenants in your gate (default: tenant with classes)",
    )
    run = parser.add_argument_group("the run")
    run.add_argument("--duration", type=_positive(float, MAX_DURATION_S), default=30.0, metavar="S")
    run.add_argument("--seed", type=integer(0, 2**64 - 1), default=17, metavar="N")
    run.add_argument(
        "--baselines",
        action="store_true",
        help="also Vector-ARC AIMD, Gradient2 and CoDel (the published algorithms)",
    )
    run.add_argument("--png", metavar="PATH", help="goodput and the ceiling over time")
    return parser


def _your_gate(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "max_concurrent_runs": 0,
        "queue_depth": 0,
        "overflow_policy": "reject",
    }
    if args.config:
        from .config import load

        loaded = load(args.config)
        settings.update(
            max_concurrent_runs=loaded.max_concurrent_runs,
            queue_depth=loaded.queue_depth,
            overflow_policy=loaded.overflow_policy,
        )
        for name in ("max_concurrent_runs", "queue_depth"):
            if not 0 <= settings[name] <= MAX_COUNT:  # the flags' own range, checked by argparse
                raise ValueError(
                    f"{name} in {args.config} must be from 0 to {MAX_COUNT}, got {settings[name]}"
                )
    for name in ("max_concurrent_runs", "queue_depth", "overflow_policy"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    ceiling = settings["max_concurrent_runs"]
    order: dict[str, Any] = {}
    if args.classes:
        order["priorities"] = [(c["name"], c["min"], c["max"]) for c in args.classes]
        order["default_priority"] = args.default_priority
    fair = args.fairness == "tenant" if args.fairness else bool(args.classes)
    if fair:
        order["fair"] = True
    return {
        **order,
        "name": f"yours (max {ceiling}, queue {settings['queue_depth']})"
        if ceiling
        else "yours (no ceiling)",
        "ceiling": "fixed" if ceiling else "none",
        "max_concurrent_runs": ceiling,
        "queue_depth": settings["queue_depth"],
        "overflow_policy": settings["overflow_policy"],
        "queue_timeout_s": args.queue_timeout_s,
        "queue_discipline": "fifo",
    }


def candidates(yours: dict[str, Any], baselines: bool) -> list[dict[str, Any]]:
    """Your gate, the adaptive one under your ceiling (64 without one), no gate, and the
    published algorithms when asked."""
    bound = yours["max_concurrent_runs"] or DEFAULT_UPPER_BOUND
    depth = max(yours["queue_depth"], 128)
    adaptive = {
        "name": f"adaptive (<= {bound})",
        "ceiling": "adaptive",
        "max_concurrent_runs": bound,
        "queue_depth": depth,
        "overflow_policy": yours["overflow_policy"],
        "queue_timeout_s": yours["queue_timeout_s"],
        "queue_discipline": "adaptive",
    }
    order: dict[str, Any] = {
        k: yours[k] for k in ("priorities", "default_priority", "fair") if k in yours
    }
    adaptive.update(order)
    chosen = [yours, adaptive, {"name": "no gate", "ceiling": "none"}]
    if yours.get("priorities"):
        # The same gate without classes, beside it: what the classes change.
        plain = {k: v for k, v in yours.items() if k not in ("priorities", "default_priority")}
        plain.update(name=f"{yours['name']}, fifo", fair=False)
        chosen.insert(1, plain)
    if baselines:
        for name, ceiling, discipline in (
            ("aimd (vector arc), fifo", "aimd", "fifo"),
            ("gradient2 (netflix), fifo", "gradient2", "fifo"),
            (f"fixed {bound}, codel (folly)", "fixed", "codel"),
        ):
            chosen.append(
                {**adaptive, "name": name, "ceiling": ceiling, "queue_discipline": discipline}
            )
    return chosen


def table(reports: list[dict[str, Any]], physical_per_s: float) -> str:
    """The comparison as text."""
    head = (
        f"{'gate':<30} {'goodput':>8} {'turns/s':>8} {'p99 ms':>7} {'429s':>7} {'busy':>7}"
        "  ceiling at each phase end (capacity)"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        limits = ", ".join(
            f"{limit if limit else '-'} ({capacity})" for capacity, limit in r["phase_limits"]
        )
        calls = max(r["provider_calls"], 1)
        lines.append(
            f"{r['gate']:<30} {r['goodput']:>8.3f} {r['goodput'] * physical_per_s:>8.1f} "
            f"{r['p99_s'] * 1000:>7.0f} {100 * r['provider_429s'] / calls:>6.1f}% "
            f"{100 * r['busy'] / max(r['offered'], 1):>6.1f}%  {limits}"
        )
    return "\n".join(lines)


def class_table(reports: list[dict[str, Any]], physical_per_s: float, duration_s: float) -> str:
    """Each class's figures, gate by gate: its offered and served turns per second, its
    goodput (a fraction of what the provider could serve; the classes add up to the gate's),
    the fraction of its turns served, and its queue wait's p99."""
    width = max([30, *(len(r["gate"]) + 1 for r in reports)])
    head = (
        f"{'gate':<{width}} {'class':<14} {'offered/s':>9} {'turns/s':>8} {'goodput':>8} "
        f"{'served':>7} {'p99 wait ms':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        for name, offered, served, goodput, p99_wait, _ in r["classes"]:
            lines.append(
                f"{r['gate']:<{width}} {name:<14} {offered / duration_s:>9.1f} "
                f"{goodput * physical_per_s:>8.1f} {goodput:>8.3f} "
                f"{served / max(offered, 1):>6.1%} {p99_wait * 1000:>11.0f}"
            )
    return "\n".join(lines)


def _png_ready(path: str) -> str | None:
    """Why ``--png PATH`` cannot be written (checked before the run), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--png needs matplotlib: pip install 'admitgate[simulate]'"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--png: no such folder {folder!r} (for {path!r})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"--png: cannot write in {folder!r} (for {path!r})"
    if os.path.isdir(path):
        return f"--png: {path!r} is a folder"
    return None


#: One colour and line style per gate, the same in every panel (the first three: yours, the
#: adaptive gate, no gate; then the baselines).
_STYLES = [
    ("tab:red", "-"),
    ("tab:blue", "-"),
    ("black", ":"),
    ("tab:orange", "--"),
    ("tab:green", "-."),
    ("tab:purple", (0, (3, 1, 1, 1))),
]


def _smoothed(values: list[float], width: int) -> list[float]:
    """A trailing mean over ``width`` points (the first ones over what there is)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _png(path: str, reports: list[dict[str, Any]], title: str, service_s: float) -> None:
    """Three panels over time, one colour per gate in each: goodput as a fraction of what the
    provider could serve, the share of provider calls answered 429, and each ceiling against
    the provider's capacity. The legend carries the table's figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classed = [r for r in reports if r["classes"]]
    if classed:
        figure, (good, by_class, waits, throttled, ceiling) = plt.subplots(
            5,
            1,
            sharex=True,
            figsize=(10, 13),
            gridspec_kw={"height_ratios": [3, 3, 3, 2, 2]},
        )
        _class_panels(by_class, waits, classed, service_s)
    else:
        figure, (good, throttled, ceiling) = plt.subplots(
            3, 1, sharex=True, figsize=(10, 8.5), gridspec_kw={"height_ratios": [3, 2, 3]}
        )
    smooth = 4  # timeline points are 250 ms: a 1 s mean
    if reports:
        first = reports[0]["timeline"]
        times = [p[0] for p in first]
        ceiling.fill_between(
            times,
            [p[3] for p in first],
            step="post",
            color="0.88",
            label="provider capacity",
            zorder=0,
        )
        ceiling.step(times, [p[3] for p in first], where="post", color="0.55", lw=1, zorder=1)
    good.axhline(1.0, color="0.55", lw=1, zorder=0)
    widths = [4.5 - 1.0 * min(i, 3) for i in range(len(reports))]  # later ones drawn thinner
    handles = []
    for i, r in enumerate(reports):
        colour, style = _STYLES[i % len(_STYLES)]
        times = [p[0] for p in r["timeline"]]
        fraction = [p[1] * service_s / p[3] if p[3] else 0.0 for p in r["timeline"]]
        share = [100 * p[4] for p in r["timeline"]]
        calls = max(r["provider_calls"], 1)
        label = (
            f"{r['gate']}: goodput {r['goodput']:.2f}, "
            f"429s {100 * r['provider_429s'] / calls:.1f}% of calls"
        )
        kw = {"color": colour, "ls": style, "lw": widths[i], "alpha": 0.85, "zorder": 2 + i}
        (line,) = good.plot(times, _smoothed(fraction, smooth), label=label, **kw)
        handles.append(line)
        throttled.plot(times, _smoothed(share, smooth), **kw)
        if any(p[2] for p in r["timeline"]):
            ceiling.step(times, [p[2] for p in r["timeline"]], where="post", **kw)
    good.set_ylabel("goodput\n(fraction of capacity)")
    good.set_ylim(0, 1.25)  # a capacity drop shows as a brief spike above 1: clipped
    throttled.set_ylabel("provider 429s\n(% of its answers)")
    throttled.set_ylim(0, 100)
    ceiling.set_ylabel("ceiling\n(concurrent calls)")
    ceiling.set_xlabel("seconds of simulated time (goodput and 429s: 1 s means)")
    top = max(
        [p[3] for r in reports[:1] for p in r["timeline"]]
        + [p[2] for r in reports for p in r["timeline"]]
        + [1]
    )
    ceiling.set_ylim(0, top * 1.15)
    ceiling.legend(loc="upper left", fontsize="small")
    good.set_title(title, fontsize="medium")
    columns = 1 if len(handles) <= 3 else 2
    rows = -(-len(handles) // columns)
    legend_height = 0.03 * rows + 0.01
    figure.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=columns,
        fontsize="small",
        frameon=False,
    )
    figure.tight_layout(rect=(0, legend_height, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


#: One colour per class in the class panels (most important first), none of the gates' own
#: colours, so a class is never mistaken for a gate.
_CLASS_COLOURS = ["#d62790", "#17becf", "#8c564b", "#bcbd22", "#7f7f7f", "#393b79"]


def _class_panels(
    by_class: Any, waits: Any, reports: list[dict[str, Any]], service_s: float
) -> None:
    """Goodput and mean queue wait per class over time, one colour per class: your gate with
    its classes solid, the same gate without them (FIFO) dashed."""
    smooth = 4
    labels = ["with classes", "fifo"]
    top_wait = 0.0
    for g, r in enumerate(reports[:2]):
        times = [p[0] for p in r["timeline"]]
        capacity = [p[3] for p in r["timeline"]]
        for c, (name, _, _, goodput, p99_wait, timeline) in enumerate(r["classes"]):
            colour = _CLASS_COLOURS[c % len(_CLASS_COLOURS)]
            fraction = [
                point[0] * service_s / cap if cap else 0.0
                for point, cap in zip(timeline, capacity, strict=True)
            ]
            wait = _smoothed([1000 * point[1] for point in timeline], smooth)
            top_wait = max([top_wait, *wait])
            kw = {"color": colour, "ls": ("-", "--")[g], "lw": 2.5 - g, "alpha": 0.9}
            by_class.plot(
                times,
                _smoothed(fraction, smooth),
                label=f"{name}, {labels[g]}: goodput {goodput:.2f}",
                **kw,
            )
            waits.plot(
                times, wait, label=f"{name}, {labels[g]}: p99 {p99_wait * 1000:.0f} ms", **kw
            )
    # Room above the lines for the legends.
    by_class.set_ylabel("goodput per class\n(fraction of capacity)")
    by_class.set_ylim(0, 1.45)
    by_class.legend(loc="upper center", fontsize="small", ncol=2, frameon=False)
    waits.set_ylabel("mean queue wait\nper class (ms)")
    waits.set_ylim(0, max(top_wait, 1.0) * 1.45)
    waits.legend(loc="upper center", fontsize="small", ncol=2, frameon=False)


def expected_arrivals(args: argparse.Namespace) -> float:
    """About how many arrivals one gate's run simulates: the offered rate (``--load`` x the
    first capacity / the service time) over ``--duration``."""
    first_capacity = args.capacity[0][1]
    return args.load * first_capacity / (args.service_ms / 1000) * args.duration


def main(argv: Sequence[str] | None = None, prog: str = "python -m admitgate simulate") -> int:
    """Runs the comparison; exit code 2 for a usage or configuration error."""
    parser = _parser(prog)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    arrivals = expected_arrivals(args)
    if arrivals > MAX_ARRIVALS:
        parser.error(
            f"--load {args.load:g} x capacity {args.capacity[0][1]} / --service-ms "
            f"{args.service_ms:g} x --duration {args.duration:g} would simulate about "
            f"{arrivals:.3g} arrivals per gate, more than {MAX_ARRIVALS:,}: lower --load, "
            "--capacity or --duration, or raise --service-ms"
        )
    if len(args.classes) > MAX_CLASSES:
        parser.error(f"--class: at most {MAX_CLASSES} classes, got {len(args.classes)}")
    names = [c["name"] for c in args.classes]
    if len(set(names)) != len(names):
        parser.error(f"--class: a class is named twice in {', '.join(names)}")
    if sum(c["min"] for c in args.classes) > 1 + 1e-9:
        parser.error("--class: the classes' min shares sum above 1")
    given = sum(c["share"] or 0.0 for c in args.classes)
    unshared = [c for c in args.classes if c["share"] is None]
    if given > 1 + 1e-9 or (given >= 1 - 1e-9 and unshared):
        parser.error(
            f"--class: the shares of the arrivals sum to {given:g}, leaving nothing for "
            f"{', '.join(c['name'] for c in unshared)}"
            if unshared
            else f"--class: the shares of the arrivals sum to {given:g}, above 1"
        )
    for c in unshared:
        c["share"] = (1 - given) / len(unshared)
    if args.default_priority is not None and args.default_priority not in names:
        parser.error(
            f"--default-priority {args.default_priority!r} is not a --class"
            + (f" ({', '.join(names)})" if names else "")
        )
    if args.png and (why := _png_ready(args.png)):
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 2
    try:
        yours = _your_gate(args)
    except (OSError, ValueError, ImportError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    scenario = {
        "name": "simulate",
        "capacity": args.capacity,
        "service_s": args.service_ms / 1000,
        "service_sigma": args.service_sigma,
        "refusal_s": min(0.001, args.service_ms / 1000 / 20),
        "patience_s": args.patience,
        "load": args.load,
        "send_deadline": args.deadlines,
        "duration_s": args.duration,
        "seed": args.seed,
        "traffic": [(c["name"], c["share"], c["patience"]) for c in args.classes],
        "tenants": args.tenants,
    }
    reports = _admitgate._simulate(scenario, candidates(yours, args.baselines))
    capacity_s = 0.0
    for i, (start, capacity) in enumerate(args.capacity):
        end = args.capacity[i + 1][0] if i + 1 < len(args.capacity) else args.duration
        capacity_s += capacity * max(0.0, min(end, args.duration) - start)
    physical = capacity_s / (args.service_ms / 1000) / args.duration
    capacities = " -> ".join(f"{c}@{s:g}s" for s, c in args.capacity)
    title = (
        f"provider {capacities} x {args.service_ms:g} ms, clients {args.patience:g} s patience"
        f"{' (deadlines)' if args.deadlines else ''}, {args.load:g}x load, {args.duration:g} s"
    )
    print(title)
    print(f"the most the provider can serve: {physical:.1f} turns/s\n")
    print(table(reports, physical))
    if args.classes:
        print()
        print(class_table(reports, physical, args.duration))
    if args.png:
        _png(args.png, reports, title, args.service_ms / 1000)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
