"""The `tokencapture` command line (`python -m tokencapture`)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence

from tokencapture.records import TokenEntry
from tokencapture.store import TokenCaptureStore


async def _demo(rollouts: int, calls: int) -> int:
    with tempfile.TemporaryDirectory(prefix="tokencapture-demo-") as root:
        store = TokenCaptureStore(root)
        print(f"demo store: {root}")

        async def run_rollout(index: int) -> None:
            rollout_id = f"demo-{index}"
            prompt = list(range(100 + index, 132 + index))
            for call in range(calls):
                call_id = f"call-{call}"
                await store.begin_call(rollout_id, call_id)
                generated = [1000 + call, 1001 + call]
                await store.put(
                    TokenEntry(
                        rollout_id=rollout_id,
                        model_call_id=call_id,
                        model="demo-model",
                        prompt_token_ids=prompt,
                        generation_token_ids=generated,
                        generation_log_probs=[-0.25, -0.5],
                        created_at=time.time(),
                    )
                )
                prompt = [*prompt, *generated, 7]

        started = time.perf_counter()
        await asyncio.gather(*(run_rollout(i) for i in range(rollouts)))
        elapsed = time.perf_counter() - started
        print(f"put {rollouts * calls} entries durably in {elapsed * 1000:.1f} ms")
        for index in range(rollouts):
            rollout_id = f"demo-{index}"
            snapshot = await store.freeze(rollout_id)
            tokens = sum(
                len(e.prompt_token_ids) + len(e.generation_token_ids) for e in snapshot.entries
            )
            dropped = await store.drop(rollout_id, snapshot.snapshot_id, snapshot.version)
            print(
                f"{rollout_id}: {len(snapshot.entries)} entries, {tokens} tokens, "
                f"version {snapshot.version}, incomplete={snapshot.incomplete}, "
                f"snapshot {snapshot.snapshot_id[:8]}, dropped={dropped}"
            )
        removal = await store.retire([f"demo-{i}" for i in range(rollouts)])
        print(f"retired: {len(removal['absent'])} already empty, fences kept")
        await store.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokencapture", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="put, freeze, drop and retire a few rollouts in a temp dir"
    )
    demo.add_argument("--rollouts", type=int, default=4)
    demo.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(_demo(args.rollouts, args.calls))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
