"""The NeMo Gym configuration path, the command line, and the metrics."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from tests.conftest import make_entry

from tokencapture import metrics, protocols
from tokencapture.cli import main
from tokencapture.config import make_token_store
from tokencapture.protocols import TokenCaptureConflictError
from tokencapture.store import TokenCaptureStore, canonical_line

# -- configuration ---------------------------------------------------------------------------


def load_class(spec: str) -> Any:
    """What NeMo Gym does with `module.path:ClassName`."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class NemoGymStyleEntry(BaseModel):
    """Stands in for NeMo Gym's own pydantic TokenEntry (same fields, another class)."""

    model_config = ConfigDict(extra="allow")


async def test_custom_sink_and_lineage_from_module_class_strings(tmp_path: Path) -> None:
    sink = load_class("tokencapture:TokenCaptureStore")(**{"root": str(tmp_path)})
    resolver = load_class("tokencapture:FileLineageStore")(**{"root": str(tmp_path)})
    assert isinstance(sink, protocols.TokenSink) and isinstance(sink, protocols.TokenSource)
    assert isinstance(resolver, protocols.LineageResolver)
    for member in ("put", "mark_incomplete", "close"):
        assert callable(getattr(sink, member))
    protocols.install_token_sink(sink)
    protocols.install_lineage_store(resolver)
    try:
        originals = [make_entry("gym", call=c, extra_field={"n": c}) for c in range(3)]
        for original in originals:
            await sink.put(NemoGymStyleEntry(**original.model_dump()))  # type: ignore[arg-type]
        snapshot = await sink.freeze("gym")
        assert [canonical_line(e) for e in snapshot.entries] == [
            canonical_line(e) for e in originals
        ]
    finally:
        protocols.install_token_sink(None)
        protocols.install_lineage_store(None)
        await resolver.close()
        await sink.close()


def test_make_token_store_reads_the_gym_config_block(tmp_path: Path) -> None:
    store = make_token_store({"token_id_capture": {"enabled": True, "dir": str(tmp_path / "a")}})
    assert isinstance(store, TokenCaptureStore) and store.root == tmp_path / "a"
    legacy = make_token_store(
        {"token_id_capture": {"enabled": True}, "model_call_capture_dir": str(tmp_path / "b")}
    )
    assert legacy is not None and legacy.root == tmp_path / "b"
    # Off unless enabled, as NeMo Gym reads it (tests/test_nemo_gym_config.py has the rest).
    assert make_token_store({"model_call_capture_dir": str(tmp_path / "b")}) is None
    assert make_token_store({"token_id_capture": {"enabled": False, "dir": str(tmp_path)}}) is None
    sink = {"enabled": True, "dir": str(tmp_path), "sink": "x:Y", "lineage_store": "x:Z"}
    assert make_token_store({"token_id_capture": sink}) is None
    assert make_token_store({}) is None
    assert make_token_store(None) is None
    with pytest.raises(ValueError, match="absolute"):
        make_token_store({"token_id_capture": {"enabled": True, "dir": "relative/dir"}})


# -- command line ----------------------------------------------------------------------------


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    root = tmp_path / "capture"
    store = TokenCaptureStore(root)
    for rollout in ("open-1", "frozen-1", "retired-1", "marked-1"):
        for call in range(2):
            store.append(make_entry(rollout, call=call))
    store._begin_call("open-1", "call-9")
    store.freeze_now("frozen-1")
    store.retire_now(["retired-1"])
    store._mark_incomplete("marked-1", "call-7")
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_human_and_json(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(capture))
    assert code == 0 and "4 rollout(s)" in out
    code, out, _ = run(capsys, "ls", str(capture), "--json")
    rows = {row["rollout_id"]: row for row in json.loads(out)}
    assert {r: rows[r]["status"] for r in rows} == {
        "open-1": "open",
        "frozen-1": "frozen",
        "retired-1": "retired",
        "marked-1": "incomplete",
    }
    assert rows["open-1"]["entries"] == 2 and rows["open-1"]["bytes"] > 0
    assert rows["retired-1"]["entries"] == 0 and rows["retired-1"]["bytes"] == 0


def test_ls_tells_a_rollout_it_cannot_open_from_a_damaged_one(
    capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log the store cannot open (here a directory where the file should be: an OSError, as a
    permission error is) was listed "corrupt", which sent operators looking for damage."""
    log = capture / "open-1.tokens.jsonl"
    log.unlink()
    log.mkdir()
    (capture / "frozen-1.tokens.jsonl").write_bytes(b"not a record\n")
    code, out, _ = run(capsys, "ls", str(capture), "--json")
    rows = {row["rollout_id"]: row for row in json.loads(out)}
    assert code == 0 and rows["marked-1"]["status"] == "incomplete"
    assert rows["open-1"]["status"] == "unreadable" and "directory" in rows["open-1"]["problem"]
    assert rows["frozen-1"]["status"] == "corrupt"


def test_show(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", str(capture), "open-1", "--json")
    shown = json.loads(out)
    assert code == 0
    assert [e["model_call_id"] for e in shown["entries"]] == ["call-0", "call-1"]
    assert shown["dangling_intents"] == ["call-9"] and shown["version"] == 2
    code, out, _ = run(capsys, "show", str(capture), "frozen-1")
    assert code == 0 and "frozen, version 3" in out
    code, _, err = run(capsys, "show", str(capture), "ghost")
    assert code == 2 and err.startswith("tokencapture: error:") and "ghost" in err


def test_show_leaves_out_a_torn_last_intent(
    capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash mid-append leaves a torn last line in the intents file: never acknowledged,
    it is no intent (the shared `complete_lines` reader, as the gateway's summary reads it),
    so `show` neither lists it nor counts it as a dangling intent."""
    intents = capture / "open-1.tokens.intents"
    with intents.open("ab") as file:
        file.write(b"torn-cal")
    code, out, _ = run(capsys, "show", str(capture), "open-1", "--json")
    shown = json.loads(out)
    assert code == 0
    assert "torn-cal" not in shown["intents"]
    assert shown["dangling_intents"] == ["call-9"]


def test_verify_passes_then_catches_each_corruption(
    capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "verify", str(capture))
    assert code == 0 and out.startswith("ok: 4 rollout(s)")
    logs = {rollout: capture / f"{rollout}.tokens.jsonl" for rollout in ("open-1", "frozen-1")}
    good = {rollout: log.read_bytes() for rollout, log in logs.items()}
    open_log = good["open-1"]
    # A changed byte in a line is caught by the line's digest in the state index, which a
    # freeze (or a mark, a conflict, a checkpoint) writes: open-1 has only been put to and has
    # none before its 64th entry, so its lines are read as they now say.
    corruptions = {
        "changed bytes": ("frozen-1", good["frozen-1"].replace(b"-0.25", b"-0.75", 1)),
        "bad middle line": (
            "open-1",
            open_log.split(b"\n")[0] + b"\n{not json\n" + open_log.split(b"\n")[1] + b"\n",
        ),
        "not an entry": ("open-1", open_log + b'{"model_call_id":"x"}\n'),
    }
    for name, (rollout, data) in corruptions.items():
        logs[rollout].write_bytes(data)
        code, out, _ = run(capsys, "verify", str(capture), "--json")
        report = json.loads(out)
        assert code == 1 and not report["ok"], name
        assert list(report["problems"]) == [rollout], name
        logs[rollout].write_bytes(good[rollout])
    state = capture / "marked-1.tokens.state.json"
    state.write_bytes(b"{truncated")
    code, out, _ = run(capsys, "verify", str(capture))
    assert code == 1 and "marked-1" in out and "not valid JSON" in out


def test_verify_checks_token_digests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", call=1, cum_len=5, digest="0" * 64))
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == 1 and "token digest mismatch" in out


def test_retire_delete_and_sweep(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "retire", str(capture), "open-1", "--json")
    assert code == 0 and json.loads(out) == {"removed": ["open-1"], "absent": []}
    code, out, _ = run(capsys, "sweep", str(capture), "--older-than", "1h", "--json")
    assert code == 0 and json.loads(out)["swept"] == []  # fences are fresh
    code, out, _ = run(capsys, "sweep", str(capture), "--older-than", "0s", "--dry-run", "--json")
    assert json.loads(out) == {"swept": ["open-1", "retired-1"], "dry_run": True}
    assert (capture / "open-1.tokens.state.json").exists()
    code, out, _ = run(capsys, "sweep", str(capture), "--older-than", "0s")
    assert code == 0 and "removed 2 retired fence(s)" in out
    assert not any(p.name.startswith(("open-1.", "retired-1.")) for p in capture.iterdir())
    code, out, _ = run(capsys, "delete", str(capture), "frozen-1", "--json")
    assert json.loads(out) == {"removed": ["frozen-1"], "absent": []}


def test_errors_are_one_line_and_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "ls", str(tmp_path / "missing"))
    assert code == 2 and err.count("\n") == 1 and "not a directory" in err
    code, out, err = run(capsys, "retire", str(tmp_path), "../bad")
    assert code == 2 and err.startswith("tokencapture: error:") and "Traceback" not in err
    assert out == ""  # exit 1 is kept for a check that ran and found problems
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(tmp_path), "--older-than", "soon"])
    assert info.value.code == 2


def test_console_entry_point_and_demo() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokencapture", "demo", "--rollouts", "2", "--calls", "2"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert result.returncode == 0, result.stderr
    assert "froze 2 entries" in result.stdout and "dropped=True" in result.stdout
    # Two rollouts of two calls: each second call resolves to its first call's tokens.
    assert "2 requests resolved to their parent call's exact tokens" in result.stdout


# -- metrics ---------------------------------------------------------------------------------


async def test_stats_count_operations_failures_and_latency(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = TokenCaptureStore(tmp_path)
    await store.put(make_entry("r", call=1))
    store.append(make_entry("r", call=2))
    with pytest.raises(ValueError):
        store.append(make_entry("r", call=2, generation_log_probs=[-1.0, -2.0]))
    with (
        caplog.at_level(logging.WARNING, logger="tokencapture"),
        pytest.raises(TokenCaptureConflictError),
    ):
        await store.put(make_entry("r", call=1, generation_log_probs=[-1.0, -2.0]))
    assert any("put: " in record.getMessage() for record in caplog.records)
    await store.mark_incomplete("r", "call-3")
    await store.freeze("r")
    stats = store.stats()
    assert stats["put"]["count"] == 4 and stats["put"]["failures"] == 2
    assert stats["mark_incomplete"]["count"] == 1 and stats["freeze"]["count"] == 1
    assert sum(stats["put"]["buckets"]) == 4
    assert 0 < stats["put"]["max_seconds"] <= stats["put"]["total_seconds"]
    merged = metrics.snapshot()
    assert merged["put"]["count"] >= 3
