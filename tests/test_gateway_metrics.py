"""The gateway's calls in the OpenTelemetry instruments (docs/metrics.md): besides the store's
attributes, each data point of a call whose answer's status is known carries
`http.response.status_code` (an int), so failures are told apart by status. Read through the
SDK's in-memory reader, against the fake upstream served from a thread of the test process."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

if not os.environ.get("CI"):  # the test extra installs it: missing in CI is a failure
    pytest.importorskip("opentelemetry.sdk.metrics", reason="pip install 'tokencapture[test]'")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from tests.fake_upstream import MODEL, FakeUpstream
from tests.test_gateway import Harness, _user
from tests.test_gateway_disconnect import Served, _leave_after

from tokencapture import metrics

STATUS = "http.response.status_code"


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    if not metrics.otel_enabled():
        pytest.skip("OpenTelemetry is disabled in this process (TOKENCAPTURE_OTEL)")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use_meter_provider(provider)
    try:
        yield reader
    finally:
        metrics.use_meter_provider(None)
        provider.shutdown()


@pytest.fixture
async def gw(tmp_path: Path, reader: InMemoryMetricReader) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path / "store", FakeUpstream())
    yield harness
    await harness.close()


Point = tuple[str, str, Any]  # (operation, outcome, status or None)


def _gateway_data_points(
    reader: InMemoryMetricReader,
) -> Iterator[tuple[dict[str, Any], HistogramDataPoint | NumberDataPoint]]:
    """Every data point of the gateway's instruments, with its attributes."""
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if attributes.get("tokencapture.store") == "gateway":
                        assert isinstance(point, HistogramDataPoint | NumberDataPoint)
                        yield attributes, point


def gateway_points(reader: InMemoryMetricReader) -> tuple[Counter[Point], Counter[Point]]:
    """The gateway's (histogram counts, counter values) by (operation, outcome, status)."""
    histogram: Counter[Point] = Counter()
    counter: Counter[Point] = Counter()
    for attributes, point in _gateway_data_points(reader):
        status = attributes.get(STATUS)
        assert status is None or type(status) is int  # the convention's int
        found = (attributes["tokencapture.operation"], attributes["tokencapture.outcome"], status)
        if isinstance(point, HistogramDataPoint):
            histogram[found] += point.count
        else:
            counter[found] += int(point.value)
    return histogram, counter


def gateway_error_types(reader: InMemoryMetricReader) -> Counter[tuple[str, Any, str]]:
    """The gateway's failed calls in the histogram by (operation, status, `error.type`)."""
    found: Counter[tuple[str, Any, str]] = Counter()
    for attributes, point in _gateway_data_points(reader):
        if isinstance(point, HistogramDataPoint) and "error.type" in attributes:
            operation = attributes["tokencapture.operation"]
            found[(operation, attributes.get(STATUS), attributes["error.type"])] += point.count
    return found


async def test_gateway_calls_carry_their_http_status(
    gw: Harness, reader: InMemoryMetricReader
) -> None:
    """A 200, an engine's 400 and 500 (passed through), a gateway's own 400 (an invalid call
    id), a replay, streams (whole or broken: their status line said 200) and passthroughs
    each count under their status; the store's attributes are kept, and the counter agrees
    with the histogram for every attribute set."""
    assert (await gw.chat("r1", [_user("hi")], call="c1")).status_code == 200
    assert (await gw.chat("r1", [_user("hi")], call="c1")).status_code == 200  # a replay
    assert (await gw.chat("r2", [_user("x")], fake_status=400)).status_code == 400
    assert (await gw.chat("r3", [_user("x")], fake_status=500)).status_code == 500
    refused = await gw.client.post(
        "/rollouts/r4/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("x")]},
        headers={"x-model-call-id": ""},
    )
    assert refused.status_code == 400
    stream = await gw.chat("r5", [_user("y")], stream=True)
    assert stream.status_code == 200
    # A stream the engine broke: its status line (200) had gone; a failure under it.
    broken = await gw.chat("r6", [_user("y")], stream=True, fake_break_after=1)
    assert broken.status_code == 200 and "[DONE]" not in broken.text
    passed = await gw.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [_user("z")], "fake_status": 503},
    )
    assert passed.status_code == 503
    assert (await gw.client.get("/v1/models")).status_code == 200

    histogram, counter = gateway_points(reader)
    assert histogram == {
        ("chat_completions", "success", 200): 3,  # the first call, its retry, the stream
        ("replay", "success", 200): 1,
        ("chat_completions", "error", 400): 2,  # the engine's and the gateway's own
        ("chat_completions", "error", 500): 1,
        ("chat_completions", "error", 200): 1,  # the broken stream
        ("passthrough", "error", 503): 1,
        ("passthrough", "success", 200): 1,
    }
    assert counter == histogram
    assert gateway_error_types(reader) == {
        ("chat_completions", 400, "400"): 1,  # the engine's, relayed: the status code
        ("chat_completions", 400, "invalid_request_error"): 1,  # the gateway's own
        ("chat_completions", 500, "500"): 1,
        ("chat_completions", 200, "_OTHER"): 1,  # the broken stream: no error status
        ("passthrough", 503, "503"): 1,
    }
    # `stats()` is as before: by operation only.
    stats = gw.app.state.gateway.metrics.snapshot()
    assert (stats["chat_completions"]["count"], stats["chat_completions"]["failures"]) == (7, 4)


async def test_a_client_that_left_is_counted_as_client_gone(
    tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    """A captured call and a passthrough whose client left while the engine worked: both
    499 with `error.type` `client_gone` (the answer's error type), never a class name."""
    served = Served(tmp_path / "store")
    try:
        for path, call in (
            ("/rollouts/left/v1/chat/completions", "chat_completions"),
            ("/v1/chat/completions", "passthrough"),
        ):
            body = {"model": MODEL, "messages": [_user("slow")], "fake_delay": 5}
            await _leave_after(served.gateway.url, path, body, 0.5)
            await served.counted(call)
    finally:
        served.stop()
    assert gateway_error_types(reader) == {
        ("chat_completions", 499, "client_gone"): 1,
        ("passthrough", 499, "client_gone"): 1,
    }
