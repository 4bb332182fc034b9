"""Typed, validated run configuration.

A YAML file loads into :class:`RunConfig`, a tree of dataclasses (``run.py``; each section beside its
own checks: ``model.py`` / ``hf.py``, ``rollout.py``, ``algorithm.py``, ``evaluation.py``). Loading
(``loading.py``) checks, before any process starts heavy work:

* every key exists (``trainer.stepz`` -> "unknown key trainer.stepz; expected one of ...");
* every value has the declared type (ints are accepted where floats are expected);
* values are possible together (``validation.py``: TP divides the attention heads, the KV budget
  exceeds sink + recent window, the world size is divisible by TP x PP, ...).

Every problem raises :class:`ConfigError` whose message names the key path and what was expected.
Overrides use dotted paths: ``load_config(path, ["trainer.iterations=5"])``.
"""
from sparse_rl_mega.config.algorithm import CORRECTION_PRESETS, LOG_RHO_QUANTILES, AlgorithmConfig, CorrectionConfig
from sparse_rl_mega.config.errors import ConfigError
from sparse_rl_mega.config.hf import arch_from_hf_config, fill_arch_from_folder
from sparse_rl_mega.config.loading import config_from_dict, load_config, load_config_or_exit
from sparse_rl_mega.config.model import ArchConfig, ModelConfig, ParallelConfig, RopeScalingConfig, TinyModelConfig
from sparse_rl_mega.config.rollout import AutoBudgetConfig, KVCompressionConfig, RolloutConfig
from sparse_rl_mega.config.run import (CheckpointConfig, DataConfig, EvalConfig, RewardConfig, RunConfig,
                                       TrackingConfig, TrainerConfig)
from sparse_rl_mega.config.validation import validate

__all__ = ["AlgorithmConfig", "ArchConfig", "AutoBudgetConfig", "CORRECTION_PRESETS", "CheckpointConfig", "ConfigError",
           "CorrectionConfig", "DataConfig", "EvalConfig", "KVCompressionConfig", "LOG_RHO_QUANTILES", "ModelConfig",
           "ParallelConfig", "RewardConfig", "RolloutConfig", "RopeScalingConfig", "RunConfig", "TinyModelConfig", "TrackingConfig",
           "TrainerConfig", "arch_from_hf_config", "config_from_dict", "fill_arch_from_folder", "load_config",
           "load_config_or_exit", "validate"]
