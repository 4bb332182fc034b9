#!/usr/bin/env python
"""Write the embedded CPU example's data: single-digit sums as ``{"prompt", "label"}`` jsonl rows.

    python tools/make_arith_data.py examples/data/arith_sums.jsonl
"""
import argparse
import json
import random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output jsonl path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [{"prompt": f"Q: {a} + {b} = ? A:", "label": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(args.seed).shuffle(rows)
    with open(args.out, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
