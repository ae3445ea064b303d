"""docs/broker.md against the real broker: every metric family it exports is named there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from _broker import BrokerProcess, build_broker


@pytest.fixture(scope="module")
def binary() -> Any:
    return build_broker()


def test_the_broker_page_names_every_metric_family_it_exports(binary: Any) -> None:
    """Issue 27: docs/broker.md omitted broker_queue_depth and broker_gate_in_flight."""
    broker = BrokerProcess(binary, "--upstream", "http://127.0.0.1:9", "--max-in-flight", "1")
    try:
        text = httpx.get(f"{broker.metrics_url}/metrics", timeout=5).text
    finally:
        assert broker.stop() == 0
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert "broker_queue_depth" in families and "broker_gate_in_flight" in families
    page = (Path(__file__).resolve().parent.parent / "docs" / "broker.md").read_text()
    missing = [
        name
        for name in sorted(families)
        if f"`{name}" not in page and not name.startswith("broker_fleet_")  # `broker_fleet_*`
    ]
    assert missing == [], missing
