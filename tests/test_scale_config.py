"""The learner settings of the GPU examples, checked on CPU without Transformer Engine: the Megatron
``TransformerConfig`` built for the 70B example (FP8 fields, bf16, sequence parallel, recompute) and
the layer spec chosen (Transformer Engine's, requested but not built here)."""
import sys

import pytest

from sparse_rl_mega.config import load_config
from tests.conftest import ROOT


def test_70b_transformer_config_without_importing_te():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparse_rl_mega.learner.model import transformer_config_kwargs

    cfg = load_config(ROOT / "examples" / "70b_math.yaml", ["parallel.recompute=selective", "model.fp8_recipe=mxfp8"])
    config = TransformerConfig(**transformer_config_kwargs(cfg))
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("hybrid", "mxfp8", False)
    assert config.bf16 and str(config.params_dtype) == "torch.bfloat16"
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (4, 8)
    assert config.sequence_parallel and config.recompute_granularity == "selective"
    assert (config.num_layers, config.hidden_size, config.num_query_groups, config.kv_channels) == (80, 8192, 8, 128)
    # interleaved pipeline: 5 chunks of 2 layers per rank, p2p per direction (not batched)
    assert config.virtual_pipeline_model_parallel_size == 5 and not config.batch_p2p_comm and config.overlap_p2p_comm
    assert config.context_parallel_size == 1
    split = load_config(ROOT / "examples" / "70b_math.yaml", ["parallel.context_parallel_size=2",
                                                              "parallel.pipeline_model_parallel_size=4"])
    config = TransformerConfig(**transformer_config_kwargs(split))
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "p2p")  # TE's ring attention
    assert "transformer_engine" not in sys.modules


def test_te_layer_spec_is_requested_for_transformer_engine(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    from sparse_rl_mega.learner.model import layer_spec

    calls = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kwargs: calls.append(("te", kwargs)) or "te-spec")
    cfg = load_config(ROOT / "examples" / "qwen2.5_7b_math.yaml")
    assert layer_spec(cfg) == "te-spec" and calls == [("te", {"qk_layernorm": False})]
    local = load_config(ROOT / "examples" / "qwen2.5_7b_math.yaml",
                        ["model.transformer_impl=local", "parallel.sequence_parallel=false"])
    assert layer_spec(local) != "te-spec" and len(calls) == 1
    # the local spec has no CP attention of Megatron's own: the all-gather one takes its place
    from sparse_rl_mega.learner.context_parallel import AllGatherKVAttention

    split = load_config(ROOT / "examples" / "qwen2.5_7b_math.yaml",
                        ["model.transformer_impl=local", "parallel.sequence_parallel=false",
                         "parallel.context_parallel_size=2"])
    assert layer_spec(split).submodules.self_attention.submodules.core_attention is AllGatherKVAttention
    assert layer_spec(local).submodules.self_attention.submodules.core_attention is not AllGatherKVAttention


def test_sequence_width_multiple_follows_sp_cp_and_fp8():
    """Micro-batch widths are padded so that CP chunks, the sequence-parallel split and FP8 GEMMs'
    16-token (MXFP8: 32) alignment all divide them (TP4 x SP, FP8 on the 70B example)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparse_rl_mega.learner.model import transformer_config_kwargs
    from sparse_rl_mega.learner.step import _sequence_multiple

    def multiple(*overrides):
        cfg = load_config(ROOT / "examples" / "70b_math.yaml", list(overrides))
        return _sequence_multiple(TransformerConfig(**transformer_config_kwargs(cfg)))

    assert multiple() == 4 * 16
    assert multiple("model.fp8_recipe=mxfp8") == 4 * 32
    assert multiple("parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=4") == 4 * 4 * 16
    assert multiple("model.fp8=null", "parallel.sequence_parallel=false") == 1


@pytest.mark.parametrize("edit, message", [
    ("model.fp8_param=true", "model.fp8_param: needs model.fp8"),
    ("model.fp8=hybrid model.fp8_param=true parallel.use_distributed_optimizer=false",
     "model.fp8_param: needs parallel.use_distributed_optimizer"),
    ("parallel.recompute=everything", "parallel.recompute"),
    ("model.transformer_impl=local", "the local layer spec's torch norms"),  # the 7B example has SP on
])
def test_scale_settings_are_validated(edit, message):
    from sparse_rl_mega.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "examples" / "qwen2.5_7b_math.yaml", edit.split())
