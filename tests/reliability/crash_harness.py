"""SIGKILL crash campaign: writers die at random moments, nothing acknowledged may be lost.

Each round starts a few writer processes (`crash_writer.py`) over one store directory. They
put entries into their own and shared rollouts, begin calls (sometimes leaving the intent
dangling), re-put and conflict, mark rollouts incomplete (current ones and frozen ones from
earlier rounds, with odd call ids), freeze, retire and delete, while this supervisor SIGKILLs
each of them at a random moment. Then, with every writer dead, it reopens the store and
checks, for every rollout the campaign ever touched:

* every acknowledged put is present exactly once and byte-identical (payload SHA-256 of the
  raw JSONL line and of the re-serialized entry), in the same order in the raw file;
* nothing unacknowledged is present except a writer's single in-flight put; rejected puts
  (frozen/retired) and conflicting payloads never are;
* after freeze the JSONL ends on a newline (a torn tail is gone) and reads back the same
  through `read_entries`;
* versions never go backwards (and move forward after an acknowledged change), snapshot ids
  never change, a frozen rollout's entries never change;
* every acknowledged `mark_incomplete`/conflict sets the stored flag, every acknowledged
  intent without an entry makes freeze report `incomplete`, and nothing else does;
* retired rollouts refuse freeze and keep no records; deleted ones keep no files at all; a
  retire or delete that was in flight is finished by running it again;
* the directory holds no file the campaign cannot account for.

Run it directly for long campaigns:
`python -m tests.reliability.crash_harness --store rust --kills 200`.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.reliability.common import (
    REPO_ROOT,
    StoreLike,
    child_env,
    open_store,
    sha256,
)

from tokencapture.protocols import TokenCaptureRetiredError
from tokencapture.store import canonical_line

__all__ = [
    "CampaignReport",
    "CrashCampaign",
    "CrashCheckError",
    "Op",
    "RolloutModel",
    "parse_ack_log",
]

ROLLOUT_SUFFIXES = ("jsonl", "state.json", "intents", "incomplete", "lock")


class CrashCheckError(AssertionError):
    """An invariant did not hold after a kill; the message names seed, round and rollout."""


@dataclass
class Op:
    """One store call from an ack log: acknowledged (`res` set) or in flight (`res` None)."""

    op: str
    fields: dict[str, Any]
    res: str | None
    done: dict[str, Any]


def parse_ack_log(path: Path) -> list[Op]:
    """The calls of one writer's ack log, in order. A torn final record is ignored (the call
    it announced had not started, or its `done` was not durable: either way it counts as in
    flight, which is the conservative reading)."""
    data = path.read_bytes() if path.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    ops: dict[int, Op] = {}
    for line in complete.splitlines():
        record = json.loads(line)
        if record["t"] == "about":
            fields = {k: v for k, v in record.items() if k not in ("t", "n", "op")}
            ops[record["n"]] = Op(record["op"], fields, None, {})
        else:
            op = ops[record["n"]]
            op.res = record["res"]
            op.done = record
    ordered = [ops[n] for n in sorted(ops)]
    in_flight = [op for op in ordered if op.res is None]
    if len(in_flight) > 1 or (in_flight and in_flight[0] is not ordered[-1]):
        raise CrashCheckError(f"{path}: more than one call in flight: {in_flight}")
    return ordered


@dataclass
class RolloutModel:
    """What the ack logs prove about one rollout."""

    rollout_id: str
    acked: dict[str, str] = field(default_factory=dict)  # call id -> payload sha
    maybe: dict[str, str] = field(default_factory=dict)  # in-flight puts
    rejected: set[str] = field(default_factory=set)
    conflict_shas: set[str] = field(default_factory=set)
    flag_must: bool = False
    flag_may: bool = False
    intents_acked: set[str] = field(default_factory=set)
    intents_maybe: set[str] = field(default_factory=set)
    writer_freezes: list[dict[str, Any]] = field(default_factory=list)
    retired: str = "no"  # "no" | "maybe" | "yes"
    deleted: str = "no"
    verdict_must: bool = False  # an earlier freeze said incomplete: it must stay so
    must_bump: bool = False
    touched: bool = False
    max_version: int = 0
    snapshot_id: str | None = None
    last_ids: list[str] | None = None
    round_created: int = 0

    @property
    def live(self) -> bool:
        return self.retired != "yes" and self.deleted != "yes"


@dataclass
class CampaignReport:
    store: str
    seed: int
    rounds: int = 0
    kills: int = 0
    acked_ops: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    torn_writes: int = 0
    torn_tails_seen: int = 0
    stray_temp_files: int = 0
    rollouts: int = 0
    entries_verified: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.store}: seed={self.seed} rounds={self.rounds} kills={self.kills} "
            f"acked_ops={self.acked_ops} in_flight_at_kill={dict(sorted(self.in_flight.items()))} "
            f"torn_writes={self.torn_writes} torn_tails_seen={self.torn_tails_seen} "
            f"stray_temp_files={self.stray_temp_files} "
            f"rollouts={self.rollouts} entries_verified={self.entries_verified} "
            f"time={self.seconds:.1f}s"
        )


class CrashCampaign:
    def __init__(
        self,
        store_kind: str,
        workdir: Path,
        *,
        seed: int,
        writers: int = 3,
        max_run_seconds: float = 0.8,
        big_tokens: int = 250_000,
        recheck_old: int | None = None,
        torn_rate: float = 0.3,
    ) -> None:
        self.kind = store_kind
        self.root = workdir / "store"
        self.acks = workdir / "acks"
        self.acks.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.rng = random.Random(seed)
        self.writers = writers
        self.max_run = max_run_seconds
        self.big_tokens = big_tokens
        self.recheck_old = recheck_old
        self.torn_rate = torn_rate
        self.models: dict[str, RolloutModel] = {}
        self.report = CampaignReport(store_kind, seed)
        self.round = 0

    # Running -------------------------------------------------------------------------------

    def run(self, kills: int) -> CampaignReport:
        start = time.monotonic()
        while self.report.kills < kills:
            self.run_round()
        self.report.seconds = time.monotonic() - start
        return self.report

    def fail(self, rollout_id: str, message: str) -> CrashCheckError:
        return CrashCheckError(
            f"[{self.kind} seed={self.seed} round={self.round} rollout={rollout_id}] {message} "
            f"(store dir {self.root}, ack logs {self.acks})"
        )

    def model(self, rollout_id: str) -> RolloutModel:
        if rollout_id not in self.models:
            self.models[rollout_id] = RolloutModel(rollout_id, round_created=self.round)
        return self.models[rollout_id]

    def run_round(self) -> None:
        self.round += 1
        k = self.round
        shared = [f"s{k}-{j}" for j in range(2)]
        live_old = sorted(r for r, m in self.models.items() if m.live)
        old = self.rng.sample(live_old, min(4, len(live_old)))
        procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
        for i in range(self.writers):
            own = [f"w{i}k{k}-{j}" for j in range(3)]
            for rollout_id in [*own, *shared]:
                self.model(rollout_id)
            ack = self.acks / f"round{k}-writer{i}.log"
            err = self.acks / f"round{k}-writer{i}.stderr"
            config = {
                "store": self.kind,
                "root": str(self.root),
                "ack": str(ack),
                "seed": self.rng.getrandbits(64),
                "name": f"w{i}k{k}",
                "own": own,
                "shared": shared,
                "old": old,
                "big_tokens": self.big_tokens,
                "max_seconds": 60,
                "torn_at": self.rng.randint(1, 80) if self.rng.random() < self.torn_rate else None,
            }
            with err.open("wb") as err_file:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.reliability.crash_writer", json.dumps(config)],
                    cwd=REPO_ROOT,
                    env=child_env(),
                    stdout=subprocess.PIPE,
                    stderr=err_file,
                )
            procs.append((proc, ack, err))
        for proc, _, err in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                for other, _, _ in procs:  # leave no writer behind
                    if other.poll() is None:
                        other.kill()
                    other.wait()
                raise self.fail("-", f"writer did not start: {err.read_text()[-2000:]}")
        # Kill each writer at its own random moment: some right away (first put of a rollout,
        # directory creation), most while it is busy.
        started = time.monotonic()
        plan = sorted(
            (
                self.rng.uniform(0.0, 0.01)
                if self.rng.random() < 0.1
                else self.rng.uniform(0.05, self.max_run),
                index,
            )
            for index in range(len(procs))
        )
        for at, index in plan:
            delay = started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            procs[index][0].send_signal(signal.SIGKILL)
        for proc, _, err in procs:
            code = proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if code != -signal.SIGKILL:
                raise self.fail("-", f"writer exited with {code}: {err.read_text()[-3000:]}")
            self.report.kills += 1
        for _, ack, _ in procs:
            self.absorb(parse_ack_log(ack))
        self.verify()
        self.report.rounds += 1

    def absorb(self, ops: list[Op]) -> None:
        """Fold one writer's calls into the per-rollout models."""
        for op in ops:
            acked = op.res is not None
            if acked:
                self.report.acked_ops += 1
            else:
                self.report.in_flight[op.op] = self.report.in_flight.get(op.op, 0) + 1
            f = op.fields
            for rollout_id in f.get("rs", [f.get("r")]):
                self.model(rollout_id).touched = True
            if op.op in ("put", "conflict"):
                m = self.model(f["r"])
                if "torn" in f:
                    self.report.torn_writes += 1
                if op.op == "conflict":
                    m.conflict_shas.add(f["sha"])
                    if op.res == "conflict":
                        m.flag_must = m.flag_may = m.must_bump = True
                    elif op.res is None:
                        m.flag_may = True
                elif op.res == "ok":
                    if f["c"] not in m.acked:
                        m.must_bump = True
                    m.acked[f["c"]] = f["sha"]
                elif op.res is None:
                    m.maybe[f["c"]] = f["sha"]
                else:
                    m.rejected.add(f["c"])
            elif op.op == "begin":
                m = self.model(f["r"])
                if op.res == "ok":
                    m.intents_acked.add(f["c"])
                elif op.res is None:
                    m.intents_maybe.add(f["c"])
            elif op.op == "mark":
                m = self.model(f["r"])
                if op.res == "ok":
                    m.flag_must = m.flag_may = m.must_bump = True
                elif op.res is None:
                    m.flag_may = True
            elif op.op == "freeze":
                if op.res == "ok":
                    self.model(f["r"]).writer_freezes.append(op.done)
            elif op.op == "retire":
                for rollout_id in f["rs"]:
                    m = self.model(rollout_id)
                    if op.res == "ok":
                        m.retired = "yes"
                    elif m.retired == "no":
                        m.retired = "maybe"
            elif op.op == "delete":
                for rollout_id in f["rs"]:
                    m = self.model(rollout_id)
                    m.deleted = "yes" if op.res == "ok" else "maybe"
            else:
                raise CrashCheckError(f"unknown op in ack log: {op}")

    # Checking ------------------------------------------------------------------------------

    def verify(self) -> None:
        store = open_store(self.kind, self.root)
        self.check_directory()
        ids = sorted(self.models)
        if self.recheck_old is not None:
            fresh = [r for r in ids if self.models[r].round_created == self.round]
            touched = [r for r in ids if self.models[r].touched]
            rest = [r for r in ids if r not in fresh and r not in touched]
            sample = self.rng.sample(rest, min(self.recheck_old, len(rest)))
            ids = sorted({*fresh, *touched, *sample})
        for rollout_id in ids:
            self.verify_rollout(store, self.models[rollout_id])
        self.check_directory()
        self.report.stray_temp_files = sum(1 for p in self.root.glob("*.tokens.*tmp*"))
        self.report.rollouts = len(self.models)

    def check_directory(self) -> None:
        if not self.root.exists():
            return
        for path in self.root.iterdir():
            name = path.name
            rollout_id, sep, suffix = name.partition(".tokens.")
            if not sep or rollout_id not in self.models:
                raise self.fail(rollout_id, f"file the campaign cannot account for: {name}")
            if suffix in ROLLOUT_SUFFIXES:
                continue
            if "tmp" in suffix:
                continue  # counted per rollout in verify_rollout
            raise self.fail(rollout_id, f"unexpected file {name}")

    def verify_rollout(self, store: StoreLike, m: RolloutModel) -> None:
        r = m.rollout_id
        if m.deleted != "no":
            if m.deleted == "maybe":
                store.delete_now([r])  # finish the interrupted delete
                m.deleted = "yes"
            left = sorted(p.name for p in self.root.glob(f"{r}.tokens.*"))
            if left:
                raise self.fail(r, f"deleted rollout still has files: {left}")
            return
        if m.retired != "no":
            try:
                store.freeze_now(r)
            except TokenCaptureRetiredError:
                store.retire_now([r])  # finishes an interrupted retire; a no-op otherwise
                m.retired = "yes"
                left = [
                    p.name
                    for p in self.root.glob(f"{r}.tokens.*")
                    if p.name.endswith((".jsonl", ".intents", ".incomplete"))
                ]
                if left:
                    raise self.fail(r, f"retired rollout still has records: {left}") from None
                state = json.loads(store.state_path_for(r).read_bytes())
                if not state.get("retired") or state.get("entry_digests"):
                    raise self.fail(r, f"fence is not a fence: {state}") from None
                return
            if m.retired == "yes":
                raise self.fail(r, "freeze succeeded on an acknowledged-retired rollout")
            m.retired = "no"  # the in-flight retire never wrote this fence
        log_path = store.path_for(r)
        raw_before = log_path.read_bytes() if log_path.exists() else b""
        if raw_before and not raw_before.endswith(b"\n"):
            self.report.torn_tails_seen += 1
        read_ids = [e.model_call_id for e in store.read_entries(r)]
        snap = store.freeze_now(r)
        got = [e.model_call_id for e in snap.entries]
        if read_ids != got:
            raise self.fail(r, f"read_entries {read_ids} disagrees with freeze {got}")
        if len(set(got)) != len(got):
            raise self.fail(r, f"a call id appears twice: {got}")
        missing = [c for c in m.acked if c not in got]
        if missing:
            raise self.fail(r, f"acknowledged puts lost: {missing}")
        for entry in snap.entries:
            c = entry.model_call_id
            expected = m.acked.get(c) or m.maybe.get(c)
            if expected is None:
                why = "a rejected put" if c in m.rejected else "never acknowledged nor in flight"
                raise self.fail(r, f"{c!r} is present but was {why}")
            actual = sha256(canonical_line(entry))
            if actual != expected:
                note = " (a conflicting payload won)" if actual in m.conflict_shas else ""
                raise self.fail(r, f"{c!r} does not read back byte-identical{note}")
        raw = log_path.read_bytes() if log_path.exists() else b""
        if raw and not raw.endswith(b"\n"):
            raise self.fail(r, "the JSONL still ends in a torn line after freeze")
        raw_lines = raw.splitlines()
        raw_ids = [json.loads(line)["model_call_id"] for line in raw_lines]
        if raw_ids != got:
            raise self.fail(r, f"raw JSONL lines {raw_ids} differ from the snapshot {got}")
        for line, c in zip(raw_lines, raw_ids, strict=True):
            if sha256(line) != (m.acked.get(c) or m.maybe.get(c)):
                raise self.fail(r, f"raw line of {c!r} is not the acknowledged bytes")
        self.report.entries_verified += len(got)
        # Incomplete: the stored flag, and freeze's verdict (flag or dangling intent).
        flag = store.is_incomplete(r)
        if m.flag_must and not flag:
            raise self.fail(r, "an acknowledged mark_incomplete/conflict is not reflected")
        if flag and not m.flag_may:
            raise self.fail(r, "the incomplete flag is set but nothing could have set it")
        present = set(got)
        dangling_must = any(c not in present for c in m.intents_acked)
        dangling_may = dangling_must or any(c not in present for c in m.intents_maybe)
        if (m.flag_must or dangling_must or m.verdict_must) and not snap.incomplete:
            raise self.fail(r, "freeze says complete despite an acknowledged hole")
        if snap.incomplete and not (m.flag_may or dangling_may):
            raise self.fail(r, "freeze says incomplete but nothing could have made it so")
        # Versions, snapshot ids, frozen entries.
        if snap.version < m.max_version or (m.must_bump and snap.version <= m.max_version):
            raise self.fail(
                r,
                f"version {snap.version} after {m.max_version} "
                f"(an acknowledged change since: {m.must_bump})",
            )
        if snap.version < len(got) + 1:
            raise self.fail(r, f"version {snap.version} is below entries + freeze ({len(got)})")
        for frozen in m.writer_freezes:
            if frozen["ids"] != got:
                raise self.fail(
                    r, f"entries changed after a writer's freeze: {frozen['ids']} -> {got}"
                )
            if frozen["sid"] != snap.snapshot_id or frozen["v"] > snap.version:
                raise self.fail(r, f"writer's freeze {frozen} vs {snap.snapshot_id}/{snap.version}")
        if m.snapshot_id is not None and m.snapshot_id != snap.snapshot_id:
            raise self.fail(r, f"snapshot id changed: {m.snapshot_id} -> {snap.snapshot_id}")
        if m.last_ids is not None and m.last_ids != got:
            raise self.fail(r, f"a frozen rollout's entries changed: {m.last_ids} -> {got}")
        again = store.freeze_now(r)
        if (again.snapshot_id, again.version) != (snap.snapshot_id, snap.version):
            raise self.fail(r, "a second freeze with nothing changed moved the version")
        m.max_version = snap.version
        m.snapshot_id = snap.snapshot_id
        m.last_ids = got
        m.writer_freezes.clear()
        m.must_bump = False
        m.touched = False
        # Everything in flight has now been judged: what is present is acknowledged from now
        # on, and the flag and verdict this freeze reported are the ones to keep.
        for c in got:
            if c in m.maybe:
                m.acked[c] = m.maybe[c]
        m.maybe.clear()
        m.flag_must = m.flag_may = flag
        m.verdict_must = snap.incomplete
        if not snap.incomplete:
            m.intents_maybe.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="rust", choices=["rust", "reference"])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: temp)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    if args.dir is None:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="tokencapture-crash-"))
    else:
        workdir = args.dir
        workdir.mkdir(parents=True, exist_ok=True)
    campaign = CrashCampaign(args.store, workdir, seed=seed, writers=args.writers, recheck_old=20)
    report = campaign.run(args.kills)
    print(report.summary())
    print(f"work directory: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
