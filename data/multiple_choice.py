"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness and llm.c
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
from typing import Any, Callable, Dict, List, Optional, Tuple

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


class BadExample(ValueError):
    """A field of one example that no scoring can use: adapt() adds the file and the line."""


def shown(value: Any, width: int = 60) -> str:
    """`value` as the file spells it (JSON: null, true, Infinity for 1e400), cut short, on one line."""
    text = json.dumps(value, ensure_ascii=True, default=repr)
    return text if len(text) <= width else text[:width - 3] + "..."


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadExample(f"{name} is {shown(value)}, not a string")
    return value


def strings(value: Any, name: str) -> List[str]:
    """A list of at least two strings: a single choice always wins (100% accuracy, meaning nothing)."""
    if not isinstance(value, list) or len(value) < 2:
        raise BadExample(f"{name} is {shown(value)}; give a list of at least 2 strings")
    return [string(item, f"{name}[{i}]") for i, item in enumerate(value)]


def index(value: Any, name: str, count: int, of: str) -> int:
    """The gold choice: a whole number (or its digits: the hub's HellaSwag labels are strings)
    below `count`; int(1.5) would truncate and int(1e400) overflow."""
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, str)
                                       and re.fullmatch(r"[0-9]{1,9}", value.strip())):
        raise BadExample(f"{name} {shown(value)} is not the index of one of the {of} (0 to {count - 1})")
    if not 0 <= int(value) < count:
        raise BadExample(f"{name} {shown(value)} is out of range for {count} {of}")
    return int(value)


def hellaswag(doc: dict) -> Example:
    """HellaSwag's schema: activity_label, ctx_a, ctx_b, endings, label; the harness's context
    `activity_label + ": " + ctx_a + " " + ctx_b.capitalize()` (an empty label too)."""
    label, ctx_a, ctx_b = (string(doc[field], field) for field in ("activity_label", "ctx_a", "ctx_b"))
    context = label + ": " + ctx_a + " " + ctx_b.capitalize()
    endings = [hellaswag_text(ending) for ending in strings(doc["endings"], "endings")]
    return Example(hellaswag_text(context), [" " + e for e in endings], [len(e) for e in endings],
                   index(doc["label"], "label", len(endings), "endings"))


def arc(doc: dict) -> Example:
    """ARC's schema (ARC-Easy, ARC-Challenge): question, choices {text, label}, answerKey; the
    harness's "Question: ...\\nAnswer:" prompt."""
    question, key = string(doc["question"], "question"), string(doc["answerKey"], "answerKey")
    choices = doc["choices"]
    if not isinstance(choices, dict) or not {"text", "label"} <= set(choices):
        raise BadExample(f"choices is {shown(choices)}; give {{\"text\": [...], \"label\": [...]}}")
    texts, labels = strings(choices["text"], "choices.text"), strings(choices["label"], "choices.label")
    if len(texts) != len(labels):
        raise BadExample(f"choices.text has {len(texts)} choices and choices.label {len(labels)} labels; give one "
                         f"label per choice")
    if key not in labels:
        raise BadExample(f"answerKey {shown(key)} is not one of choices.label {shown(labels)}")
    return Example(f"Question: {question}\nAnswer:", [" " + t for t in texts], [len(t) for t in texts],
                   labels.index(key))


def piqa(doc: dict) -> Example:
    """PIQA's schema: goal, sol1, sol2, label; the harness's "Question: ...\\nAnswer:" prompt."""
    goal, solutions = string(doc["goal"], "goal"), [string(doc["sol1"], "sol1"), string(doc["sol2"], "sol2")]
    return Example(f"Question: {goal}\nAnswer:", [" " + s for s in solutions], [len(s) for s in solutions],
                   index(doc["label"], "label", 2, "solutions"))


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
    first in ADAPTERS whose fields the first line has. A DataError names the file, the line and the fix."""
    where = f"task file {str(path)!r}"
    if not path.is_file():
        raise DataError(f"{where} does not exist; give NAME=PATH of a JSON Lines file")
    try:
        lines = path.read_bytes().split(b"\n")  # JSON Lines ends a line at \n only: a string may hold U+2028
    except OSError as e:
        raise DataError(f"{where} could not be read: {type(e).__name__}: {e.strerror}") from None
    docs = [(number, parsed_line(line, f"{where} line {number}")) for number, line in enumerate(lines, 1)
            if line.strip()]
    return adapt(docs[:limit] if limit else docs, where, "line")


def parsed_line(line: bytes, where: str) -> dict:
    """One line's JSON object; json.loads raises RecursionError past about 1,000 nested arrays."""
    try:
        doc = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 (byte {e.start + 1}: {line[e.start:e.start + 1]!r}); "
                        f"save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not JSON ({e.msg}, column {e.colno}); give one JSON object per line") from None
    except (ValueError, RecursionError) as e:  # a number of over 4,300 digits; nesting too deep
        raise DataError(f"{where} cannot be read as JSON ({type(e).__name__}: {str(e)[:100]}); give one "
                        f"JSON object per line") from None
    if not isinstance(doc, dict):
        raise DataError(f"{where} is {shown(doc)}, not a JSON object; give one object per line")
    return doc


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
    return adapt(list(enumerate(map(dict, rows.select(range(min(limit, len(rows)))) if limit else rows), 1)),
                 f"the hub dataset {path}", "row")


def adapt(docs: List[Tuple[int, dict]], where: str, unit: str) -> List[Example]:
    """(number, doc) pairs as Examples through the first adapter of ADAPTERS whose fields the first
    doc has; a doc it cannot read is a DataError naming `where`, its `unit` ("line") and number."""
    if not docs:
        raise DataError(f"{where} holds no examples")
    first = docs[0][1]
    schema = next((name for name, (fields, _) in ADAPTERS.items() if all(f in first for f in fields)), None)
    if schema is None:
        known = "; ".join(f"{name}: {', '.join(fields)}" for name, (fields, _) in ADAPTERS.items())
        raise DataError(f"{where}: its first {unit} has fields {shown(sorted(map(str, first)), 300)}, none of "
                        f"the schemas ({known})")
    fields, adapter = ADAPTERS[schema]
    examples = []
    for number, doc in docs:
        try:
            missing = [f for f in fields if f not in doc]
            if missing:
                raise BadExample(f"lacks {', '.join(missing)} of the {schema} schema (its first {unit}'s)")
            examples.append(adapter(doc))
        except BadExample as e:
            raise DataError(f"{where} {unit} {number}: {e}") from None
    return examples


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
