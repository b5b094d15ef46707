"""Store operations as OpenTelemetry instruments, read through the SDK and a Prometheus scrape.

The expected figures are counted from the workload each test runs (which calls succeed, which
raise what), never read back from the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.test_ledger import make_commit

from tokencapture import metrics
from tokencapture.ledger import FileCaptureLedger
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.protocols import TokenCaptureConflictError, TokenCaptureFrozenError
from tokencapture.reference import TokenCaptureStore as ReferenceStore
from tokencapture.store import TokenCaptureStore

if not os.environ.get("CI"):  # the test extra installs them: missing in CI is a failure
    pytest.importorskip("opentelemetry.sdk.metrics", reason="pip install 'tokencapture[test]'")
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the test extra has it")
    pytest.importorskip("prometheus_client", reason="the test extra has it")

import prometheus_client
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]

# 16 µs doubling: the bucket bounds the instruments advise (the same as `stats()` uses).
BOUNDS = tuple(16e-6 * 2**i for i in range(21))

CONFLICT = "tokencapture.protocols.TokenCaptureConflictError"
FROZEN = "tokencapture.protocols.TokenCaptureFrozenError"

Key = tuple[tuple[str, str], ...]


def key(store: str, backend: str, operation: str, outcome: str = "success", error: str = "") -> Key:
    attributes = {
        "tokencapture.store": store,
        "tokencapture.backend": backend,
        "tokencapture.operation": operation,
        "tokencapture.outcome": outcome,
    }
    if error:
        attributes["error.type"] = error
    return tuple(sorted(attributes.items()))


def python_path() -> str:
    """PYTHONPATH for a child that imports `tests` from this checkout."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def run_script(script: str, **env: str) -> str:
    """Run `script` in a child Python importing this checkout; its stripped stdout (it must
    exit 0)."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path(), **env},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    """An SDK provider with an in-memory reader, made every store's provider for the test."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use_meter_provider(provider)
    try:
        yield reader
    finally:
        metrics.use_meter_provider(None)
        provider.shutdown()


def read(reader: InMemoryMetricReader) -> dict[str, Any]:
    """{instrument name: (unit, {attributes: counter value or histogram point})}."""
    found: dict[str, Any] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "tokencapture"
            for metric in scope.metrics:
                points: dict[Key, Any] = {}
                for point in metric.data.data_points:
                    assert point.attributes is not None
                    attributes = tuple(sorted((k, str(v)) for k, v in point.attributes.items()))
                    if isinstance(point, HistogramDataPoint):
                        points[attributes] = point
                    else:
                        assert isinstance(point, NumberDataPoint)
                        points[attributes] = point.value
                found[metric.name] = (metric.unit, points)
    return found


async def run_workload(root: Path) -> None:
    """Puts, a conflict, a refused put, freeze, drop, resolve, on four stores."""
    store = TokenCaptureStore(root)
    store.append(make_entry("r", call=1))
    await store.put(make_entry("r", call=2))
    await store.put(make_entry("r", call=2))  # the same entry again: a success
    with pytest.raises(TokenCaptureConflictError):
        await store.put(make_entry("r", call=1, generation_log_probs=[-1.0, -2.0]))
    with pytest.raises(ValueError, match="rollout_id"):
        store.append(make_entry("bad/id", call=1))
    snapshot = await store.freeze("r")
    with pytest.raises(TokenCaptureFrozenError):
        await store.put(make_entry("r", call=3))
    assert await store.drop("r", snapshot.snapshot_id, snapshot.version)

    lineage = FileLineageStore(root)
    await lineage.resolve("r", [{"role": "user", "content": "hello"}])
    lineage.resolve_now("r", [{"role": "user", "content": "hello"}])

    memory = InMemoryLineageStore()
    await memory.put(make_entry("m", call=1))
    await memory.resolve("m", [])

    reference = ReferenceStore(root / "reference")
    await reference.put(make_entry("r", call=1))
    with pytest.raises(TokenCaptureConflictError):
        reference.append(make_entry("r", call=1, generation_log_probs=[-1.0, -2.0]))


async def test_workload_counts_failures_and_latencies(
    tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    await run_workload(tmp_path)
    expected = {
        key("token_capture", "file", "put"): 3,
        key("token_capture", "file", "put", "conflict", CONFLICT): 1,
        key("token_capture", "file", "put", "invalid_input", "ValueError"): 1,
        key("token_capture", "file", "put", "frozen", FROZEN): 1,
        key("token_capture", "file", "freeze"): 1,
        key("token_capture", "file", "drop"): 1,
        key("lineage", "file", "resolve"): 2,
        key("lineage", "memory", "put"): 1,
        key("lineage", "memory", "resolve"): 1,
        key("token_capture", "reference", "put"): 1,
        key("token_capture", "reference", "put", "conflict", CONFLICT): 1,
    }
    found = read(reader)
    assert set(found) == {"tokencapture.operations", "tokencapture.operation.duration"}

    unit, counts = found["tokencapture.operations"]
    assert unit == "{operation}"
    assert counts == expected

    unit, histograms = found["tokencapture.operation.duration"]
    assert unit == "s"
    assert {attributes: point.count for attributes, point in histograms.items()} == expected
    for point in histograms.values():
        assert tuple(point.explicit_bounds) == BOUNDS
        assert sum(point.bucket_counts) == point.count
        assert 0 < point.min <= point.max <= point.sum < 60


async def test_otel_agrees_with_stats(tmp_path: Path, reader: InMemoryMetricReader) -> None:
    store = TokenCaptureStore(tmp_path)
    for call in range(5):
        await store.put(make_entry("r", call=call))
    with pytest.raises(TokenCaptureConflictError):
        store.append(make_entry("r", call=0, generation_log_probs=[-1.0, -2.0]))
    await store.mark_incomplete("r", "lost")
    stats = store.stats()
    _, histograms = read(reader)["tokencapture.operation.duration"]
    ok = histograms[key("token_capture", "file", "put")]
    conflict = histograms[key("token_capture", "file", "put", "conflict", CONFLICT)]
    assert (stats["put"]["count"], stats["put"]["failures"]) == (6, 1)
    assert (ok.count, conflict.count) == (5, 1)
    assert ok.sum + conflict.sum == pytest.approx(stats["put"]["total_seconds"])
    assert max(ok.max, conflict.max) == pytest.approx(stats["put"]["max_seconds"])
    # The same bounds, so the same buckets (both put a value equal to a bound in its bucket).
    merged = [a + b for a, b in zip(ok.bucket_counts, conflict.bucket_counts, strict=True)]
    assert merged == stats["put"]["buckets"]
    assert histograms[key("token_capture", "file", "mark_incomplete")].count == 1


async def test_every_operation_counts_once_sync_and_async(
    tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    """Each public operation of the stores without `stats()` is counted once per call, whether
    called sync or async (an async twin delegating to a timed sync one must not count twice)."""
    items = [{"role": "user", "content": "question"}]

    ledger = FileCaptureLedger(tmp_path / "ledger")
    ledger.record_now(make_commit("c1"))
    await ledger.record(make_commit("c2"))
    ledger.record_failure_now("r1", "c3", "lost")
    await ledger.record_failure("r1", "c4", "lost")
    ledger.manifest_now("r1")
    await ledger.manifest("r1")
    ledger.has_rows_now("r1")
    await ledger.has_rows("r1")
    ledger.resolve_now("r1", items)
    await ledger.resolve("r1", items)
    ledger.retire_now(["r1"])
    await ledger.retire(["r2"])
    ledger.delete_now(["r1"])
    await ledger.delete(["r2"])

    memory = InMemoryLineageStore()
    memory.put_now(make_entry("m", call=1))
    await memory.put(make_entry("m", call=2))
    memory.resolve_now("m", items)
    await memory.resolve("m", items)
    memory.delete_now(["m"])
    await memory.delete(["m"])

    reference = ReferenceStore(tmp_path / "reference")
    reference.append(make_entry("r", call=1))
    await reference.put(make_entry("r", call=2))
    reference._begin_call("r", "c9")
    await reference.begin_call("r", "c10")
    reference._mark_incomplete("r", "c9")
    await reference.mark_incomplete("r", "c10")
    reference.freeze_now("r")
    snapshot = await reference.freeze("r")
    assert not reference._drop("r", snapshot.snapshot_id, snapshot.version + 1)
    assert await reference.drop("r", snapshot.snapshot_id, snapshot.version)
    reference.retire_now(["r"])
    await reference.retire(["s"])
    reference.delete_now(["r"])
    await reference.delete(["s"])

    _, counts = read(reader)["tokencapture.operations"]
    expected = {
        **{
            key("ledger", "file", operation): 2
            for operation in (
                "record",
                "record_failure",
                "manifest",
                "has_rows",
                "resolve",
                "retire",
                "delete",
            )
        },
        **{key("lineage", "memory", operation): 2 for operation in ("put", "resolve", "delete")},
        **{
            key("token_capture", "reference", operation): 2
            for operation in (
                "put",
                "begin_call",
                "mark_incomplete",
                "freeze",
                "drop",
                "retire",
                "delete",
            )
        },
    }
    assert counts == expected


async def test_explicit_meter_provider_pins_a_store(tmp_path: Path) -> None:
    """`Metrics(meter_provider=...)` records into that provider only, whatever the default."""
    pinned_reader, default_reader = InMemoryMetricReader(), InMemoryMetricReader()
    pinned = MeterProvider(metric_readers=[pinned_reader])
    default = MeterProvider(metric_readers=[default_reader])
    metrics.use_meter_provider(default)
    try:
        pinned_metrics = metrics.Metrics("postgres", meter_provider=pinned)
        with pinned_metrics.timed("put"):
            pass
        with pytest.raises(KeyError), pinned_metrics.timed("freeze"):
            raise KeyError("x")
        metrics.Metrics().observe("put", 0.5)
        _, pinned_counts = read(pinned_reader)["tokencapture.operations"]
        _, default_counts = read(default_reader)["tokencapture.operations"]
    finally:
        metrics.use_meter_provider(None)
        pinned.shutdown()
        default.shutdown()
    assert pinned_counts == {
        key("token_capture", "postgres", "put"): 1,
        key("token_capture", "postgres", "freeze", "error", "KeyError"): 1,
    }
    assert default_counts == {key("token_capture", "file", "put"): 1}


async def test_prometheus_scrape_through_the_exporter(tmp_path: Path) -> None:
    """The standard OpenTelemetry Prometheus exporter serves the instruments to a scrape."""
    registry = CollectorRegistry()
    try:
        prometheus = PrometheusMetricReader(registry=registry)
    except TypeError:  # an exporter older than its `registry` argument: the global registry
        prometheus, registry = PrometheusMetricReader(), prometheus_client.REGISTRY
    provider = MeterProvider(metric_readers=[prometheus])
    metrics.use_meter_provider(provider)
    try:
        await run_workload(tmp_path)
        text = generate_latest(registry).decode()
    finally:
        metrics.use_meter_provider(None)
        provider.shutdown()

    samples: dict[tuple[str, Key], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kept = tuple(
                sorted(
                    (name, value)
                    for name, value in sample.labels.items()
                    if name.startswith("tokencapture_") or (name == "error_type" and value)
                )
            )
            samples[sample.name, kept] = sample.value

    def labels(operation: str, outcome: str = "success", error: str = "") -> Key:
        found = {
            "tokencapture_store": "token_capture",
            "tokencapture_backend": "file",
            "tokencapture_operation": operation,
            "tokencapture_outcome": outcome,
        }
        if error:
            found["error_type"] = error
        return tuple(sorted(found.items()))

    put, conflict = labels("put"), labels("put", "conflict", CONFLICT)
    assert samples["tokencapture_operations_total", put] == 3
    assert samples["tokencapture_operations_total", conflict] == 1
    assert samples["tokencapture_operations_total", labels("freeze")] == 1
    assert samples["tokencapture_operation_duration_seconds_count", put] == 3
    assert samples["tokencapture_operation_duration_seconds_count", labels("drop")] == 1
    assert samples["tokencapture_operation_duration_seconds_sum", put] > 0
    assert "# TYPE tokencapture_operation_duration_seconds histogram" in text
    assert "# TYPE tokencapture_operations_total counter" in text


def test_nothing_is_imported_or_reported_without_opentelemetry(tmp_path: Path) -> None:
    """With `opentelemetry` unimportable, the stores work, `stats()` counts, and no module of
    OpenTelemetry is loaded."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Block())

        import tokencapture
        from tokencapture import metrics
        from tokencapture.lineage import InMemoryLineageStore
        from tokencapture.reference import TokenCaptureStore as ReferenceStore
        from tests.conftest import make_entry

        async def main():
            store = tokencapture.TokenCaptureStore({str(tmp_path)!r})
            for call in range(3):
                await store.put(make_entry("r", call=call))
            await store.freeze("r")
            await ReferenceStore({str(tmp_path / "ref")!r}).put(make_entry("r"))
            await InMemoryLineageStore().put(make_entry("r"))
            return store.stats()

        stats = asyncio.run(main())
        assert stats["put"]["count"] == 3 and stats["freeze"]["count"] == 1, stats
        assert not metrics.otel_enabled()
        assert InMemoryLineageStore.put_now.__code__.co_name == "put_now"
        try:
            metrics.use_meter_provider(object())
        except ImportError as exc:
            assert "tokencapture[otel]" in str(exc)
        else:
            raise AssertionError("use_meter_provider without OpenTelemetry did not raise")
        loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
        assert not loaded, loaded
        print("ok")
        """
    )
    assert run_script(script) == "ok"


def test_the_global_meter_provider_is_the_default(tmp_path: Path) -> None:
    """Stores made before the application sets the global provider report into it too."""
    script = textwrap.dedent(
        f"""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from tokencapture import TokenCaptureStore
        from tokencapture.lineage import InMemoryLineageStore
        from tests.conftest import make_entry

        store = TokenCaptureStore({str(tmp_path)!r})  # before the provider is set
        memory = InMemoryLineageStore()
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        store.append(make_entry("r", call=1))
        store.append(make_entry("r", call=2))
        memory.put_now(make_entry("r", call=1))
        found = {{}}
        for resource in reader.get_metrics_data().resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        kind = point.attributes["tokencapture.store"]
                        where = (kind, point.attributes["tokencapture.operation"])
                        found[metric.name, where] = getattr(point, "value", None) or point.count
        print(sorted(found.items()))
        """
    )
    assert run_script(script) == str(
        sorted(
            {
                ("tokencapture.operation.duration", ("lineage", "put")): 1,
                ("tokencapture.operation.duration", ("token_capture", "put")): 2,
                ("tokencapture.operations", ("lineage", "put")): 1,
                ("tokencapture.operations", ("token_capture", "put")): 2,
            }.items()
        )
    )


async def test_a_new_backend_names_itself(reader: InMemoryMetricReader) -> None:
    """The PostgreSQL store keeps a `Metrics("postgres")`: its failed put (no server listens on
    port 1) is reported under its own backend, as an I/O error."""
    pytest.importorskip("asyncpg", reason="the postgres extra is not installed")
    from tokencapture.postgres import PostgresTokenCaptureStore

    store = PostgresTokenCaptureStore("postgresql://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(OSError, match="unavailable"):
            await store.put(make_entry("r", call=1))
    finally:
        await store.close()
    _, counts = read(reader)["tokencapture.operations"]
    unavailable = "tokencapture.postgres._client.PostgresUnavailableError"
    assert counts == {key("token_capture", "postgres", "put", "io_error", unavailable): 1}


def test_tokencapture_otel_0_turns_it_off_with_the_package_installed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from tokencapture import TokenCaptureStore, metrics
        from tokencapture.lineage import InMemoryLineageStore
        from tests.conftest import make_entry

        TokenCaptureStore({str(tmp_path)!r}).append(make_entry("r"))
        assert not metrics.otel_enabled()
        assert InMemoryLineageStore.put_now.__code__.co_name == "put_now"
        assert not [name for name in sys.modules if name.startswith("opentelemetry")]
        print("ok")
        """
    )
    assert run_script(script, TOKENCAPTURE_OTEL="0") == "ok"


def test_writes_refused_when_called_count_as_failures(tmp_path: Path) -> None:
    """A `begin_call` or `mark_incomplete` refused by the checks it makes when called (nothing
    ran) counts as a failed operation of its name, as any failed one."""
    store = TokenCaptureStore(tmp_path)
    with pytest.raises(ValueError):
        store.begin_call("../bad", "c")
    with pytest.raises(ValueError):
        store.begin_call_unless_stored("r", "bad\nid")
    with pytest.raises(ValueError):
        store.mark_incomplete("../bad")
    with pytest.raises(ValueError):
        store.mark_incomplete_if_open("../bad", "c")
    stats = store.stats()
    assert (stats["begin_call"]["count"], stats["begin_call"]["failures"]) == (2, 2)
    assert (stats["mark_incomplete"]["count"], stats["mark_incomplete"]["failures"]) == (2, 2)
