"""Data loading and the exact-answer reward."""
import json

import pytest

from sparse_rl_mega.data import DataError, PromptDataset
from sparse_rl_mega.reward import exact_answer_reward


def test_bad_rows_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1", "label": "2"}\n{"prompt": "x"\n\n{"prompt": "", "label": "3"}\n[1]\n')
    with pytest.raises(DataError) as info:
        PromptDataset(path)
    message = str(info.value)
    assert "3 bad row(s)" in message
    assert f"{path}:2: not valid JSON" in message
    assert f"{path}:4: key 'prompt'" in message and f"{path}:5: expected a JSON object" in message


def test_batches_are_deterministic_and_cover_epochs(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": i}) + "\n" for i in range(10)))
    data = PromptDataset(path)
    first = [r.prompt for it in range(5) for r in data.batch(it, 2, seed=3)]
    again = [r.prompt for it in range(5) for r in data.batch(it, 2, seed=3)]
    assert first == again and sorted(first) == sorted(f"q{i}" for i in range(10))
    assert data.batch(2, 2, seed=3)[0].label == str(int(data.batch(2, 2, seed=3)[0].prompt[1:]))


@pytest.mark.parametrize("response, label, reward", [
    (" 3 + 4 makes 7 . The answer is 7 .", "7", 1.0),
    (" the answer is \\boxed{1,000}", "1000", 1.0),
    (" 3 + 4 makes 7 . The answer is 8 .", "7", 0.0),
    ("no number here", "7", 0.0),
    ("7.0", "7", 1.0),
    ("9" * 100_000, "7", 0.0),
])
def test_exact_answer_reward(response, label, reward):
    assert exact_answer_reward(response, label) == reward
