"""`make_token_store` reads a global config as NeMo Gym 0.7.0's does, config for config.

Before, a block without `enabled` (or a top-level `model_call_capture_dir` alone) built a store
where NeMo Gym reads capture as off, `"enabled": "false"` was true, and a typo in a key, an
enabled block with no directory or a `~/` directory turned capture off (or on) silently.
"""

from __future__ import annotations

import sys
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


nemo_config = import_nemo("config")

# Each endpoint config and what building it gives (the protocol checks need Python 3.12's
# `__protocol_attrs__` in NeMo Gym's own code, which runs on 3.13: where it can run, its answer
# is compared too).
ENDPOINTS = {
    "our store as the sink": (
        ("sink", "tokencapture:TokenCaptureStore", {"root": "{root}"}),
        ("built", "TokenCaptureStore"),
    ),
    "our resolver": (
        ("lineage_store", "tokencapture:FileLineageStore", {"root": "{root}"}),
        ("built", "FileLineageStore"),
    ),
    "no colon": (("sink", "tokencapture.TokenCaptureStore", {}), ("refused", "ValueError")),
    "no such module": (("sink", "no_such_module_here:Sink", {}), ("refused", "ValueError")),
    "no such class": (
        ("lineage_store", "tokencapture:NoSuchResolver", {}),
        ("refused", "ValueError"),
    ),
    "wrong arguments": (
        ("sink", "tokencapture:TokenCaptureStore", {"nope": 1}),
        ("refused", "ValueError"),
    ),
    "not a sink": (("sink", "collections:OrderedDict", {}), ("refused", "ValueError")),
    "not a resolver": (
        ("lineage_store", "tokencapture:TokenCaptureStore", {"root": "{root}"}),
        ("refused", "ValueError"),
    ),
}


def built(config_class: Any, block: dict[str, Any], method: str) -> tuple[str, str | None]:
    try:
        endpoint = getattr(config_class.model_validate({"token_id_capture": block}), method)()
    except ValueError as exc:
        return ("refused", type(exc).__name__)
    return ("built", None if endpoint is None else type(endpoint).__name__)


@pytest.mark.parametrize("name", list(ENDPOINTS))
def test_endpoints_are_built_and_checked_as_nemo_gym_builds_them(name: str, tmp_path: Path) -> None:
    """`build_sink` and `build_lineage_store` (NeMo Gym's server processes call them) load
    ``module:Class``, construct it with its kwargs and check it against the protocol."""
    from tokencapture import TokenIdCaptureConfig

    (kind, target, kwargs), expected = ENDPOINTS[name]
    kwargs = {k: str(tmp_path) if v == "{root}" else v for k, v in kwargs.items()}
    block = {
        "enabled": True,
        kind: target,
        f"{kind}_kwargs": kwargs,
        "allow_unresolved_continuations": True,
        "dir": str(tmp_path),
    }
    method = "build_sink" if kind == "sink" else "build_lineage_store"
    assert built(TokenIdCaptureConfig, block, method) == expected
    if sys.version_info >= (3, 12):
        assert built(nemo_config.TokenIdCaptureConfig, block, method) == expected
    disabled = {**block, "enabled": False}
    assert built(TokenIdCaptureConfig, disabled, method) == ("built", None)


def test_the_control_token_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokencapture.config import TokenIdCaptureSettings

    settings = TokenIdCaptureSettings(control_auth_token_env="TC_TEST_CONTROL")
    monkeypatch.delenv("TC_TEST_CONTROL", raising=False)
    with pytest.raises(ValueError, match="TC_TEST_CONTROL"):
        settings.resolve_control_auth_token()
    monkeypatch.setenv("TC_TEST_CONTROL", "secret")
    assert settings.resolve_control_auth_token() == "secret"
