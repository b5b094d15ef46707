"""Memory soak: many puts across many rollouts in one process, RSS recorded as it goes.

Puts go to a sliding window of `--window` live rollouts, interleaved (so the Rust store's
per-process index cache keeps turning over); when a window is full (`--per-rollout` puts
each) its rollouts are frozen, then dropped or retired (alternately), then deleted. Every
`--every` puts the script records RSS (VmRSS), open descriptors and files in the directory.

    python -m tests.reliability.memory_soak --store rust --puts 100000 --rollouts 10000

prints one JSON object per checkpoint and a summary line. Quick use in the test suite:
`run_soak(...)` in-process on a small count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.reliability.common import StoreLike, make_entry, open_store

__all__ = ["Checkpoint", "rss_kib", "run_soak"]


def rss_kib() -> int:
    """Resident set size of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Checkpoint:
    puts: int
    rollouts_done: int
    rss_kib: int
    open_fds: int
    files_in_dir: int
    seconds: float


def retire_window(store: StoreLike, window: list[str], round_no: int) -> None:
    for index, rollout_id in enumerate(window):
        snap = store.freeze_now(rollout_id)
        if (index + round_no) % 2 == 0:
            assert store._drop(rollout_id, snap.snapshot_id, snap.version)
    store.retire_now(window)  # the dropped ones are already fenced: a no-op for them
    store.delete_now(window)


def run_soak(
    kind: str,
    root: Path,
    *,
    puts: int,
    rollouts: int,
    every: int,
    window: int = 200,
    tokens: int = 48,
) -> list[Checkpoint]:
    per_rollout = max(1, puts // rollouts)
    window = min(window, rollouts)
    store = open_store(kind, root)
    # Entries are built up front per window slot and call number so that building them is
    # not what the measurement sees; the rollout id is swapped in per put.
    templates = [make_entry("soak", f"call-{n}", tokens=tokens) for n in range(per_rollout)]
    checkpoints: list[Checkpoint] = []
    start = time.monotonic()
    gc.collect()
    checkpoints.append(Checkpoint(0, 0, rss_kib(), open_fds(), 0, 0.0))
    done = 0
    put_count = 0
    round_no = 0
    while put_count < puts:
        ids = [f"soak-{round_no}-{slot}" for slot in range(window)]
        for n in range(per_rollout):
            for rollout_id in ids:
                store.append(templates[n].model_copy(update={"rollout_id": rollout_id}))
                put_count += 1
                if put_count % every == 0:
                    gc.collect()
                    checkpoints.append(
                        Checkpoint(
                            put_count,
                            done,
                            rss_kib(),
                            open_fds(),
                            sum(1 for _ in root.iterdir()),
                            time.monotonic() - start,
                        )
                    )
                if put_count >= puts:
                    break
            if put_count >= puts:
                break
        retire_window(store, ids, round_no)
        done += len(ids)
        round_no += 1
    gc.collect()
    checkpoints.append(
        Checkpoint(put_count, done, rss_kib(), open_fds(), 0, time.monotonic() - start)
    )
    leftover = sorted(p.name for p in root.iterdir())
    if leftover:
        raise AssertionError(
            f"{len(leftover)} files left after deleting everything: {leftover[:5]}"
        )
    return checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", default="rust", choices=["rust", "reference"])
    parser.add_argument("--puts", type=int, default=100_000)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None, help="store directory (default: temp)")
    args = parser.parse_args(argv)
    scratch: Path | None = None
    if args.dir is None:
        # tmpfs when there is one: the soak measures memory, not the disk.
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        scratch = Path(tempfile.mkdtemp(prefix="tokencapture-soak-", dir=base))
        root = scratch / "store"
    else:
        root = args.dir
    try:
        points = run_soak(
            args.store,
            root,
            puts=args.puts,
            rollouts=args.rollouts,
            every=args.every,
            window=args.window,
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    for point in points:
        print(json.dumps(asdict(point)))
    first, last = points[1] if len(points) > 1 else points[0], points[-1]
    print(
        f"{args.store}: {last.puts} puts, {last.rollouts_done} rollouts retired and deleted, "
        f"RSS {points[0].rss_kib / 1024:.1f} MiB at start, {first.rss_kib / 1024:.1f} MiB "
        f"after {first.puts} puts, {last.rss_kib / 1024:.1f} MiB at the end "
        f"(growth after warm-up {(last.rss_kib - first.rss_kib) / 1024:+.1f} MiB), "
        f"{last.seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
