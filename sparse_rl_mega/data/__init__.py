from sparse_rl_mega.data.jsonl import (DataError, PromptDataset, PromptLabelFormat, PromptRecord, QuestionAnswerFormat,
                                       RowError, load_prompt_dataset)

__all__ = ["PromptDataset", "PromptRecord", "DataError", "RowError", "PromptLabelFormat", "QuestionAnswerFormat",
           "load_prompt_dataset"]
