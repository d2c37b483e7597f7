"""Tasks named without a path (data/multiple_choice.py: HUB_TASKS) are read by `datasets`
from the hub: here from local copies laid out as the hub lays them (parquet files per split, a
config per folder declared in the dataset card), through the same `load_dataset` call. The rows in
the hub's types (HellaSwag's label a string, ARC's choices a struct) give the examples a local
JSON Lines file of the same rows gives; `max_examples` keeps the first rows. Out of reach (offline),
a hub task stops the run before it starts with one line."""
import json
import os
import subprocess
import sys

import pytest
from datasets import Dataset

from data.multiple_choice import hub_examples, read_examples
from helpers.launcher import REPO, TINY
from helpers.multiple_choice_task import TASK

ARC = [{"id": "q1", "question": "Which is a gas at room temperature?",
        "choices": {"text": ["iron", "oxygen", "salt", "wood"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
       {"id": "q2", "question": "What do plants need for photosynthesis?",
        "choices": {"text": ["sunlight", "sand", "noise"], "label": ["1", "2", "3"]}, "answerKey": "1"}]


def test_hub_rows_give_the_examples_of_the_same_rows_in_a_file(tmp_path):
    hellaswag = tmp_path / "hellaswag"
    hellaswag.mkdir()
    Dataset.from_list([dict(doc, label=str(doc["label"])) for doc in TASK]).to_parquet(hellaswag / "validation.parquet")
    local = tmp_path / "hellaswag.jsonl"
    local.write_text("".join(json.dumps(doc) + "\n" for doc in TASK))
    assert hub_examples("hellaswag", 0, dataset_path=str(hellaswag)) == read_examples(local)
    assert hub_examples("hellaswag", 2, dataset_path=str(hellaswag)) == read_examples(local, 2)

    arc = tmp_path / "ai2_arc"
    (arc / "ARC-Easy").mkdir(parents=True)
    Dataset.from_list(ARC).to_parquet(arc / "ARC-Easy" / "test-00000-of-00001.parquet")
    (arc / "README.md").write_text("---\nconfigs:\n- config_name: ARC-Easy\n  data_files:\n  - split: test\n"
                                   "    path: ARC-Easy/test-*\n---\n")
    examples = hub_examples("arc_easy", 0, dataset_path=str(arc))
    assert [(e.context, e.choices, e.gold) for e in examples] == [
        ("Question: Which is a gas at room temperature?\nAnswer:", [" iron", " oxygen", " salt", " wood"], 1),
        ("Question: What do plants need for photosynthesis?\nAnswer:", [" sunlight", " sand", " noise"], 0)]


@pytest.mark.slow  # a process of its own: datasets reads the offline switch at import
def test_a_hub_task_out_of_reach_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "launch/train.py", "--recipe", str(TINY), "--set", "eval.tasks=[hellaswag]"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: task 'hellaswag': the hub dataset Rowan/hellaswag (default, validation) could "
                           "not be read") and last.endswith("give NAME=PATH of a local JSON Lines copy"), last
