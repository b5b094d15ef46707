"""Store operations as OpenTelemetry instruments, read through the SDK and a Prometheus scrape.

The expected figures are counted from the workload each test runs (which calls succeed, which
raise what), never read back from the code under test.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry
from tests.test_ledger import assistant, make_commit, user

from tokencapture import metrics
from tokencapture.ledger import FileCaptureLedger
from tokencapture.lineage import FileLineageStore, InMemoryLineageStore
from tokencapture.protocols import TokenCaptureConflictError, TokenCaptureFrozenError
from tokencapture.records import ParentResolutionStatus
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


# The end of a child script: what its `reader` collected, by (instrument, (store kind,
# operation)), printed sorted (a counter's value, a histogram's count).
PRINT_BY_STORE_AND_OPERATION = textwrap.dedent(
    """
    found = {}
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
    script = (
        textwrap.dedent(
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
        """
        )
        + PRINT_BY_STORE_AND_OPERATION
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


async def test_a_resolve_the_capture_ledger_answers_counts_once(
    tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    """A `FileLineageStore` resolve that its capture ledger answers (`resolve_now` of the
    ledger, inside the resolve) is one call: one `lineage` resolve, no `ledger` one."""
    lineage = FileLineageStore(tmp_path)
    await lineage.record(make_commit("c1", "r1"))
    items = [user("question"), assistant("answer of c1"), user("next")]
    assert (await lineage.resolve("r1", items)).status is ParentResolutionStatus.RESOLVED
    assert lineage.resolve_now("r1", items).status is ParentResolutionStatus.RESOLVED
    _, counts = read(reader)["tokencapture.operations"]
    _, histograms = read(reader)["tokencapture.operation.duration"]
    expected = {key("ledger", "file", "record"): 1, key("lineage", "file", "resolve"): 2}
    assert counts == expected
    assert {attributes: point.count for attributes, point in histograms.items()} == expected


BAD = "bad/id"


def unreachable_postgres(_: Path) -> Any:
    """A PostgreSQL store no call here reaches: nothing listens on its port."""
    from tokencapture.postgres import PostgresTokenCaptureStore

    return PostgresTokenCaptureStore("postgresql://tc@127.0.0.1:1/none", connect_timeout=1)


RESOLVE_ITEMS = [{"role": "user", "content": "question"}]

# (store kind, backend, operation, the store's class, the call): every call is refused when
# it is called (an invalid rollout id, `ValueError`), awaited or not; sync and async twins.
REFUSED: list[tuple[str, str, str, Any, Any]] = [
    ("token_capture", "file", "put", TokenCaptureStore, lambda s: s.append(make_entry(BAD))),
    ("token_capture", "file", "put", TokenCaptureStore, lambda s: s.put(make_entry(BAD))),
    (
        "token_capture",
        "file",
        "put",
        TokenCaptureStore,
        lambda s: s.put_unless_stored(make_entry(BAD)),
    ),
    ("token_capture", "file", "begin_call", TokenCaptureStore, lambda s: s._begin_call(BAD, "c")),
    ("token_capture", "file", "begin_call", TokenCaptureStore, lambda s: s.begin_call(BAD, "c")),
    (
        "token_capture",
        "file",
        "begin_call",
        TokenCaptureStore,
        lambda s: s.begin_call_unless_stored(BAD, "c"),
    ),
    (
        "token_capture",
        "file",
        "mark_incomplete",
        TokenCaptureStore,
        lambda s: s._mark_incomplete(BAD),
    ),
    (
        "token_capture",
        "file",
        "mark_incomplete",
        TokenCaptureStore,
        lambda s: s.mark_incomplete(BAD),
    ),
    (
        "token_capture",
        "file",
        "mark_incomplete",
        TokenCaptureStore,
        lambda s: s.mark_incomplete_if_open(BAD),
    ),
    ("token_capture", "file", "freeze", TokenCaptureStore, lambda s: s.freeze_now(BAD)),
    ("token_capture", "file", "freeze", TokenCaptureStore, lambda s: s.freeze(BAD)),
    (
        "token_capture",
        "file",
        "freeze_columns",
        TokenCaptureStore,
        lambda s: s.freeze_columns_now(BAD),
    ),
    ("token_capture", "file", "freeze_columns", TokenCaptureStore, lambda s: s.freeze_columns(BAD)),
    ("token_capture", "file", "drop", TokenCaptureStore, lambda s: s._drop(BAD, "s", 1)),
    ("token_capture", "file", "drop", TokenCaptureStore, lambda s: s.drop(BAD, "s", 1)),
    ("token_capture", "file", "retire", TokenCaptureStore, lambda s: s.retire_now([BAD])),
    ("token_capture", "file", "retire", TokenCaptureStore, lambda s: s.retire([BAD])),
    ("token_capture", "file", "delete", TokenCaptureStore, lambda s: s.delete_now([BAD])),
    ("token_capture", "file", "delete", TokenCaptureStore, lambda s: s.delete([BAD])),
    (
        "token_capture",
        "file",
        "sweep_retired",
        TokenCaptureStore,
        lambda s: s.sweep_retired(float("nan")),
    ),
    ("token_capture", "reference", "put", ReferenceStore, lambda s: s.append(make_entry(BAD))),
    ("token_capture", "reference", "put", ReferenceStore, lambda s: s.put(make_entry(BAD))),
    (
        "token_capture",
        "reference",
        "begin_call",
        ReferenceStore,
        lambda s: s._begin_call(BAD, "c"),
    ),
    (
        "token_capture",
        "reference",
        "begin_call",
        ReferenceStore,
        lambda s: s.begin_call(BAD, "c"),
    ),
    (
        "token_capture",
        "reference",
        "mark_incomplete",
        ReferenceStore,
        lambda s: s._mark_incomplete(BAD),
    ),
    (
        "token_capture",
        "reference",
        "mark_incomplete",
        ReferenceStore,
        lambda s: s.mark_incomplete(BAD),
    ),
    ("token_capture", "reference", "freeze", ReferenceStore, lambda s: s.freeze_now(BAD)),
    ("token_capture", "reference", "freeze", ReferenceStore, lambda s: s.freeze(BAD)),
    ("token_capture", "reference", "drop", ReferenceStore, lambda s: s._drop(BAD, "s", 1)),
    ("token_capture", "reference", "drop", ReferenceStore, lambda s: s.drop(BAD, "s", 1)),
    ("token_capture", "reference", "retire", ReferenceStore, lambda s: s.retire_now([BAD])),
    ("token_capture", "reference", "retire", ReferenceStore, lambda s: s.retire([BAD])),
    ("token_capture", "reference", "delete", ReferenceStore, lambda s: s.delete_now([BAD])),
    ("token_capture", "reference", "delete", ReferenceStore, lambda s: s.delete([BAD])),
    ("ledger", "file", "record", FileCaptureLedger, lambda s: s.record_now(make_commit("c", BAD))),
    ("ledger", "file", "record", FileCaptureLedger, lambda s: s.record(make_commit("c", BAD))),
    (
        "ledger",
        "file",
        "record_failure",
        FileCaptureLedger,
        lambda s: s.record_failure_now(BAD, "c", "lost"),
    ),
    (
        "ledger",
        "file",
        "record_failure",
        FileCaptureLedger,
        lambda s: s.record_failure(BAD, "c", "lost"),
    ),
    ("ledger", "file", "manifest", FileCaptureLedger, lambda s: s.manifest_now(BAD)),
    ("ledger", "file", "manifest", FileCaptureLedger, lambda s: s.manifest(BAD)),
    ("ledger", "file", "has_rows", FileCaptureLedger, lambda s: s.has_rows_now(BAD)),
    ("ledger", "file", "has_rows", FileCaptureLedger, lambda s: s.has_rows(BAD)),
    (
        "ledger",
        "file",
        "resolve",
        FileCaptureLedger,
        lambda s: s.resolve_now(BAD, RESOLVE_ITEMS),
    ),
    ("ledger", "file", "resolve", FileCaptureLedger, lambda s: s.resolve(BAD, RESOLVE_ITEMS)),
    ("ledger", "file", "retire", FileCaptureLedger, lambda s: s.retire_now([BAD])),
    ("ledger", "file", "retire", FileCaptureLedger, lambda s: s.retire([BAD])),
    ("ledger", "file", "delete", FileCaptureLedger, lambda s: s.delete_now([BAD])),
    ("ledger", "file", "delete", FileCaptureLedger, lambda s: s.delete([BAD])),
    ("lineage", "file", "resolve", FileLineageStore, lambda s: s.resolve_now(BAD, RESOLVE_ITEMS)),
    ("lineage", "file", "resolve", FileLineageStore, lambda s: s.resolve(BAD, RESOLVE_ITEMS)),
    # The capture-ledger surface of a `FileLineageStore` is its ledger's (counted as that).
    ("ledger", "file", "manifest", FileLineageStore, lambda s: s.manifest(BAD)),
    ("ledger", "file", "retire", FileLineageStore, lambda s: s.retire([BAD])),
    ("lineage", "memory", "put", InMemoryLineageStore, lambda s: s.put_now(make_entry(BAD))),
    ("lineage", "memory", "put", InMemoryLineageStore, lambda s: s.put(make_entry(BAD))),
    (
        "lineage",
        "memory",
        "resolve",
        InMemoryLineageStore,
        lambda s: s.resolve_now(BAD, RESOLVE_ITEMS),
    ),
    (
        "lineage",
        "memory",
        "resolve",
        InMemoryLineageStore,
        lambda s: s.resolve(BAD, RESOLVE_ITEMS),
    ),
    ("lineage", "memory", "retire", InMemoryLineageStore, lambda s: s.retire_now([BAD])),
    ("lineage", "memory", "retire", InMemoryLineageStore, lambda s: s.retire([BAD])),
    ("lineage", "memory", "delete", InMemoryLineageStore, lambda s: s.delete_now([BAD])),
    ("lineage", "memory", "delete", InMemoryLineageStore, lambda s: s.delete([BAD])),
    # PostgreSQL: refused before any round trip (the server is never asked).
    *(
        ("token_capture", "postgres", operation, unreachable_postgres, call)
        for operation, call in [
            ("put", lambda s: s.put(make_entry(BAD))),
            ("begin_call", lambda s: s.begin_call(BAD, "c")),
            ("mark_incomplete", lambda s: s.mark_incomplete(BAD)),
            ("freeze", lambda s: s.freeze(BAD)),
            ("freeze", lambda s: s.freeze_now(BAD)),
            ("freeze_columns", lambda s: s.freeze_columns(BAD)),
            ("freeze_columns", lambda s: s.freeze_columns_now(BAD)),
            ("drop", lambda s: s.drop(BAD, "s", 1)),
            ("retire", lambda s: s.retire([BAD])),
            ("retire", lambda s: s.retire_now([BAD])),
            ("delete", lambda s: s.delete([BAD])),
            ("delete", lambda s: s.delete_now([BAD])),
        ]
    ),
]


@pytest.mark.parametrize(
    ("store", "backend", "operation", "make", "call"),
    REFUSED,
    ids=[
        f"{kind}-{backend}-{operation}-{index}"
        for index, (kind, backend, operation, *_) in enumerate(REFUSED)
    ],
)
def test_a_call_refused_when_called_counts_once_as_invalid_input(
    tmp_path: Path,
    reader: InMemoryMetricReader,
    store: str,
    backend: str,
    operation: str,
    make: Any,
    call: Any,
) -> None:
    """Every variant, sync or async, of every store: a call its checks refuse when it is called
    (before anything ran) is one failed call of its operation, outcome `invalid_input`."""
    target = make() if make is InMemoryLineageStore else make(tmp_path)
    with pytest.raises(ValueError):
        call(target)  # raises when called: no coroutine is left to await
    expected = {key(store, backend, operation, "invalid_input", "ValueError"): 1}
    found = read(reader)
    assert found["tokencapture.operations"][1] == expected
    histograms = found["tokencapture.operation.duration"][1]
    assert {attributes: point.count for attributes, point in histograms.items()} == expected
    if isinstance(target, TokenCaptureStore) or backend == "postgres":
        stats = target.stats()[operation]
        assert (stats["count"], stats["failures"]) == (1, 1)


def test_a_drop_of_a_version_no_store_holds_counts_as_a_drop(
    tmp_path: Path, reader: InMemoryMetricReader
) -> None:
    """`drop` with a version no stored one can equal answers False without asking the store;
    still one `drop` call (as the reference store counts it)."""
    store = TokenCaptureStore(tmp_path)
    assert not store._drop("r", "s", -1)
    assert not store._drop("r", "s", 2**64)
    _, counts = read(reader)["tokencapture.operations"]
    assert counts == {key("token_capture", "file", "drop"): 2}
    assert store.stats()["drop"]["count"] == 2


def test_a_pinned_counter_never_decreases_when_a_store_is_collected() -> None:
    """Stores pinned to one provider count into one total per (store kind, backend): a store
    closed and collected keeps its calls in it (a monotonic counter that went down would be a
    reset to Prometheus)."""
    pinned_reader = InMemoryMetricReader()
    pinned = MeterProvider(metric_readers=[pinned_reader])
    try:
        first = metrics.Metrics("postgres", meter_provider=pinned)
        for _ in range(5):
            first.observe("put", 0.001)
        assert read(pinned_reader)["tokencapture.operations"][1] == {
            key("token_capture", "postgres", "put"): 5
        }
        second = metrics.Metrics("postgres", meter_provider=pinned)
        del first
        gc.collect()
        second.observe("put", 0.001)
        found = read(pinned_reader)
    finally:
        pinned.shutdown()
    expected = {key("token_capture", "postgres", "put"): 6}
    assert found["tokencapture.operations"][1] == expected
    histograms = found["tokencapture.operation.duration"][1]
    assert {attributes: point.count for attributes, point in histograms.items()} == expected


def test_the_default_counter_never_decreases_across_providers(tmp_path: Path) -> None:
    """`use_meter_provider` away from a provider and back: that provider's counts go on from
    where they were, as its histogram's do."""
    first_reader, second_reader = InMemoryMetricReader(), InMemoryMetricReader()
    first = MeterProvider(metric_readers=[first_reader])
    second = MeterProvider(metric_readers=[second_reader])
    store = TokenCaptureStore(tmp_path)
    try:
        metrics.use_meter_provider(first)
        store.append(make_entry("r", call=1))
        store.append(make_entry("r", call=2))
        metrics.use_meter_provider(second)
        store.append(make_entry("r", call=3))
        assert read(first_reader)["tokencapture.operations"][1] == {
            key("token_capture", "file", "put"): 2
        }
        metrics.use_meter_provider(first)
        store.append(make_entry("r", call=4))
        found, found_second = read(first_reader), read(second_reader)
    finally:
        metrics.use_meter_provider(None)
        first.shutdown()
        second.shutdown()
    expected = {key("token_capture", "file", "put"): 3}
    assert found["tokencapture.operations"][1] == expected
    histograms = found["tokencapture.operation.duration"][1]
    assert {attributes: point.count for attributes, point in histograms.items()} == expected
    assert found_second["tokencapture.operations"][1] == {key("token_capture", "file", "put"): 1}


def test_calls_before_the_global_provider_is_set_are_in_neither_instrument(
    tmp_path: Path,
) -> None:
    """Measurements made before the application sets the global provider are dropped by the
    API's proxies: the counter does not count those calls either, so its count and the
    histogram's agree (puts before, puts after, a store made after)."""
    script = (
        textwrap.dedent(
            f"""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from tokencapture import TokenCaptureStore
        from tokencapture.lineage import InMemoryLineageStore
        from tests.conftest import make_entry

        store = TokenCaptureStore({str(tmp_path / "a")!r})
        memory = InMemoryLineageStore()
        for call in range(3):
            store.append(make_entry("r", call=call))
            memory.put_now(make_entry("r", call=call))
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        for call in range(3, 5):
            store.append(make_entry("r", call=call))
        TokenCaptureStore({str(tmp_path / "b")!r}).append(make_entry("r", call=1))
        memory.put_now(make_entry("r", call=9))
        """
        )
        + PRINT_BY_STORE_AND_OPERATION
    )
    assert run_script(script) == str(
        sorted(
            {
                ("tokencapture.operation.duration", ("lineage", "put")): 1,
                ("tokencapture.operation.duration", ("token_capture", "put")): 3,
                ("tokencapture.operations", ("lineage", "put")): 1,
                ("tokencapture.operations", ("token_capture", "put")): 3,
            }.items()
        )
    )
