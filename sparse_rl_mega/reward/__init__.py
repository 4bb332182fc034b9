from sparse_rl_mega.reward.exact import exact_answer_reward, extract_final_number

__all__ = ["exact_answer_reward", "extract_final_number"]
