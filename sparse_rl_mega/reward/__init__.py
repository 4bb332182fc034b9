from sparse_rl_mega.reward.exact import exact_answer_reward, extract_final_number
from sparse_rl_mega.reward.math import extract_answer, extract_label
from sparse_rl_mega.reward.scorer import Scorer, ScorerStats, build_scorer, math_reward

__all__ = ["exact_answer_reward", "extract_final_number", "extract_answer", "extract_label", "math_reward",
           "Scorer", "ScorerStats", "build_scorer"]
