"""The gateway as its own process (`tokencapture gateway` under uvicorn) over real sockets:
the CLI, a client that disconnects mid-stream, and SIGKILLs under 16 concurrent sessions."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests import fake_upstream
from tests.fake_upstream import (
    IM_END,
    MODEL,
    Server,
    converse_on_new_connections,
    encode,
    render_chat,
    replying,
    server_runner,
    start_gateway,
)
from tests.gateway_kills import fake, run_kills, store_dir

from tokencapture import ParentResolutionStatus, TokenCaptureStore

__all__ = ["fake", "store_dir"]  # fixtures: the fake upstream process, a store directory


@pytest.fixture
def gateway(fake: Server, store_dir: Path, tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    server = start_gateway(fake.url, store_dir, tmp_path)
    yield server, store_dir
    server.stop()


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    [line] = [line for line in status.splitlines() if line.startswith("Uid:")]
    return int(line.split()[2])  # the effective uid


def test_servers_drop_root(fake: Server, gateway: tuple[Server, Path]) -> None:
    """As root (CI), the gateway and the fake upstream run as the unprivileged test account,
    and the store the gateway writes is that account's."""
    server, store_dir = gateway
    assert fake.process is not None and server.process is not None
    if os.geteuid() != 0:
        assert _uid(server.process.pid) == os.geteuid()
        return
    runner, _ = server_runner()
    assert runner.drops_root, f"the servers run as root: {fake_upstream.RUNNER_REASON}"
    assert _uid(server.process.pid) == runner.uid
    assert _uid(fake.process.pid) == runner.uid
    answer = httpx.post(
        f"{server.url}/rollouts/who/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 200
    assert (store_dir / "who.tokens.jsonl").stat().st_uid == runner.uid


def _wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_cli_gateway_serves_and_captures(gateway: tuple[Server, Path]) -> None:
    server, store_dir = gateway
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    answer = httpx.post(
        f"{server.url}/rollouts/cli/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-model-call-id": "one"},
    )
    assert answer.status_code == 200
    [entry] = TokenCaptureStore(store_dir).read_entries("cli")
    assert entry.prompt_token_ids == render_chat([{"role": "user", "content": "hi"}])


def test_cli_refuses_a_public_bind_without_token(fake: Server, tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokencapture",
            "gateway",
            "--upstream",
            fake.url,
            "--store",
            str(tmp_path),
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "bearer token" in result.stderr


def test_client_disconnect_mid_stream_marks_call_incomplete(
    gateway: tuple[Server, Path],
) -> None:
    server, store_dir = gateway
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer please"}],
        "stream": True,
        "fake_chunk_delay": 0.05,
    }
    with (
        httpx.Client() as client,
        client.stream(
            "POST",
            f"{server.url}/rollouts/gone/v1/chat/completions",
            json=body,
            headers={"x-model-call-id": "left"},
        ) as answer,
    ):
        lines = answer.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    # The connection is closed: the gateway marks the call and records why.
    store = TokenCaptureStore(store_dir)
    _wait_for(lambda: store.is_incomplete("gone"))
    assert store.read_entries("gone") == []
    ledger = store_dir / "gone.lineage.jsonl"
    _wait_for(ledger.exists)
    assert json.loads(ledger.read_text()) == {
        "failure_reason": "client_disconnected",
        "model_call_id": "left",
    }
    assert store.freeze_now("gone").incomplete


def _workers_of(server: Server) -> list[int]:
    """The worker processes of a gateway started with `--workers`: the members of its process
    group that uvicorn's supervisor spawned (multiprocessing's `spawn_main`; not its
    resource tracker, not the supervisor)."""
    assert server.process is not None
    group = server.process.pid
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[2]) == group and b"spawn_main" in command:
            workers.append(int(entry.name))
    return sorted(workers)


def _holds_open(pid: int, suffix: str) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).endswith(suffix):
                return True
    return False


def test_workers_serve_one_store_and_resolve_across_processes(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    """`--workers 2`: two processes accept calls on one port over one store. A conversation
    whose turns land on both (each call on a new connection, so either may accept it) is
    stored whole, and every continuation resolves its parent, whichever process put it."""
    server = start_gateway(fake.url, store_dir, tmp_path, "--workers", "2")
    try:
        _wait_for(lambda: len(_workers_of(server)) == 2, timeout=60)
        workers = _workers_of(server)
        # At least 6 turns, and until each worker has put one (holds the rollout's log open).
        turns = converse_on_new_connections(
            server.url,
            "across",
            6,
            until=lambda: all(_holds_open(w, "/across.tokens.jsonl") for w in workers),
        )
        assert _workers_of(server) == workers  # neither restarted
    finally:
        server.stop()
    entries = TokenCaptureStore(store_dir).freeze_now("across").entries
    assert [e.model_call_id for e in entries] == [f"c{t}" for t in range(turns)]
    for turn, entry in enumerate(entries[1:], start=1):
        assert entry.parent_resolution is ParentResolutionStatus.RESOLVED, (
            turn,
            entry.parent_resolution_reason,
        )
        assert entry.parent_call_id == f"c{turn - 1}"


SESSIONS = 16
KILLS = 20


def test_sigkill_under_concurrent_sessions_loses_no_acknowledged_call(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    """Every call whose answer reached the client is stored with exactly the answer's tokens;
    every other call is whole (its tokens are the engine's for its request) or absent."""
    run = run_kills(
        fake.url,
        store_dir,
        tmp_path,
        model=MODEL,
        sessions=SESSIONS,
        kills=KILLS,
        seed=26,
        window=(0.3, 1.5),
    )
    assert len(run.acknowledged) > KILLS * SESSIONS  # the load was real
    run.check_acknowledged()
    for key, entry in run.stored.items():
        # Whole: exactly the engine's tokens for the request that was sent.
        assert entry.prompt_token_ids == render_chat(run.sent[key]["messages"])
    print(
        f"{len(run.acknowledged)} acknowledged calls, all stored; {len(run.unacknowledged)} "
        "stored but unacknowledged (killed before the answer left)"
    )


def test_retrying_the_calls_a_sigkill_lost_masks_nothing(
    fake: Server, store_dir: Path, tmp_path: Path
) -> None:
    """After SIGKILLs under load, the clients retry every call whose answer they did not get,
    with its X-Model-Call-Id, through a new gateway on the same store, while the engine would
    now answer otherwise: a call the store kept (killed after the put) is answered with its
    stored tokens, one it did not keep is dispatched and stored; no retry is refused, and no
    rollout is masked at freeze (before replays, each kept call's retry was a 409 conflict
    that masked its rollout)."""
    run = run_kills(
        fake.url,
        store_dir,
        tmp_path,
        model=MODEL,
        sessions=SESSIONS,
        kills=KILLS,  # ~1 stored-but-unacknowledged call a kill: some are certain
        seed=27,
        window=(0.3, 1.5),
    )
    assert run.unacknowledged  # some answers were lost after their entry was stored
    lost = [key for key in run.sent if key not in run.acknowledged]
    server = start_gateway(fake.url, store_dir, tmp_path)
    try:
        with replying(fake.url, "retried"), httpx.Client(base_url=server.url, timeout=30) as client:
            for rollout, call_id in lost:
                answer = client.post(  # the same request: a replay needs it
                    f"/rollouts/{rollout}/v1/chat/completions",
                    json=run.sent[(rollout, call_id)],
                    headers={"x-model-call-id": call_id},
                )
                assert answer.status_code == 200, answer.text
                ids = answer.json()["choices"][0]["token_ids"]
                kept = run.stored.get((rollout, call_id))
                expected = kept.generation_token_ids if kept else [*encode("retried"), IM_END]
                assert ids == expected, (rollout, call_id)
    finally:
        server.stop()
    store = TokenCaptureStore(store_dir)
    for index in range(SESSIONS):
        assert not store.freeze_now(f"k{index}").incomplete, index
    print(f"{len(lost)} lost calls retried, {len(run.unacknowledged)} of them replayed")
