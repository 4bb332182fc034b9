"""Turning raw math problems into training prompts and gold answers.

Shared by ``tools/prepare_data.py`` (which writes templated ``{"prompt", "label"}`` rows once) and by
the loader (``data.format: question_answer``, which formats raw ``{"question", "answer"}`` rows at
load time). Both build the same prompt for the same question:

* the user message is ``question + "\\n" + instruction`` (just the question when the instruction
  is empty);
* with a chat template it is rendered as one user turn with the generation prompt appended
  (``apply_chat_template(..., add_generation_prompt=True)``), so the prompt ends where the
  assistant's answer starts; without one the user message itself is the prompt.

Gold answers (:func:`extract_gold`): the text after the last ``####`` (GSM8K; thousands separators
removed from a plain number), else the content of the last ``\\boxed{}`` (MATH; braces balanced),
else the whole answer, stripped.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_PLAIN_NUMBER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Also reads the brace-less forms ``\\boxed 2`` and ``\\boxed {17}``. None when there is none or the
    last one is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    name_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    pos = name_end
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos < len(text) and text[pos] == "{":
        depth = 0
        for end in range(pos, len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
                if depth == 0:
                    return text[pos + 1:end].strip()
        return None  # unbalanced
    if pos == name_end:
        return None  # "\boxedfoo": not a box
    match = re.match(r"[^\s$]+", text[pos:])  # "\boxed 2$": up to whitespace or the closing $
    return match.group(0).rstrip(".,") if match else None


def extract_gold(answer: Any) -> Optional[str]:
    """The gold answer string of a raw answer (see the module docstring); None when it is empty."""
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, (int, float)):
        return str(answer)
    if not isinstance(answer, str):
        return None
    if "####" in answer:
        gold = answer.rsplit("####", 1)[1].strip()
        if _PLAIN_NUMBER.fullmatch(gold):
            gold = gold.replace(",", "")
    elif "\\boxed" in answer or "\\fbox" in answer:
        gold = last_boxed(answer)
    else:
        gold = answer.strip()
    return gold or None


def user_message(question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    question = question.strip()
    return f"{question}\n{instruction}" if instruction else question


def load_chat_tokenizer(path: str | Path):
    """An HF tokenizer that has a chat template; ValueError naming ``path`` otherwise."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not Path(path).is_dir():
        raise ValueError(f"{path}: no tokenizer folder there")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template")
    return tokenizer


def render_prompt(question: str, instruction: str = DEFAULT_INSTRUCTION, tokenizer=None) -> str:
    """The prompt text for ``question``: the chat-templated user turn when ``tokenizer`` is given."""
    message = user_message(question, instruction)
    if tokenizer is None:
        return message
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt. A prompt rendered with a chat template may already begin with the BOS
    text (Llama 3's ``<|begin_of_text|>``): then the tokenizer must not add a second one."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and prompt.startswith(bos))
    return tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
