"""A small multiple-choice task for the evaluation tests."""
import json
from pathlib import Path

# A HellaSwag-schema task: WikiHow's bracket artefacts, a context longer than the
# model's 32 positions (cut on the left), endings of different lengths (acc_norm differs from acc).
TASK = [
    {"activity_label": "Cooking", "ctx_a": "A man takes a pan [title] off the stove.", "ctx_b": "he",
     "endings": ["puts it on the table.", "sings a song to the pan for a long while.", "runs.", "is a cat."],
     "label": 0},
    {"activity_label": "Python", "ctx_a": "The function returns a list of the values", "ctx_b": "then the caller",
     "endings": ["sorts them.", "eats them [step] slowly.", "writes them to a file and closes it.", "flies."],
     "label": 2},
    {"activity_label": "Sports", "ctx_a": " ".join(["The players run across the field and the crowd cheers"] * 4),
     "ctx_b": "the ball", "endings": ["goes in.", "is red.", "was kicked over the wall by the goalkeeper.", "sleeps."],
     "label": 1},
    {"activity_label": "Science", "ctx_a": "Water boils at one hundred degrees.", "ctx_b": "ice",
     "endings": ["melts at zero.", "is hot.", "is a programming language.", "melts when it gets warm enough."],
     "label": 3},
    {"activity_label": "Music", "ctx_a": "She tunes the guitar", "ctx_b": "and",
     "endings": ["plays a chord.", "the guitar plays itself.", "eats.", "the [header] strings break."], "label": 0},
]


def write_task(path: Path) -> Path:
    """TASK as a JSON Lines file at `path`."""
    path.write_text("".join(json.dumps(doc) + "\n" for doc in TASK))
    return path
