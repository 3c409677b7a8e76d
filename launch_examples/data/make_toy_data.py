"""Write the toy GRPO data set next to this file: a few arithmetic questions in verl's gsm8k parquet layout.

Enough for the pre-flight to open (schema and ``data.prompt_key``) and for a smoke run; train on real data.
Run: python launch_examples/data/make_toy_data.py
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

HERE = Path(__file__).resolve().parent
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def rows(split: str, count: int, offset: int) -> pa.Table:
    """``count`` questions ``a + b`` with their answers, as verl's gsm8k preprocessing writes them."""
    records = []
    for index in range(count):
        a, b = 3 * (index + offset) + 1, 7 * (index + offset) + 2
        records.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return pa.Table.from_pylist(records)


def main() -> None:
    """Write train.parquet (64 rows) and test.parquet (16 rows)."""
    pq.write_table(rows("train", 64, 0), HERE / "train.parquet")
    pq.write_table(rows("test", 16, 1000), HERE / "test.parquet")


if __name__ == "__main__":
    main()
