"""Multiple-choice tasks scored by log-likelihood (issue 37), as lm-evaluation-harness and llm.c
score HellaSwag: each choice's continuation gets the summed log-probability of its tokens given
the context; the prediction is the choice with the highest sum (acc), or with the highest sum per
character of the choice (acc_norm).

A task file is JSON Lines, one example per line, in one of the schemas of ADAPTERS (each a small
adapter from the dataset's own fields to (context, choices, gold)). The token rules are the
harness's (`_encode_pair`, `_loglikelihood_tokens`):
- trailing spaces of the context move to the front of the continuation;
- enc is the tokenizer's own encoding, with the special tokens it adds (a Llama tokenizer's BOS);
- the continuation's tokens are enc(context + continuation) after the first len(enc(context));
- the model reads (context + continuation) tokens cut on the left to seq_len + 1, all but the
  last, and the continuation's tokens are the last targets.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from data.spec import DataError, check_no_credentials


@dataclass(frozen=True)
class Example:
    context: str
    choices: List[str]
    """Each choice as scored after the context (with its delimiter: HellaSwag's leading space)."""
    lengths: List[int]
    """Characters of each choice without the delimiter: acc_norm's divisor (the harness's)."""
    gold: int


def hellaswag_text(text: str) -> str:
    """The harness's HellaSwag preprocessing: WikiHow's bracketed artefacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(doc: dict) -> Example:
    """HellaSwag's schema: activity_label, ctx_a, ctx_b, endings, label; the harness's context
    `activity_label + ": " + ctx_a + " " + ctx_b.capitalize()` (an empty label too)."""
    context = doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    endings = [hellaswag_text(ending) for ending in doc["endings"]]
    return Example(hellaswag_text(context), [" " + e for e in endings], [len(e) for e in endings], int(doc["label"]))


def arc(doc: dict) -> Example:
    """ARC's schema (ARC-Easy, ARC-Challenge): question, choices {text, label}, answerKey; the
    harness's "Question: ...\\nAnswer:" prompt."""
    texts, labels = doc["choices"]["text"], doc["choices"]["label"]
    return Example(f"Question: {doc['question']}\nAnswer:", [" " + t for t in texts], [len(t) for t in texts],
                   labels.index(doc["answerKey"]))


def piqa(doc: dict) -> Example:
    """PIQA's schema: goal, sol1, sol2, label; the harness's "Question: ...\\nAnswer:" prompt."""
    solutions = [doc["sol1"], doc["sol2"]]
    return Example(f"Question: {doc['goal']}\nAnswer:", [" " + s for s in solutions], [len(s) for s in solutions],
                   int(doc["label"]))


ADAPTERS: Dict[str, Tuple[Tuple[str, ...], Callable[[dict], Example]]] = {
    "hellaswag": (("activity_label", "ctx_a", "ctx_b", "endings", "label"), hellaswag),
    "arc": (("question", "choices", "answerKey"), arc),
    "piqa": (("goal", "sol1", "sol2", "label"), piqa),
}
"""Schema name -> (the fields that identify it, its adapter)."""


HUB_TASKS: Dict[str, Tuple[str, Optional[str], str]] = {
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "piqa": ("baber/piqa", None, "validation"),
}
"""A task named without a path -> (hub dataset, config, split): the datasets and splits
lm-evaluation-harness scores (its test split where the task has one, else validation)."""


def read_examples(path: Path, limit: int = 0) -> List[Example]:
    """The examples of a local JSON Lines task file (the first `limit`, 0: all); the schema is the
    first in ADAPTERS whose fields the first line has. A DataError names the file and the fix."""
    if not path.is_file():
        raise DataError(f"task file {str(path)!r} does not exist; give NAME=PATH of a JSON Lines file")
    docs = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            docs.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"task file {str(path)!r}: line {number} is not JSON ({e.msg}); give one JSON object "
                            f"per line") from None
        if not isinstance(docs[-1], dict):
            raise DataError(f"task file {str(path)!r}: line {number} is not a JSON object; give one per line")
    return adapt(docs[:limit] if limit else docs, f"task file {str(path)!r}")


def hub_examples(name: str, limit: int = 0, dataset_path: Optional[str] = None) -> List[Example]:
    """The examples of HUB_TASKS[name] read by `datasets` (the first `limit`, 0: all);
    `dataset_path` reads the same rows from elsewhere (a local copy: the tests')."""
    from datasets import load_dataset
    path, config, split = HUB_TASKS[name]
    try:
        rows = load_dataset(dataset_path or path, config, split=split)
    except Exception as e:  # offline, gated, renamed: the same advice
        first_line = (str(e).splitlines() or [""])[0]
        raise DataError(f"task {name!r}: the hub dataset {path} ({config or 'default'}, {split}) could not be read "
                        f"({type(e).__name__}: {first_line}); give NAME=PATH of a local JSON Lines copy") from None
    return adapt([dict(row) for row in (rows.select(range(min(limit, len(rows)))) if limit else rows)],
                 f"the hub dataset {path}")


def adapt(docs: List[dict], where: str) -> List[Example]:
    """`docs` as Examples through the first adapter of ADAPTERS whose fields the first has."""
    if not docs:
        raise DataError(f"{where} holds no examples")
    schema = next((name for name, (fields, _) in ADAPTERS.items() if all(f in docs[0] for f in fields)), None)
    if schema is None:
        known = "; ".join(f"{name}: {', '.join(fields)}" for name, (fields, _) in ADAPTERS.items())
        raise DataError(f"{where}: its first line has fields {', '.join(sorted(docs[0]))}, none of "
                        f"the schemas ({known})")
    adapter = ADAPTERS[schema][1]
    try:
        return [adapter(doc) for doc in docs]
    except (KeyError, ValueError, TypeError) as e:
        raise DataError(f"{where} ({schema} schema): an example lacks or mis-types a field "
                        f"({type(e).__name__}: {e})") from None


def read_tasks(items: List[str], limit: int, option: str) -> List[Tuple[str, List[Example]]]:
    """(name, examples) of each NAME=PATH item of `option` (--tasks, eval.tasks); a bad item or file
    is a DataError naming it, before any process group."""
    check_no_credentials(option, items)  # first: the messages below repeat the items
    tasks = []
    for item in items:
        name, _, path = str(item).partition("=")
        if not isinstance(item, str) or not name or (not path and name not in HUB_TASKS):
            raise DataError(f"{option} {item!r}: give NAME=PATH, a JSON Lines file of HellaSwag's, ARC's or "
                            f"PIQA's schema, or a hub task's name: {', '.join(HUB_TASKS)}")
        if name in (seen[0] for seen in tasks):
            raise DataError(f"{option} names the task {name!r} twice; give each task its own name")
        tasks.append((name, read_examples(Path(path), limit) if path else hub_examples(name, limit)))
    return tasks


def continuation_tokens(encode: Callable[[str], List[int]], context: str, continuation: str
                        ) -> Tuple[List[int], List[int]]:
    """(context tokens, continuation tokens) by the harness's rule: trailing spaces of the context
    go to the continuation, which is what enc(context + continuation) adds after enc(context)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = encode(context + continuation), encode(context)
    return context_ids, whole[len(context_ids):]


def scored_window(context_ids: List[int], continuation_ids: List[int], seq_len: int
                  ) -> Tuple[List[int], int]:
    """(the model's input, at most seq_len tokens, cut on the left; how many of its last targets are
    the continuation's). The targets are the input shifted by one with the last continuation token."""
    tokens = (context_ids + continuation_ids)[-(seq_len + 1):]
    return tokens, min(len(continuation_ids), len(tokens) - 1)
