"""Test servers as unprivileged accounts when the tests run as root (CI does), and the process
bookkeeping their teardown needs. Shared by tests/pg_server.py (PostgreSQL as `postgres`),
tests/vllm_engine.py (vLLM as `tokencapture-engine`) and tests/fake_upstream.py (the gateway
and the fake upstream as `tokencapture-test`).

An account runs a server with `popen_as(account)` (Popen keyword arguments; empty when the
tests are not root). Whatever the server writes must be in a directory the account owns
below one it can traverse: `shared_tmpdir()` makes one under /tmp (a TMPDIR under /root would
not do).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Account",
    "AccountUnavailable",
    "account",
    "children",
    "current",
    "descendants",
    "processes",
    "shared_tmpdir",
]


class AccountUnavailable(RuntimeError):
    """The unprivileged account a server should run as cannot be had (the reason says why)."""


@dataclass(frozen=True)
class Account:
    """Who a server runs as: `uid`/`gid`, and whether that means dropping root."""

    name: str
    uid: int
    gid: int

    @property
    def drops_root(self) -> bool:
        return os.geteuid() == 0 and self.uid != 0

    def popen(self) -> dict[str, Any]:
        """`subprocess.Popen` keyword arguments that start a process as this account."""
        if not self.drops_root:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def own(self, *paths: Path) -> None:
        """Give `paths` to the account (as root; otherwise they are ours already)."""
        if self.drops_root:
            for path in paths:
                os.chown(path, self.uid, self.gid)


def current() -> Account:
    """The tests' own user."""
    return Account(pwd.getpwuid(os.getuid()).pw_name, os.getuid(), os.getgid())


def account(name: str, *, create: bool = False) -> Account:
    """The account a server runs as: `name` when the tests are root (a system account without
    a home or a shell, created when `create` and missing), else the tests' own user."""
    if os.geteuid() != 0:
        return current()
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if not create:
            raise AccountUnavailable(
                f"running as root and there is no `{name}` account to run the server as"
            ) from None
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        result = subprocess.run(
            [
                useradd,
                "--system",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                name,
            ],
            capture_output=True,
            check=False,
        )
        if result.returncode not in (0, 9):  # 9: created meanwhile
            raise AccountUnavailable(
                f"cannot create the {name} account to run a server as: "
                f"{result.stderr.decode(errors='replace')}"
            ) from None
        entry = pwd.getpwnam(name)
    return Account(name, entry.pw_uid, entry.pw_gid)


def shared_tmpdir(prefix: str) -> Path:
    """A new temporary directory that another account can traverse (mode 0755; under /tmp
    when root, whatever TMPDIR says)."""
    parent = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o755)
    return path


def processes() -> Iterator[tuple[int, list[str]]]:
    """Every live process: its pid and its stat(5) fields from the state on (field 3 is [0])."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces: split after the last ')'.
        yield int(entry), stat[stat.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    return [child for child, fields in processes() if int(fields[1]) == pid]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first (one pass over /proc)."""
    parents = {process: int(fields[1]) for process, fields in processes()}
    found: list[int] = []
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        below = [child for child, parent in parents.items() if parent == current]
        found.extend(below)
        frontier.extend(below)
    return found
