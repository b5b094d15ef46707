"""Who prints the store's log records: nobody, unless the application asks.

Without a handler of its own, Python's last-resort handler wrote every logged failure to
stderr: a CLI error came out twice (the operation's warning, then the CLI's own line) and a put
failing on a full disk wrote a line each (found filling a tmpfs). The library now has only a
`NullHandler`; the gateway, an application, puts its loggers on uvicorn's stderr handler.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import make_entry

from tokencapture import TokenCaptureStore


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )


def test_an_application_that_configures_no_logging_sees_none() -> None:
    done = run_python(
        "import logging, tokencapture\n"
        "logging.getLogger('tokencapture.store').warning('put failed')\n"
        "logging.getLogger('tokencapture.store').error('corrupt')\n"
    )
    assert done.returncode == 0 and done.stderr == ""


def test_an_application_that_configures_logging_sees_it_all() -> None:
    done = run_python(
        "import logging, tokencapture\n"
        "logging.basicConfig(format='%(name)s %(message)s')\n"
        "logging.getLogger('tokencapture.store').warning('put failed')\n"
    )
    assert done.stderr == "tokencapture.store put failed\n"


def test_a_failed_cli_command_says_so_in_one_line(tmp_path: Path) -> None:
    """A retire whose state file cannot be replaced (a directory stands where it goes: an
    OSError, as a full disk's is) logged its warning and then the CLI's error line."""
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", call=0))
    Path(store.state_path_for("r")).mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tokencapture", "retire", str(tmp_path), "r"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert done.stderr.startswith("tokencapture: error:") and done.stderr.count("\n") == 1


def test_the_gateway_puts_the_store_loggers_on_its_stderr_handler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("uvicorn")
    from tokencapture.gateway import server

    ran: dict[str, Any] = {}
    monkeypatch.setattr(server.uvicorn, "run", lambda app, **options: ran.update(options))
    monkeypatch.setattr(server, "raise_descriptor_limit", lambda: None)  # not this process's
    server.serve(upstream="http://127.0.0.1:9", store_dir=str(tmp_path), log_level="info")
    config = ran["log_config"]
    assert config["loggers"]["tokencapture"] == {
        "handlers": ["default"],
        "level": "INFO",
        "propagate": False,
    }
    # The same configuration, applied in a fresh process, prints a store warning.
    done = run_python(
        "import logging.config, tokencapture\n"
        "from tokencapture.gateway.server import log_config\n"
        "logging.config.dictConfig(log_config('warning'))\n"
        "logging.getLogger('tokencapture.gateway').warning('marking the call failed')\n"
        "logging.getLogger('tokencapture.gateway').info('not at this level')\n"
    )
    assert "marking the call failed" in done.stderr and "not at this level" not in done.stderr
