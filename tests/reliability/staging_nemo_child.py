"""A child process in which NeMo Gym's own worker capture drives a `FileStagingStore`.

``python -m tests.reliability.staging_nemo_child ROOT ROUND THREADS`` installs NeMo Gym's
``RolloutTokenCapture`` (``install_capture``, ``VLLMCaptureAdapter``) over a store on ROOT and
runs multi-turn ``token_in`` rollouts from THREADS threads until it is killed: each turn's prefix
inline or as a ``staging_chain`` fetched back from the store, vLLM-shaped responses or
``complete_call``, extras, attachments, float edges, now and then a sibling call or a
``fail_call``. Every acknowledged call is printed as one JSON line (``{"ack": key, ...}``) with
what its staged row must hold, computed from the inputs (not from the record the capture built),
so the parent (tests/test_staging_nemo_kills.py) can check each one after a SIGKILL. A failure
the child did not ask for prints ``{"unexpected": key}``.
"""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from tokencapture import FileStagingStore

_PRINT = threading.Lock()

# Log-probabilities at the float32 edges (NeMo Gym's digest hashes their float32 bits, the row
# keeps the float64 ones).
EDGES = [-0.0, -5e-324, -1.401298464324817e-45, -1e-40, -3.4028234663852886e38]
BIG_IDS = [0, 2**63, 2**64 - 1]


def emit(line: dict[str, Any]) -> None:
    with _PRINT:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def log_prob(rng: random.Random) -> float:
    return rng.choice(EDGES) if rng.random() < 0.2 else -rng.random() * 20


def token(rng: random.Random) -> int:
    return rng.choice(BIG_IDS) if rng.random() < 0.05 else rng.randrange(200_000)


def run(root: str, round_no: int, threads: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.nemo_oracle import import_nemo

    capture_mod = import_nemo("staging.capture")
    records = import_nemo("staging.records")
    vllm = import_nemo("adapters.vllm")
    store = FileStagingStore(root)
    capture = capture_mod.install_capture(
        capture_mod.CaptureHost(),
        sink=store,
        weight_version_fn=lambda: round_no,
        adapter=vllm.VLLMCaptureAdapter(),
    )

    def worker(thread: int) -> None:
        rng = random.Random(round_no * 1000 + thread)
        n = 0
        while True:
            n += 1
            rollout = f"r{round_no}-t{thread}-n{n}-ü"
            parent: Any = None  # (call id, coords, cumulative tokens, chain keys)
            for turn in range(rng.randrange(1, 5)):
                call_id = f"c{turn}"
                if parent is None:
                    admission = records.CaptureAdmission(
                        rollout_id=rollout, model_call_id=call_id, mode="text"
                    )
                    active = capture.begin_call(admission)
                    prefix: list[int] = []
                else:
                    parent_id, coords, tokens, chain = parent
                    common = {
                        "rollout_id": rollout,
                        "model_call_id": call_id,
                        "parent_call_id": parent_id,
                        "prev_len": len(tokens),
                        "mode": "token_in",
                        "parent_chain_hash": coords.chain_hash,
                    }
                    if rng.random() < 0.5:
                        admission = records.CaptureAdmission(**common, staging_chain=chain)
                        prefix = [t for s in store.fetch(chain) for t in s.token_ids_delta]
                        active = capture.begin_call(admission, prefix_token_ids=prefix)
                    else:
                        admission = records.CaptureAdmission(
                            **common, required_prefix_token_ids=tokens
                        )
                        prefix = list(tokens)
                        active = capture.begin_call(admission)
                prompt = prefix + [token(rng) for _ in range(rng.randrange(0 if prefix else 1, 30))]
                generated = [token(rng) for _ in range(rng.randrange(1, 20))]
                log_probs = [log_prob(rng) for _ in generated]
                extras = (
                    {"routed_experts": [[[rng.randrange(64), rng.randrange(64)]]]}
                    if rng.random() < 0.4
                    else None
                )
                pixels = np.arange(rng.randrange(1, 40), dtype=np.float32).reshape(-1, 1)
                attachments = {"pixels": pixels, "raw": b"\x00" * rng.randrange(9)}
                if rng.random() < 0.7:
                    attachments = None  # type: ignore[assignment]
                key = f"{rollout}/{call_id}"
                how = rng.random()
                if how < 0.05:
                    capture.fail_call(active, reason="engine error")
                    break
                if how < 0.5:
                    message: dict[str, Any] = {
                        "generation_token_ids": generated,
                        "generation_log_probs": log_probs,
                    }
                    if extras is not None:
                        message.update(extras)
                    payload = {"prompt_token_ids": prompt, "choices": [{"message": message}]}
                    coords = capture.complete_call_from_response(
                        active, payload, attachments=attachments
                    )
                else:
                    coords = capture.complete_call(
                        active,
                        prompt_token_ids=prompt,
                        generated_token_ids=generated,
                        generated_logprobs=log_probs,
                        extras=extras,
                        attachments=attachments,
                    )
                if coords.disposition != "staged":
                    emit({"unexpected": key})
                    break
                carried = len(prompt) - len(prefix)
                emit(
                    {
                        "ack": key,
                        "rollout": rollout,
                        "call": call_id,
                        "coords": coords.model_dump(mode="json"),
                        "delta": prompt[len(prefix) :] + generated,
                        "mask": [0.0] * carried + [1.0] * len(generated),
                        "log_probs": [float(x).hex() for x in [0.0] * carried + log_probs],
                        "extras": extras,
                        "pixels": None if attachments is None else pixels.tobytes().hex(),
                        "raw": None if attachments is None else attachments["raw"].hex(),
                    }
                )
                if rng.random() < 0.15 and parent is not None:
                    continue  # the next call is a sibling of this one: same parent
                chain = [] if parent is None else parent[3]
                parent = (call_id, coords, prompt + generated, [*chain, key])

    for thread in range(threads):
        threading.Thread(target=worker, args=(thread,), daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
