"""A throwaway PostgreSQL server for the tests: initdb + postgres in a temporary directory.

The Debian package's binaries (`/usr/lib/postgresql/<major>/bin`) refuse to run as root, so a
root test run starts them as the `postgres` account the package creates. The data directory
and the unix socket directory live in one temporary directory (made traversable for that
account); the server also listens on a free loopback port. `fsync` and `synchronous_commit`
are on, as in production, and `shared_buffers` is PostgreSQL's default of 128 MB (the
benchmark's W2 rollouts hold ~40 MB of lines: at 32 MB a freeze read them back through the
OS page cache, 8 kB at a time). Dynamic shared memory (parallel queries' segments) is
`dynamic_shared_memory_type=mmap`: files in the data directory, not `/dev/shm` segments a
SIGKILL would leak. `kill()` is a SIGKILL of the postmaster and of its children,
listed while the postmaster is stopped (backends call `setsid`, so a process-group kill would
miss them, and a surviving child keeps the shared memory block that makes the restart fail).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.accounts import AccountUnavailable, account, children, processes

__all__ = [
    "CITUS_SETTINGS",
    "CitusCluster",
    "PgBouncer",
    "PgServer",
    "PgServerUnavailable",
    "find_bindir",
    "server_cpu_seconds",
]


class PgServerUnavailable(RuntimeError):
    """No PostgreSQL server could be started here (the reason says why)."""


def find_bindir() -> Path | None:
    """The newest installed `/usr/lib/postgresql/<major>/bin` that has initdb, or None."""
    override = os.environ.get("TOKENCAPTURE_PG_BINDIR")
    if override:
        return Path(override)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the postmaster `pid` and its reaped children (backends that
    exited), plus its live children's own: one pass over /proc. The benchmarks' server CPU."""
    total = 0
    for process, fields in processes():
        # utime, stime, cutime, cstime: fields 14-17 of stat(5) (11-14 here).
        if process == pid:
            total += sum(int(value) for value in fields[11:15])
        elif int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _await_ready(
    name: str,
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    timeout: float,
    log_tail: Callable[[], str],
) -> None:
    """Wait until `ready()` says a started server answers; its exit or the timeout is
    `PgServerUnavailable` with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PgServerUnavailable(f"{name} exited with {process.returncode}: {log_tail()}")
        if ready():
            return
        time.sleep(0.05)
    raise PgServerUnavailable(f"{name} was not ready in {timeout}s: {log_tail()}")


class PgServer:
    """One PostgreSQL cluster in a temporary directory; start/stop/kill/restart it."""

    def __init__(
        self,
        base: Path | None = None,
        bindir: Path | None = None,
        *,
        standby_of: PgServer | None = None,
        name: str = "",
        settings: dict[str, str] | None = None,
    ) -> None:
        found = bindir or find_bindir()
        if found is None or not (found / "initdb").exists():
            raise PgServerUnavailable(
                "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); "
                "apt-get install postgresql"
            )
        self.bindir = found
        # Server settings beyond the defaults below (`-c name=value`, given last so they win).
        self.settings = dict(settings or {})
        self._owns_base = base is None
        # As root the server runs as `postgres`, which must traverse every parent directory:
        # /tmp, whatever TMPDIR says (a TMPDIR under /root would not do).
        parent = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
        self.base = Path(base or tempfile.mkdtemp(prefix="tokencapture-pg-", dir=parent))
        self.data = self.base / "data"
        self.socket_dir = self.base / "socket"
        self.log = self.base / "server.log"
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        try:
            runner = account("postgres")
        except AccountUnavailable as exc:
            raise PgServerUnavailable(str(exc)) from exc
        self._run_as: dict[str, Any] = runner.popen()
        self._uid, self._gid = runner.uid, runner.gid
        self._prepare_base()
        if standby_of is None:
            self._run_tool(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",  # only the bootstrap; the server itself runs with fsync on
            )
        else:
            # A streaming standby of `standby_of`, which connects as `name` (its
            # `application_name`, the name `synchronous_standby_names` lists).
            conninfo = (
                f"host=127.0.0.1 port={standby_of.port} user=postgres application_name={name}"
            )
            self._run_tool(
                "pg_basebackup",
                "-D",
                str(self.data),
                "--write-recovery-conf",
                "--checkpoint=fast",
                "--no-sync",
                "-d",
                conninfo,
            )

    # Setup -----------------------------------------------------------------------------------

    def _prepare_base(self) -> None:
        """The data and socket directories and the log, owned by the server's account."""
        os.chmod(self.base, 0o755)  # traversable for the server's account
        for path in (self.data, self.socket_dir):
            path.mkdir(mode=0o700)
            os.chown(path, self._uid, self._gid)
        self.log.touch()
        os.chown(self.log, self._uid, self._gid)

    def _run_tool(self, tool: str, *args: str) -> None:
        """Run one of the package's tools as the server's account; its failure is ours."""
        result = subprocess.run(
            [str(self.bindir / tool), *args],
            capture_output=True,
            check=False,
            cwd=self.base,
            **self._run_as,
        )
        if result.returncode != 0:
            raise PgServerUnavailable(
                f"{tool} failed ({result.returncode}): {result.stderr.decode(errors='replace')}"
                f" {self.log_tail()}"
            )

    @property
    def dsn(self) -> str:
        """A loopback TCP DSN (what most tests use)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def socket_dsn(self) -> str:
        """A DSN over the unix socket in the temporary directory."""
        return f"postgresql://postgres@/postgres?host={self.socket_dir}&port={self.port}"

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def _psql_command(self) -> list[str]:
        return [str(self.bindir / "psql"), "-qAtX", "-v", "ON_ERROR_STOP=1", "-d"]

    def psql(self, sql: str, database: str = "postgres", timeout: float = 120.0) -> str:
        """Run SQL with the package's psql (stopping at the first error, which is raised as
        `PgServerUnavailable`); its unaligned, tuples-only output."""
        result = subprocess.run(
            [*self._psql_command, self.dsn_for(database), "-c", sql],
            capture_output=True,
            check=False,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise PgServerUnavailable(
                f"psql on port {self.port} failed: {result.stderr.decode(errors='replace')}"
            )
        return result.stdout.decode()

    # Lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        if self.running:
            return
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data),
                    "-k",
                    str(self.socket_dir),
                    "-p",
                    str(self.port),
                    "-h",
                    "127.0.0.1",
                    "-c",
                    "fsync=on",
                    "-c",
                    "synchronous_commit=on",
                    "-c",
                    "max_connections=200",
                    "-c",
                    "shared_buffers=128MB",
                    "-c",
                    "max_prepared_transactions=0",
                    # Dynamic shared memory as files in the data directory (pg_dynshmem/),
                    # removed with it, rather than /dev/shm/PostgreSQL.* segments, which a
                    # SIGKILLed server (`kill`) leaves behind for good (~0.65 MB each).
                    "-c",
                    "dynamic_shared_memory_type=mmap",
                    *(
                        argument
                        for name, value in self.settings.items()
                        for argument in ("-c", f"{name}={value}")
                    ),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.base,
                start_new_session=True,
                # The server's own libpq connections (Citus's to other nodes) look for client
                # certificates under $HOME/.postgresql: not root's, which it may not read.
                env={**os.environ, "HOME": str(self.base)},
                **self._run_as,
            )
        isready = [str(self.bindir / "pg_isready"), "-q", "-h", str(self.socket_dir)]
        isready += ["-p", str(self.port)]
        try:
            _await_ready(
                "postgres",
                self.process,
                lambda: subprocess.run(isready, check=False).returncode == 0,
                timeout,
                self.log_tail,
            )
        except PgServerUnavailable:
            self.kill()
            raise

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def cpu_seconds(self) -> float:
        """CPU seconds of the postmaster and its live children, plus reaped children's."""
        return server_cpu_seconds(self.pid) if self.running else 0.0

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT); a SIGKILL if it does not finish in time."""
        if not self.running:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the postmaster and every child, and wait until they are gone."""
        if self.process is None:
            return
        pid = self.process.pid
        # Stopped first, so that it forks no backend between the listing of its children and
        # its death: a client reconnecting at that moment got a backend no list held, which
        # outlived the kill with the shared memory block, and the restart failed.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(pid) not in ("T", "Z", None) and time.monotonic() < deadline:
            time.sleep(0.001)
        below = children(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for child in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.process.wait()
        # Children re-parented after the postmaster died: kill any that are still alive.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = [child for child in below if Path(f"/proc/{child}").exists()]
            alive = [child for child in alive if not _is_zombie(child)]
            if not alive:
                return
            for child in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.02)

    def restart(self) -> None:
        self.stop()
        self.start()

    def promote(self, timeout: float = 60.0) -> None:
        """Promote a standby to a primary (`pg_ctl promote`, waiting until it accepts writes)."""
        self._run_tool(
            "pg_ctl", "promote", "--wait", f"--timeout={int(timeout)}", "-D", str(self.data)
        )

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Stop the server and remove the temporary directory (and the System V shared
        memory block a killed server left: a restart would have removed it, a directory
        removed leaves it for good)."""
        if self.running:
            self.stop(timeout=10)
        if self._owns_base:
            _remove_orphaned_shared_memory(self.data / "postmaster.pid")
            shutil.rmtree(self.base, ignore_errors=True)


class PgBouncer:
    """PgBouncer in transaction mode in front of a `PgServer`, from a temporary directory, run
    as the server's account (PgBouncer refuses to run as root).

    `pool_size` server connections per database and user serve any number of clients, so the
    clients' statements share server sessions. Startup parameters PgBouncer cannot pass on
    (`statement_timeout`, `synchronous_commit`) are ignored, as docs/postgres.md tells
    operators to configure it (`ignore_startup_parameters=False` leaves that out).
    """

    def __init__(
        self, server: PgServer, pool_size: int = 2, *, ignore_startup_parameters: bool = True
    ) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(binary):
            raise PgServerUnavailable("PgBouncer is not installed: apt-get install pgbouncer")
        self.binary = binary
        self.server = server
        self.base = Path(tempfile.mkdtemp(prefix="tokencapture-pgbouncer-", dir=server.base))
        self.port = _free_port()
        self.log = self.base / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        config = self.base / "pgbouncer.ini"
        users = self.base / "users.txt"
        users.write_text('"postgres" ""\n')
        config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={server.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 200\n"
            + (
                "ignore_startup_parameters = statement_timeout,synchronous_commit\n"
                if ignore_startup_parameters
                else ""
            )
            + f"logfile = {self.log}\n"
        )
        os.chmod(self.base, 0o755)
        for path in (self.base, config, users):
            os.chown(path, server._uid, server._gid)
        self.config = config

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 10.0) -> None:
        self.process = subprocess.Popen(
            [self.binary, str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.base,
            start_new_session=True,
            **self.server._run_as,
        )

        def listening() -> bool:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                return probe.connect_ex(("127.0.0.1", self.port)) == 0

        try:
            _await_ready("pgbouncer", self.process, listening, timeout, self.log_tail)
        except PgServerUnavailable:
            self.stop()
            raise

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.base, ignore_errors=True)


def _remove_orphaned_shared_memory(pid_file: Path) -> None:
    """Remove the System V shared memory block `pid_file` names (its seventh line: key and
    id) when no process is attached to it: what a SIGKILLed postmaster leaves behind (a clean
    shutdown removes the file and the block)."""
    try:
        key_and_id = pid_file.read_text().splitlines()[6].split()
        shmid = int(key_and_id[1])
    except (OSError, IndexError, ValueError):
        return
    try:
        with open("/proc/sysvipc/shm") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return
    # Columns: key shmid perms size cpid lpid nattch ...
    if any(row[1] == str(shmid) and row[6] == "0" for row in rows):
        subprocess.run(["ipcrm", "-m", str(shmid)], check=False, capture_output=True)


def _state(pid: int) -> str | None:
    """The process's state letter (`R`, `S`, `T` stopped, `Z` zombie, ...); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


def _is_zombie(pid: int) -> bool:
    return _state(pid) in ("Z", None)


# Settings of every node of a test Citus cluster.
CITUS_SETTINGS = {
    "shared_preload_libraries": "citus",
    # Transactions that write on several workers commit in two phases (PREPARE TRANSACTION).
    "max_prepared_transactions": "100",
    # Citus runs a maintenance daemon per database that has the extension, on every node.
    "max_worker_processes": "32",
    # Fewer shards than the default 32: each test database's DDL touches every shard.
    "citus.shard_count": "8",
    # The coordinator's pass that resolves in-doubt two-phase commits after a node failed
    # (every minute by default; the fault tests wait for it).
    "citus.recover_2pc_interval": "2s",
}


def citus_library(bindir: Path) -> Path:
    """Where the Citus extension of the PostgreSQL in `bindir` lives (Debian's layout)."""
    return bindir.parent / "lib" / "citus.so"


class CitusCluster:
    """A Citus coordinator and `workers` workers, each a `PgServer` on its own loopback port and
    unix socket under one temporary directory, run as the `postgres` account as every test
    server is. `create_database(name)` makes a Citus database on every node (the extension is
    per database) and registers the nodes in it; `cleanup()` kills every node and its
    children and removes the directory."""

    def __init__(self, workers: int = 2, settings: dict[str, str] | None = None) -> None:
        bindir = find_bindir()
        if bindir is None or not (bindir / "initdb").exists():
            raise PgServerUnavailable("PostgreSQL is not installed: apt-get install postgresql")
        if not citus_library(bindir).exists():
            raise PgServerUnavailable(
                f"Citus is not installed ({citus_library(bindir)} is missing): run "
                "bash scripts/build-citus.sh"
            )
        parent = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
        self.base = Path(tempfile.mkdtemp(prefix="tokencapture-citus-", dir=parent))
        os.chmod(self.base, 0o755)
        node_settings = {**CITUS_SETTINGS, **(settings or {})}
        self.nodes: list[PgServer] = []
        try:
            for name in ["coordinator", *(f"worker{i}" for i in range(workers))]:
                (self.base / name).mkdir()
                self.nodes.append(PgServer(self.base / name, bindir, settings=node_settings))
        except BaseException:
            self.cleanup()
            raise

    @property
    def coordinator(self) -> PgServer:
        return self.nodes[0]

    @property
    def workers(self) -> list[PgServer]:
        return self.nodes[1:]

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def dsn_for(self, database: str) -> str:
        """The coordinator's DSN for `database` (what clients use)."""
        return self.coordinator.dsn_for(database)

    def create_database(self, database: str) -> str:
        """A database with the Citus extension on every node, the coordinator and the workers
        registered in it; the coordinator's DSN."""
        for node in self.nodes:
            node.psql(f"CREATE DATABASE {database}")
            node.psql("CREATE EXTENSION citus", database)
        self.coordinator.psql(
            f"SELECT citus_set_coordinator_host('127.0.0.1', {self.coordinator.port})", database
        )
        for worker in self.workers:
            self.coordinator.psql(f"SELECT citus_add_node('127.0.0.1', {worker.port})", database)
        return self.dsn_for(database)

    def drop_database(self, database: str) -> None:
        for node in reversed(self.nodes):
            if not node.running:
                continue
            # FORCE ends the sessions it finds, but one may connect meanwhile (Citus's
            # maintenance daemon, or a worker's connection the coordinator is closing; seen
            # once in CI under load): "is being accessed by other users". A few more tries.
            for attempt in range(5):
                try:
                    node.psql(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
                    break
                except PgServerUnavailable as exc:
                    if "is being accessed by other users" not in str(exc) or attempt == 4:
                        raise
                    time.sleep(0.2 * (attempt + 1))

    def node_of(self, database: str, table: str, value: str) -> PgServer:
        """The worker holding the shard of `table` that `value` of its distribution column
        hashes to, read from Citus's catalog (pg_dist_shard_placement) on the coordinator."""
        literal = "'" + value.replace("'", "''") + "'"
        port = self.coordinator.psql(
            "SELECT nodeport FROM pg_dist_shard_placement WHERE shardid = "
            f"get_shard_id_for_distribution_column('{table}', {literal})",
            database,
        ).strip()
        for node in self.nodes:
            if str(node.port) == port:
                return node
        raise AssertionError(f"no node of this cluster listens on port {port!r}")

    def cpu_seconds(self) -> float:
        """CPU seconds of every node (postmasters and children; see `server_cpu_seconds`)."""
        return sum(node.cpu_seconds() for node in self.nodes)

    def cleanup(self) -> None:
        """Kill every node (and its children) and remove the directory (and each killed
        node's System V shared memory block, as `PgServer.cleanup` removes its own)."""
        for node in self.nodes:
            node.kill()
            _remove_orphaned_shared_memory(node.data / "postmaster.pid")
        shutil.rmtree(self.base, ignore_errors=True)
