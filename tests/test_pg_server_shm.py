"""The test servers (tests/pg_server.py, the Citus nodes too) keep their dynamic shared memory
in their data directory: a SIGKILLed server (`PgServer.kill`, the fault tests) left its
`/dev/shm/PostgreSQL.*` segments behind for good, hundreds after many runs."""

from __future__ import annotations

from pathlib import Path

from tests.pg_server import PgServer
from tests.postgres_fixture import own_server

__all__ = ["own_server"]


def mapped_files(pid: int) -> set[str]:
    return {
        line.split(maxsplit=5)[5]
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if len(line.split(maxsplit=5)) == 6
    }


def test_dynamic_shared_memory_lives_in_the_data_directory(own_server: PgServer) -> None:
    # A parallel query (its workers share DSM segments) still runs, with workers.
    plan = own_server.psql(
        "CREATE TABLE t AS SELECT g FROM generate_series(1, 100000) g; "
        "SET parallel_setup_cost = 0; SET parallel_tuple_cost = 0; "
        "SET min_parallel_table_scan_size = 0; SET max_parallel_workers_per_gather = 2; "
        "EXPLAIN (ANALYZE, COSTS OFF) SELECT count(*) FROM t"
    )
    assert "Workers Launched: 0" not in plan and "Workers Launched: " in plan, plan
    # The postmaster maps its DSM control segment: a file under the data directory.
    mapped = mapped_files(own_server.pid)
    assert not [f for f in mapped if f.startswith("/dev/shm/PostgreSQL.")], mapped
    dynshmem = own_server.data / "pg_dynshmem"
    assert [f for f in mapped if f.startswith(f"{dynshmem}/mmap.")], mapped
    assert own_server.psql("SHOW dynamic_shared_memory_type").strip() == "mmap"
    # A SIGKILL leaves the files there, in the temporary directory `cleanup` removes.
    own_server.kill()
    assert list(dynshmem.iterdir())


def _shared_memory_ids() -> set[str]:
    with open("/proc/sysvipc/shm") as table:
        return {line.split()[1] for line in table.readlines()[1:]}


def test_cleanup_after_a_kill_removes_the_system_v_block() -> None:
    """A SIGKILLed postmaster leaves its System V shared memory block (a restart removes it);
    `cleanup` removes it with the data directory, rather than one more leak per killed test
    server."""
    server = PgServer()
    try:
        server.start()
        key_and_id = (server.data / "postmaster.pid").read_text().splitlines()[6].split()
        block = key_and_id[1]
        assert block in _shared_memory_ids()
        server.kill()
        assert block in _shared_memory_ids()  # the kill leaves it
    finally:
        server.cleanup()
    assert block not in _shared_memory_ids()


def test_a_citus_cluster_cleanup_removes_its_nodes_system_v_blocks() -> None:
    """`CitusCluster.cleanup` kills its nodes and removes their directories: their blocks go
    with them, rather than three leaked blocks per cluster."""
    import pytest
    from tests.citus_fixture import require_citus
    from tests.pg_server import CitusCluster, PgServerUnavailable

    try:
        cluster = CitusCluster(workers=1)
    except PgServerUnavailable as exc:  # in CI (or when required) a failure, never a skip
        if require_citus():
            pytest.fail(f"a Citus cluster is required here but could not start: {exc}")
        pytest.skip(f"Citus unavailable: {exc}")
    try:
        cluster.start()
        blocks = {
            (node.data / "postmaster.pid").read_text().splitlines()[6].split()[1]
            for node in cluster.nodes
        }
        assert blocks <= _shared_memory_ids()
    finally:
        cluster.cleanup()
    assert not blocks & _shared_memory_ids()
