"""`make_token_store` reads a global config as NeMo Gym 0.7.0's does, config for config.

Before, a block without `enabled` (or a top-level `model_call_capture_dir` alone) built a store
where NeMo Gym reads capture as off, `"enabled": "false"` was true, and a typo in a key, an
enabled block with no directory or a `~/` directory turned capture off (or on) silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
from tests.nemo_oracle import import_nemo

from tokencapture import TokenCaptureStore
from tokencapture.config import make_token_store
from tokencapture.store import make_token_store as make_token_store_from_store

theirs = import_nemo("store")


def configs(root: Path) -> dict[str, Any]:
    d = str(root)
    return {
        "empty": {},
        "other keys only": {"policy_model": {"x": 1}},
        "legacy dir alone": {"model_call_capture_dir": d},
        "block without enabled": {"token_id_capture": {"dir": d}},
        "enabled": {"token_id_capture": {"enabled": True, "dir": d}},
        "enabled, legacy dir": {"token_id_capture": {"enabled": True}, "model_call_capture_dir": d},
        "enabled as a string": {"token_id_capture": {"enabled": "true", "dir": d}},
        "disabled as a string": {"token_id_capture": {"enabled": "false", "dir": d}},
        "disabled as off": {"token_id_capture": {"enabled": "off", "dir": d}},
        "disabled as 0": {"token_id_capture": {"enabled": 0, "dir": d}},
        "enabled, no directory": {"token_id_capture": {"enabled": True}},
        "enabled, no directory, no rebuild": {
            "token_id_capture": {"enabled": True, "rebuild_response": False}
        },
        "a typo in a key": {"token_id_capture": {"enabled": True, "dirr": d}},
        "a typo, disabled": {"token_id_capture": {"dirr": d}},
        "empty directory": {"token_id_capture": {"enabled": True, "dir": ""}},
        "relative directory": {"token_id_capture": {"enabled": True, "dir": "rel/dir"}},
        "home directory": {"token_id_capture": {"enabled": True, "dir": "~/capture"}},
        "relative, disabled": {"token_id_capture": {"dir": "rel/dir"}},
        "a directory that is a number": {"token_id_capture": {"enabled": True, "dir": 5}},
        "a block that is a string": {"token_id_capture": "notadict"},
        "a block that is a list": {"token_id_capture": []},
        "sink and lineage store": {
            "token_id_capture": {"enabled": True, "sink": "m:S", "lineage_store": "m:L"}
        },
        "sink without lineage store": {"token_id_capture": {"enabled": True, "sink": "m:S"}},
        "sink, unresolved allowed": {
            "token_id_capture": {
                "enabled": True,
                "sink": "m:S",
                "allow_unresolved_continuations": True,
            }
        },
        "external staging, rebuild on": {
            "token_id_capture": {"enabled": True, "dir": d, "external_staging": True}
        },
        "external staging": {
            "token_id_capture": {
                "enabled": True,
                "dir": d,
                "external_staging": True,
                "rebuild_response": False,
            }
        },
        "external staging, disabled": {
            "token_id_capture": {"external_staging": True, "rebuild_response": False}
        },
        "megatron without staging": {
            "token_id_capture": {
                "enabled": True,
                "dir": d,
                "external_staging_backend": "megatron_worker",
            }
        },
        "unknown backend": {
            "token_id_capture": {"enabled": True, "dir": d, "external_staging_backend": "x"}
        },
        "empty control token env": {
            "token_id_capture": {"enabled": True, "dir": d, "control_auth_token_env": ""}
        },
        "every setting": {
            "token_id_capture": {
                "enabled": True,
                "all_agents": True,
                "dir": d,
                "rebuild_response": True,
                "delta_records": True,
                "max_mask_fraction": 0.5,
                "mask_fraction_min_samples": 10,
                "sink_kwargs": {},
                "lineage_store_kwargs": {},
            }
        },
    }


def outcome(build: Any, config: Any) -> tuple[str, str | None]:
    """What a `make_token_store` made of `config`: a store's directory, None, or the kind of
    refusal."""
    try:
        store = build(config)
    except pydantic.ValidationError:
        return ("refused", None)
    except (ValueError, TypeError, AttributeError) as exc:
        return ("error", type(exc).__name__)
    return ("none", None) if store is None else ("store", str(store.root))


@pytest.mark.parametrize("name", list(configs(Path("/x"))))
def test_every_config_means_what_it_means_to_nemo_gym(name: str, tmp_path: Path) -> None:
    config = configs(tmp_path / "capture")[name]
    expected = outcome(theirs.make_token_store, config)
    assert outcome(make_token_store, config) == expected
    assert outcome(make_token_store_from_store, config) == expected
    # Refusals are ValueErrors (pydantic's), as SPEC says of a relative directory.
    if expected[0] == "refused":
        with pytest.raises(ValueError):
            make_token_store(config)


def test_an_enabled_block_builds_our_store_and_a_missing_config_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_token_store({"token_id_capture": {"enabled": True, "dir": str(tmp_path)}})
    assert isinstance(store, TokenCaptureStore) and store.root == tmp_path
    assert make_token_store(None) is None  # NeMo Gym refuses None; an empty config is off
    # "~" is not expanded: refused, and nothing is made in the home directory (it was).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match="absolute"):
        make_token_store({"token_id_capture": {"enabled": True, "dir": "~/capture"}})
    assert not (tmp_path / "home").exists()
