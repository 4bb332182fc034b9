"""Build a small HF model folder locally (no hub access): tokenizer, config, weights.

The tokenizer is a byte-level BPE trained on the training prompts and their worked answers; the model
has the shape of ``model.arch`` and is warm-started with supervised steps on ``prompt + worked answer``
(a row's own ``worked`` answer when the data file has one) so that sampled answers are sometimes right
and RL has a reward signal from the first iteration. This is a warm start for a model built here, not
a general supervised fine-tuning of a user's model: no held-out split, no checkpointing, one process.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from sparse_rl_mega.config import ArchConfig, TinyModelConfig
from sparse_rl_mega.config.hf import hf_rope_parameters
from sparse_rl_mega.data.jsonl import PromptDataset, json_objects

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def worked_answer(record_prompt: str, label: str) -> str:
    """The supervised target of a row without its own: a short explanation ending in the answer (long
    enough that decoding passes a small KV budget, so eviction is exercised by the CPU example)."""
    question = record_prompt.split("Q:", 1)[-1].split("= ?", 1)[0].strip()
    return f" {question} makes {label} . The answer is {label} ."


def worked_answers(train_path: str, prompt_key: str = "prompt") -> dict[str, str]:
    """``{prompt: worked answer}`` of the rows of ``train_path`` that carry a ``worked`` string."""
    return {row[prompt_key]: row["worked"] for _, _, row, problem in json_objects(train_path)
            if problem is None and isinstance(row.get("worked"), str) and isinstance(row.get(prompt_key), str)}


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # Pad to exactly vocab_size so every model row has a token (sampling can never hit a hole).
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return hf_tok


def hf_config(arch: ArchConfig, eos_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size,
                  num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                  num_key_value_heads=arch.num_query_groups, max_position_embeddings=arch.max_position_embeddings,
                  rms_norm_eps=arch.norm_eps, rope_theta=arch.rope_theta, tie_word_embeddings=arch.tie_word_embeddings,
                  bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if arch.head_dim is not None:
        common["head_dim"] = arch.head_dim
    if arch.rope_scaling is not None:  # (transformers 5.x: rope_theta inside, written as rope_parameters)
        common["rope_parameters"] = hf_rope_parameters(arch)
    if arch.family == "qwen2":
        return Qwen2Config(**common)
    if arch.family == "qwen3":
        return Qwen3Config(**common)
    return LlamaConfig(attention_bias=arch.qkv_bias, **common)


def build_tiny_model(out_dir: str | Path, arch: ArchConfig, spec: TinyModelConfig, train_path: str,
                     prompt_key: str = "prompt", label_key: str = "label", log=print) -> Path:
    """Create ``out_dir`` (atomically: built in a temp folder, then renamed). Returns its path."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    records = PromptDataset(train_path, prompt_key, label_key).records
    worked = worked_answers(train_path, prompt_key)
    texts = [r.prompt + worked.get(r.prompt, worked_answer(r.prompt, r.label)) for r in records]
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(texts * 4, min(spec.tokenizer_vocab_size, arch.vocab_size))
    if len(tokenizer) != arch.vocab_size:
        # model rows beyond the tokenizer would be unreachable holes; keep them equal
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<|pad_{i}|>" for i in range(arch.vocab_size - len(tokenizer))]})
    eos_id = tokenizer.eos_token_id
    config = hf_config(arch, eos_id)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config).float()

    if spec.warmup_sft_steps > 0:
        examples = []
        for record, text in zip(records, texts):
            prompt_len = len(tokenizer(record.prompt)["input_ids"])
            ids = tokenizer(text)["input_ids"] + [eos_id]
            examples.append((ids, prompt_len))
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr, weight_decay=0.0)
        steps = spec.warmup_sft_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, (lambda s: min(1.0, (s + 1) / 50) * max(0.1, 1 - s / steps)) if spec.warmup_decay
            else (lambda s: 1.0))
        generator = torch.Generator().manual_seed(spec.seed)
        model.train()
        for step in range(spec.warmup_sft_steps):
            picks = torch.randint(len(examples), (spec.warmup_batch_size,), generator=generator).tolist()
            width = max(len(examples[i][0]) for i in picks)
            input_ids = torch.full((len(picks), width), eos_id)
            labels = torch.full((len(picks), width), -100)
            for row, i in enumerate(picks):
                ids, prompt_len = examples[i]
                input_ids[row, :len(ids)] = torch.tensor(ids)
                labels[row, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            if step % 50 == 0 or step == spec.warmup_sft_steps - 1:
                log(f"[tiny model] warm-up step {step}: loss {loss.item():.3f}")
        model.eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one file: our own lines say where it went
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "sparse_rl_mega.json").write_text(json.dumps({"built_by": "sparse_rl_mega.models.tiny",
                                                             "train_path": str(train_path)}))
    os.replace(staging, out_dir)
    log(f"[tiny model] wrote {out_dir}")
    return out_dir
