from sparse_rl_mega.data.jsonl import PromptDataset, PromptRecord, DataError

__all__ = ["PromptDataset", "PromptRecord", "DataError"]
