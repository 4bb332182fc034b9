"""The full corrected loss's gradient does not depend on how the global batch is split.

One fixed global batch (8 sequences, veto + token rejection + IS truncation + PPO and dual clipping +
k3 KL + entropy bonus all active) is differentiated by the real Megatron learner under torchrun (gloo)
at several layouts; every gradient is gathered in HF names and compared with the single-process,
single-micro-batch reference, for the three loss aggregations. In float64 the layouts must agree to
rounding (the algorithm is exact); in float32 they may differ only by summation order.
"""
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "tests" / "helpers" / "grad_check.py"
# name: (processes, TP, PP, micro-batch size, more parallel settings); "reference" is one process,
# one micro-batch of 8
LAYOUTS = {"reference": (1, 1, 1, 8, {}), "4 micro-batches": (1, 1, 1, 2, {}), "DP2": (2, 1, 1, 2, {}),
           "TP2": (2, 2, 1, 2, {}), "PP2": (2, 1, 2, 2, {}),
           "TP2 selective recompute": (2, 2, 1, 2, {"recompute": "selective"}),
           "PP2 full recompute": (2, 1, 2, 2, {"recompute": "full"}),
           "PP2 x 2 virtual stages": (2, 1, 2, 2, {"virtual_pipeline_model_parallel_size": 2}),
           "CP2": (2, 1, 1, 2, {"context_parallel_size": 2}),
           "DP2 x CP2": (4, 1, 1, 2, {"context_parallel_size": 2}),
           "TP2 x CP2 selective recompute": (4, 2, 1, 2, {"context_parallel_size": 2, "recompute": "selective"})}
AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
TOLERANCE = {"float64": 1e-12, "float32": 5e-6}  # max |grad diff| / max |grad|


@pytest.fixture(scope="module")
def gradients(tiny_model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("grads")
    results = {}
    for name, (procs, tp, pp, mbs, parallel) in LAYOUTS.items():
        out = out_dir / f"{name.replace(' ', '_')}.pt"
        proc = run_torchrun(HELPER, tiny_model_dir, tp, pp, mbs, out, json.dumps(parallel), nproc=procs)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        results[name] = torch.load(out)
    return results


def test_the_batch_exercises_every_correction(gradients):
    metrics = gradients["reference"]["float64"]["metrics"]
    assert metrics["correction/veto_fraction"] == pytest.approx(1 / 8)
    assert 0 < metrics["correction/token_rejected_fraction"] < 1
    assert metrics["correction/is_weight_max"] > 1.5  # truncated at 1.5, then batch-normalised


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "reference"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradient_equals_reference(gradients, layout, dtype):
    for mode in AGG_MODES:
        ref = gradients["reference"][dtype][mode]
        got = gradients[layout][dtype][mode]
        assert ref["grads"].keys() == got["grads"].keys()
        scale = max(float(g.abs().max()) for g in ref["grads"].values())
        diff = max(float((ref["grads"][k] - got["grads"][k]).abs().max()) for k in ref["grads"])
        assert scale > 1e-3, "the gradient must not vanish, or the comparison proves nothing"
        assert diff <= TOLERANCE[dtype] * scale, (layout, dtype, mode, diff, scale)
        assert got["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE[dtype], abs=1e-12)


def test_aggregation_modes_give_different_gradients(gradients):
    """Guards the comparison above: the three normalisations really are different losses."""
    grads = gradients["reference"]["float64"]
    a, b = grads["seq-mean-token-mean"]["grads"], grads["token-mean"]["grads"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-3


def test_tied_embeddings_with_virtual_stages(tmp_path):
    """Tied input/output embeddings live in chunk 0 of the first pipeline rank and the last chunk of
    the last one: Megatron sums their gradients across the two; the tied gradient (and every other)
    equals the single-process one (float64, a random tied Llama)."""
    from tests.test_learner import RANDOM_MODELS, _build_random_model

    model_dir = _build_random_model(tmp_path / "llama-tied", *RANDOM_MODELS["llama-tied"])
    grads = {}
    for name, procs, pp, mbs, parallel in (("reference", 1, 1, 8, {}),
                                           ("virtual", 2, 2, 2, {"virtual_pipeline_model_parallel_size": 2})):
        out = tmp_path / f"{name}.pt"
        proc = run_torchrun(HELPER, model_dir, 1, pp, mbs, out, json.dumps(parallel), nproc=procs)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-4000:]}"
        grads[name] = torch.load(out)["float64"]
    for mode in AGG_MODES:
        ref, got = grads["reference"][mode]["grads"], grads["virtual"][mode]["grads"]
        assert "lm_head.weight" not in ref and ref.keys() == got.keys()
        scale = max(float(g.abs().max()) for g in ref.values())
        diff = max(float((ref[k] - got[k]).abs().max()) for k in ref)
        assert scale > 1e-3 and diff <= TOLERANCE["float64"] * scale, (mode, diff, scale)
