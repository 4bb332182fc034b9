"""The Megatron learner against transformers, at two real layouts (torchrun, 2 processes, gloo):
an HF folder loaded into the shards and gathered back is bit-exact, and the learner's dense logprobs
and entropies (from vocab-parallel logits, through the pipeline schedule) equal the HF model's."""
import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_shards_round_trip_and_logprobs_match_hf(tiny_model_dir, tmp_path, tp, pp):
    out = tmp_path / "result.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "learner_check.py", tiny_model_dir, tp, pp, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["same_names"] and result["bit_exact"]
    assert result["max_abs_logprob_diff"] < 1e-4, result
    if pp == 1:  # entropy from vocab-parallel logits (TP2: each rank holds half the vocabulary)
        assert result["entropy_mean"] > 0.1
        assert result["max_abs_entropy_diff"] < 1e-4, result
