"""A writer process for the SIGKILL crash campaign (`crash_harness.py` starts and kills it).

It runs random store operations forever and keeps an acknowledgement log (its own file,
opened with O_APPEND). Before each store call it appends an `about` record, after the call
returns it appends a `done` record; each record is written with one `write` and `fsync`ed
before the writer goes on. So when the writer is killed, the log says exactly which calls
were acknowledged and which single call (the last `about` without a `done`) was in flight.

Usage: python -m tests.reliability.crash_writer CONFIG_JSON
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.reliability.common import StoreLike, make_entry, open_store, sha256

from tokencapture.protocols import (
    TokenCaptureFrozenError,
    TokenCaptureRetiredError,
)
from tokencapture.store import canonical_line

# Call ids that `mark_incomplete` must take whatever they hold (never refused for content).
ODD_MARKER_IDS = ("", "line\nbreak", "cr\rid", "lone-\udcff-surrogate", "tab\tand ✓", "x" * 300)


class AckLog:
    """Append-only, fsynced record of what this writer was about to do and what returned."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._seq = 0

    def about(self, op: str, **fields: Any) -> int:
        self._seq += 1
        self._emit({"t": "about", "n": self._seq, "op": op, **fields})
        return self._seq

    def done(self, seq: int, res: str, **fields: Any) -> None:
        self._emit({"t": "done", "n": seq, "res": res, **fields})

    def _emit(self, record: dict[str, Any]) -> None:
        data = json.dumps(record, ensure_ascii=True).encode() + b"\n"
        written = os.write(self._fd, data)
        if written != len(data):  # pragma: no cover - a local file does not short-write
            raise OSError(f"short write to the ack log: {written} of {len(data)}")
        os.fsync(self._fd)


@dataclass
class Writer:
    store: StoreLike
    log: AckLog
    rng: random.Random
    name: str
    own: list[str]
    shared: list[str]
    old: list[str]
    big_tokens: int
    torn_at: int | None = None  # after this many call ids, die in the middle of a write
    seq: int = 0
    acked: dict[str, list[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # re-puts rebuild the same bytes
    closed: set[str] = field(default_factory=set)  # frozen, retired or deleted (as seen here)
    deleted: set[str] = field(default_factory=set)

    def new_call_id(self) -> str:
        self.seq += 1
        return f"{self.name}-c{self.seq}"

    def pick_rollout(self) -> str:
        live_own = [r for r in self.own if r not in self.deleted]
        pool = live_own + self.shared if self.rng.random() < 0.6 else self.shared + live_own
        open_ones = [r for r in pool if r not in self.closed]
        # Mostly open rollouts; sometimes a closed one, to exercise the rejections.
        if open_ones and self.rng.random() < 0.95:
            return self.rng.choice(open_ones)
        return self.rng.choice(pool)

    def token_count(self) -> int:
        roll = self.rng.random()
        if roll < 0.04:
            return self.rng.randint(self.big_tokens // 2, self.big_tokens)
        if roll < 0.25:
            return self.rng.randint(200, 4000)
        return self.rng.randint(1, 60)

    def put(self, rollout_id: str, call_id: str, tokens: int, variant: int = 0) -> str:
        if variant == 0:
            tokens = self.sizes.setdefault(call_id, tokens)
        entry = make_entry(rollout_id, call_id, tokens=tokens, variant=variant)
        op = "conflict" if variant else "put"
        seq = self.log.about(op, r=rollout_id, c=call_id, sha=sha256(canonical_line(entry)))
        try:
            self.store.append(entry)
        except TokenCaptureRetiredError:
            self.closed.add(rollout_id)
            self.log.done(seq, "retired")
            return "retired"
        except TokenCaptureFrozenError:
            self.closed.add(rollout_id)
            self.log.done(seq, "frozen")
            return "frozen"
        except ValueError as exc:
            if not variant:
                raise
            self.log.done(seq, "conflict", msg=str(exc)[:200])
            return "conflict"
        if variant:
            raise AssertionError(f"a conflicting put of {call_id!r} was accepted")
        self.acked.setdefault(rollout_id, []).append(call_id)
        self.log.done(seq, "ok")
        return "ok"

    def die_mid_write(self, rollout_id: str) -> None:
        """Be a store process killed in the middle of writing a line, deterministically.

        Under the rollout's flock (lock, then check the path still names the locked inode,
        as the stores do), append a prefix of a new entry's canonical line, possibly all of
        it but never its newline, make it durable, and SIGKILL ourselves. The ack log shows
        the put as in flight. Skipped when the rollout is closed (a store would refuse).
        """
        root = self.store.root
        lock_path = root / f"{rollout_id}.tokens.lock"
        root.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        state_path = root / f"{rollout_id}.tokens.state.json"
        if state_path.exists():
            state = json.loads(state_path.read_bytes())
            if state.get("frozen") or state.get("retired"):
                os.close(fd)
                return
        call_id = self.new_call_id()
        line = canonical_line(make_entry(rollout_id, call_id, tokens=self.token_count()))
        cut = self.rng.randint(1, len(line))
        self.log.about("put", r=rollout_id, c=call_id, sha=sha256(line), torn=cut)
        with Path(root / f"{rollout_id}.tokens.jsonl").open("ab") as log:
            log.write(line[:cut])
            log.flush()
            os.fsync(log.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    def step(self) -> None:
        roll = self.rng.random()
        rollout_id = self.pick_rollout()
        if self.torn_at is not None and self.seq >= self.torn_at:
            self.die_mid_write(rollout_id)
            self.torn_at = None
            return
        if roll < 0.60:
            self.put(rollout_id, self.new_call_id(), self.token_count())
        elif roll < 0.72:
            call_id = self.new_call_id()
            seq = self.log.about("begin", r=rollout_id, c=call_id)
            try:
                self.store._begin_call(rollout_id, call_id)
            except TokenCaptureFrozenError as exc:
                self.closed.add(rollout_id)
                self.log.done(
                    seq, "retired" if isinstance(exc, TokenCaptureRetiredError) else "frozen"
                )
                return
            self.log.done(seq, "ok")
            if self.rng.random() < 0.75:  # otherwise the intent dangles: a lost call
                self.put(rollout_id, call_id, self.token_count())
        elif roll < 0.78:
            done = self.acked.get(rollout_id)
            if done:
                self.put(rollout_id, self.rng.choice(done), 0)  # idempotent re-put
        elif roll < 0.80:
            done = self.acked.get(rollout_id)
            if done:
                self.put(rollout_id, self.rng.choice(done), 3, variant=1)
        elif roll < 0.86:
            target = (
                self.rng.choice(self.old) if self.old and self.rng.random() < 0.4 else rollout_id
            )
            call_id = (
                self.rng.choice(ODD_MARKER_IDS) if self.rng.random() < 0.3 else self.new_call_id()
            )
            seq = self.log.about("mark", r=target, c=call_id)
            try:
                self.store._mark_incomplete(target, call_id)
            except TokenCaptureRetiredError:
                self.log.done(seq, "retired")
                return
            self.log.done(seq, "ok")
        elif roll < 0.895:
            seq = self.log.about("freeze", r=rollout_id)
            try:
                snap = self.store.freeze_now(rollout_id)
            except TokenCaptureRetiredError:
                self.log.done(seq, "retired")
                return
            self.closed.add(rollout_id)
            self.log.done(
                seq,
                "ok",
                ids=[e.model_call_id for e in snap.entries],
                v=snap.version,
                sid=snap.snapshot_id,
                inc=snap.incomplete,
            )
        elif roll < 0.915:
            live_own = [r for r in self.own if r not in self.deleted]
            batch = self.rng.sample(live_own, min(len(live_own), self.rng.randint(1, 2)))
            if self.rng.random() < 0.15:
                batch.append(self.rng.choice(self.shared))
            if not batch:
                return
            seq = self.log.about("retire", rs=batch)
            removal = self.store.retire_now(batch)
            self.closed.update(batch)
            self.log.done(
                seq, "ok", removed=list(removal["removed"]), absent=list(removal["absent"])
            )
        elif roll < 0.925:
            live_own = [r for r in self.own if r not in self.deleted]
            if len(live_own) <= 1:
                return
            victim = self.rng.choice(live_own)
            seq = self.log.about("delete", rs=[victim])
            self.deleted.add(victim)  # never written again: a reuse would be ambiguous
            self.store.delete_now([victim])
            self.log.done(seq, "ok")
        else:
            # A read while others write: it must never fail or show a torn line.
            self.store.read_entries(rollout_id)


def main(argv: list[str]) -> int:
    config = json.loads(argv[1])
    rng = random.Random(config["seed"])
    store = open_store(config["store"], config["root"])
    writer = Writer(
        store=store,
        log=AckLog(config["ack"]),
        rng=rng,
        name=config["name"],
        own=list(config["own"]),
        shared=list(config["shared"]),
        old=list(config["old"]),
        big_tokens=int(config["big_tokens"]),
        torn_at=config.get("torn_at"),
    )
    print("ready", flush=True)
    deadline = time.monotonic() + float(config["max_seconds"])
    while time.monotonic() < deadline:
        writer.step()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
