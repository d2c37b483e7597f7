"""Our multiple-choice scores against the real lm-evaluation-harness: the exported
transformers model scored by lm-eval 0.4.13 (HFLM, its own hellaswag / arc_easy / piqa task
configs) and our checkpoint scored by launch/evaluate.py give the same acc and acc_norm, and
every choice the same log-likelihood.

    bash bench/peers/harness_setup.sh              # once: .venv-harness (this project + lm-eval[hf] 0.4.13)
    .venv-harness/bin/python bench/peers/harness_check.py [--steps 8] [--examples 100] [--keep DIR] [--json] [--bos]

Fully offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): nothing is downloaded. Steps:
1. a tiny run (recipes/tiny.yaml: seq_len 32, the builtin tokenizer, vocabulary 4100 padded to a
   multiple of 8, as tests/checkpoints/test_export.py) of --steps steps on one process, saved, and
   exported with launch/export_hf.py;
2. three local JSON Lines task files, in HellaSwag's, ARC's and PIQA's schemas, made here
   (deterministic): WikiHow's bracket artefacts, lower-case ctx_b (capitalize), empty ctx_b,
   contexts longer than the model's 32 positions (cut on the left), endings of very different
   lengths (acc_norm differs from acc), non-ASCII choices (acc_norm counts characters, not bytes),
   "&", "<" and quotes (no HTML escaping in the harness's Jinja), ARC with 3 to 5 choices and
   numeric answer keys;
3. ours: `deepspeed --num_gpus 1 launch/evaluate.py --load CK --tasks ... --metrics-out F`, and the
   same at --tp 2 --pp 2 on 4 processes;
4. the harness: `lm_eval.simple_evaluate` with `HFLM(pretrained=EXPORT, device="cpu",
   dtype="float32", batch_size=4)`, zero-shot, `log_samples=True`, on task configs written to a
   temporary folder (TaskManager(include_path=...)): the harness's own hellaswag.yaml,
   arc_easy.yaml and piqa.yaml as installed, loaded and written back with only where the data
   comes from changed (dataset_path json, data_files the local file, no training split, the
   task's name), hellaswag's process_docs the harness's own function (lm_eval.tasks.hellaswag.utils).
   HFLM takes its max_length from the config's n_positions (32): checked.
With --bos both sides use the builtin tokenizer made to add a BOS token (<|endoftext|>) before
every text, as Llama's tokenizers do: written into the export, and given to ours with
--set data.tokenizer=DIR. HFLM's default leaves special tokens to the tokenizer, so the harness
scores with the BOS token; ours must too.

Per task and layout: n, acc, acc_norm (harness and ours), the largest relative difference of a
choice's log-likelihood, how many examples the harness asked the model exactly what we ask it
(its requests' (context, continuation) strings and its gold index against our adapter's), how
many get the same acc and acc_norm decision, and in how many acc_norm picks another choice than
acc (the files tell the two apart). Exit 1 when acc or acc_norm differ, a request or a decision
differs, or a log-likelihood differs by more than 1e-4 relative: both sides run the same fp32
weights on CPU, but through different code (our pipeline engine and vocab-parallel cross-entropy
over a padded vocabulary, sequences padded to 32 on the right; transformers' GPT2LMHeadModel with
log_softmax, batches of the harness's own length-sorted padding), so the sums differ by fp32
rounding, about 1e-7 relative; 1e-4 leaves room for that and still catches any token scored
differently (a token of this model costs about 6 nats, a sum is tens of nats) or a BOS token one
side adds (1e-3 here: docs/evaluation.md, "Against lm-evaluation-harness").
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO

RECIPE = REPO / "recipes" / "tiny.yaml"
VOCAB = ["--set", "model.vocab_size=4100", "--set", "model.vocab_pad_multiple=8"]
SEQ_LEN = 32
REL = 1e-4
LAYOUTS = {"1x1x1": (1, []), "tp2xpp2": (4, ["--tp", "2", "--pp", "2"])}
HARNESS_TASKS = {"hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
                 "arc_easy": ("arc/arc_easy.yaml", "test"),
                 "piqa": ("piqa/piqa.yaml", "validation")}
"""Our task name -> (the harness's YAML under lm_eval/tasks, the split it scores)."""


# ------------------------------------------------------------------ the task files

ACTIVITIES = ["Cooking", "Python", "Sports", "Science", "Music", "Making a sandwich", "Gardening",
              "Home and Garden", "Washing dishes", "Playing the piano"]
SUBJECTS = ["A man", "The woman", "A small child", "The program", "The teacher", "A dog", "The interpreter",
            "Two friends", "The function", "A group of people"]
ACTIONS = ["takes a pan [title] off the stove.", "opens the file and reads the first line.",
           "runs across the field [step] while the crowd cheers.", "writes a list of the values.",
           "tunes the guitar [header] slowly.", "raises an exception when the key is missing.",
           "puts the seeds in the ground.", "calls the method with two arguments.",
           "fills the sink with warm water.", "imports the module [substeps] before it starts."]
CONTINUATIONS = ["he", "then the caller", "and", "she", "the class", "they", "", "it", "the loop", "finally"]
ENDINGS = ["puts it on the table.", "runs.", "is a cat.", "sings a song to the pan for a long while.",
           "returns None.", "writes them to a file [title] and closes it.", "flies.", "sorts them.",
           "melts at zero.", "is hot.", "eats them [step] slowly.", "goes in.",
           "raises a ValueError with a message that names the argument and the value it was given.",
           "prints the café's menu — naïve but fine.", "loops forever.", "returns the string 'x' & \"y\".",
           "compares a < b and b > c.", "waits.", "closes the socket after the last byte is sent.",
           "is a programming language.", "the [header] strings break.", "calls itself recursively until the stack overflows."]
QUESTIONS = ["Which statement creates a new list?", "What does the interpreter do when a module is imported?",
             "Which of these is a mutable type?", "What is printed by print(1 < 2 & 3)?",
             "Why does the loop never end?", "Which keyword defines a function?",
             "What does \"None\" mean when it is returned?", "Which operation raises a KeyError?",
             "Where are the arguments of a call stored?", "What happens to the file's contents after close?"]
ANSWERS = ["a list", "def", "it returns None", "the dictionary lookup", "a tuple of the values", "True",
           "the module's code runs once and its names are bound", "an exception is raised",
           "nothing: the file is closed and the object can no longer read", "the stack", "lambda",
           "a set of the keys & values", "the café", "it is < 3", "'quoted' text", "class"]
GOALS = ["How do you open a file for reading?", "To sort a list of numbers in place,",
         "How can you make the dough rise faster?", "To remove the last element of a list,",
         "How do you clean a cast iron pan?", "To find out whether a key is in a dictionary,",
         "How do I keep the seeds moist?", "To print a value with two decimals,"]
SOLUTIONS = ["use open(path) and read it.", "call the sort method.", "put it somewhere warm.", "use pop().",
             "scrub it with salt and oil, then dry it on the stove.", "use the in operator.", "cover them.",
             "write it with an f-string and a format such as .2f inside the braces.", "throw it away.",
             "heat it.", "ask the interpreter to guess & hope.", "use a < comparison.", "delete the file."]


def _long(rng, words):
    """A context far longer than the model's 32 positions: cut on the left by both sides."""
    return " ".join(rng.choice(words) for _ in range(rng.randint(6, 10)))


def hellaswag_docs(n, rng):
    docs = []
    for i in range(n):
        ctx_a = (_long(rng, ACTIONS) if i % 4 == 3 else f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)}")
        endings = rng.sample(ENDINGS, 4)
        docs.append({"ind": i, "activity_label": rng.choice(ACTIVITIES), "ctx_a": ctx_a,
                     "ctx_b": rng.choice(CONTINUATIONS), "endings": endings, "label": rng.randrange(4),
                     "source_id": f"bench~{i}", "split": "val", "split_type": "indomain"})
    return docs


def arc_docs(n, rng):
    docs = []
    for i in range(n):
        k = 3 + i % 3  # 3, 4 or 5 choices
        labels = [str(j + 1) for j in range(k)] if i % 5 == 4 else "ABCDE"[:k]
        question = (_long(rng, QUESTIONS) if i % 4 == 3 else rng.choice(QUESTIONS))
        docs.append({"id": f"bench_{i}", "question": question,
                     "choices": {"text": rng.sample(ANSWERS, k), "label": list(labels)},
                     "answerKey": labels[rng.randrange(k)]})
    return docs


def piqa_docs(n, rng):
    docs = []
    for i in range(n):
        goal = _long(rng, GOALS) if i % 4 == 3 else rng.choice(GOALS)
        sol1, sol2 = rng.sample(SOLUTIONS, 2)
        docs.append({"goal": goal, "sol1": sol1, "sol2": sol2, "label": rng.randrange(2)})
    return docs


def write_tasks(folder: Path, n: int) -> dict:
    """Our task name -> its JSON Lines file."""
    rng = random.Random(37)
    paths = {}
    for name, make in (("hellaswag", hellaswag_docs), ("arc_easy", arc_docs), ("piqa", piqa_docs)):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in make(n, rng)))
    return paths


def coverage(paths: dict, export: Path) -> dict:
    """Per task: choices, and how many choice sequences are longer than the model (context cut on
    the left), by our own rules (data/multiple_choice.py) and the exported tokenizer."""
    from transformers import AutoTokenizer

    from data.multiple_choice import continuation_tokens, read_examples
    tokenizer = AutoTokenizer.from_pretrained(str(export), trust_remote_code=False)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731  (ours: the tokenizer's own special tokens)
    out = {}
    for name, path in paths.items():
        examples = read_examples(path)
        pairs = [continuation_tokens(encode, ex.context, c) for ex in examples for c in ex.choices]
        out[name] = {"choices": len(pairs), "cut": sum(len(a) + len(b) > SEQ_LEN + 1 for a, b in pairs),
                     "longest_continuation": max(len(b) for _, b in pairs)}
    return out


# ------------------------------------------------------------------ the two sides

def run(cmd, env=None, what=""):
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def add_bos(export: Path) -> Path:
    """The export's tokenizer made to add a BOS token (<|endoftext|>) before every text, written
    back into the export (what HFLM loads); its folder, for ours."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=False)
    bos = tokenizer.bos_token or tokenizer.eos_token
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    tokenizer.save_pretrained(export)
    reloaded = AutoTokenizer.from_pretrained(export, trust_remote_code=False)
    assert reloaded("a b")["input_ids"][0] == tokenizer.convert_tokens_to_ids(bos)
    return export


def train_and_export(work: Path, steps: int, env) -> tuple:
    from launch.engine.distributed import launcher_command
    ck, export = work / "ck", work / "hf"
    run(launcher_command(1, REPO / "launch" / "train.py") + ["--recipe", RECIPE, "--steps", steps, "--save", ck,
                                                              "--set", "train.eval_every=0"] + VOCAB,
        env, "training")
    run([sys.executable, "launch/export_hf.py", "--load", ck, "--out", export], env, "export")
    return ck, export


def ours(ck: Path, paths: dict, layout: str, out: Path, env, tokenizer: Path = None) -> dict:
    """Our task name -> record of launch/evaluate.py --metrics-out at `layout` (with `tokenizer`
    instead of the checkpoint's)."""
    from launch.engine.distributed import launcher_command
    procs, flags = LAYOUTS[layout]
    if tokenizer is not None:
        flags = flags + ["--set", f"data.tokenizer={tokenizer}"]
    run(launcher_command(procs, REPO / "launch" / "evaluate.py")
        + ["--load", ck, *flags, "--batches", "1", "--metrics-out", out,
           "--tasks", *[f"{name}={path}" for name, path in paths.items()]], env, f"launch/evaluate.py at {layout}")
    return {r["task"]: r for r in map(json.loads, out.read_text().splitlines())}


class _Function(str):
    """A `!function` value of a task YAML, kept as written."""


def harness_configs(paths: dict, folder: Path) -> dict:
    """Writes the harness's own task YAMLs with the data source changed; our name -> harness task."""
    import yaml

    import lm_eval.tasks

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    yaml.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))
    root = Path(lm_eval.tasks.__file__).parent
    names = {}
    for name, (relative, split) in HARNESS_TASKS.items():
        source = root / relative
        config = yaml.load(source.read_text(), Loader=Loader)
        config.update(task=f"bench_{name}", dataset_path="json", dataset_name=None,
                      dataset_kwargs={"data_files": {split: str(paths[name])}}, training_split=None,
                      validation_split=split if split == "validation" else None,
                      test_split=split if split == "test" else None)
        config.pop("tag", None)
        if isinstance(config.get("process_docs"), _Function):  # utils.process_docs beside the harness's YAML
            module = ".".join(source.relative_to(root.parent.parent).with_suffix("").parts[:-1])
            config["process_docs"] = _Function(f"{module}.{config['process_docs']}")
        (folder / f"bench_{name}.yaml").write_text(yaml.dump(config, sort_keys=False, allow_unicode=True))
        names[name] = f"bench_{name}"
    return names


def harness(export: Path, paths: dict, folder: Path, batch_size: int) -> dict:
    """Our task name -> {acc, acc_norm, n, choice_loglikelihoods, samples} from lm-eval."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    names = harness_configs(paths, folder)
    model = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=batch_size)
    assert model.max_length == SEQ_LEN, f"HFLM's max_length {model.max_length}, the model's n_positions {SEQ_LEN}"
    result = lm_eval.simple_evaluate(model=model, tasks=list(names.values()), num_fewshot=0,
                                     task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                     bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    out = {}
    for name, task in names.items():
        samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
        metrics = result["results"][task]
        out[name] = {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "n": len(samples),
                     "choice_loglikelihoods": [[float(r[0]) for r in s["filtered_resps"]] for s in samples],
                     "decisions": [(s["acc"], s["acc_norm"]) for s in samples],
                     "requests": [([tuple(a) for a in s["arguments"]], int(s["target"])) for s in samples]}
    return out


# ------------------------------------------------------------------ the comparison

def _pick(scores):
    return max(range(len(scores)), key=lambda j: (scores[j], -j))


def compare(name: str, path: Path, theirs: dict, mine: dict) -> dict:
    from data.multiple_choice import read_examples
    examples = read_examples(path)
    rel = max(abs(a - b) / abs(b) for ll_a, ll_b in zip(mine["choice_loglikelihoods"], theirs["choice_loglikelihoods"])
              for a, b in zip(ll_a, ll_b))
    agree = norm_differs = same_requests = 0
    for ex, ll, decision, request in zip(examples, mine["choice_loglikelihoods"], theirs["decisions"],
                                         theirs["requests"]):
        pred, pred_norm = _pick(ll), _pick([v / max(n, 1) for v, n in zip(ll, ex.lengths)])
        agree += (float(pred == ex.gold), float(pred_norm == ex.gold)) == tuple(decision)
        norm_differs += pred != pred_norm
        same_requests += request == ([(ex.context, choice) for choice in ex.choices], ex.gold)
    same_shape = [len(r) for r in mine["choice_loglikelihoods"]] == [len(r) for r in theirs["choice_loglikelihoods"]]
    ok = (same_shape and mine["n"] == theirs["n"] and mine["acc"] == theirs["acc"]
          and mine["acc_norm"] == theirs["acc_norm"] and agree == mine["n"] and rel <= REL
          and same_requests == mine["n"])
    return {"n": mine["n"], "acc": mine["acc"], "acc_norm": mine["acc_norm"], "max_rel_ll": rel,
            "decisions_agree": agree, "same_requests": same_requests, "norm_differs": norm_differs, "ok": ok}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="training steps of the tiny run")
    p.add_argument("--examples", type=int, default=100, help="examples per task")
    p.add_argument("--batch-size", type=int, default=4, help="HFLM's batch size")
    p.add_argument("--keep", type=Path, help="work in this new folder and keep it: checkpoint, export, task files, "
                   "task configs, results.json (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object too")
    p.add_argument("--bos", action="store_true", help="both sides with a tokenizer that adds a BOS token (as Llama's)")
    args = p.parse_args()
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        p.error(f"--keep {args.keep}: give a new or empty folder (a run saves its checkpoint there)")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks on a small machine; the harness's process too
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        (work / "configs").mkdir(exist_ok=True)
        ck, export = train_and_export(work, args.steps, env)
        tokenizer = add_bos(export) if args.bos else None
        paths = write_tasks(work, args.examples)
        cover = coverage(paths, export)
        for name, c in cover.items():
            print(f"{name}: {args.examples} examples, {c['choices']} choices, {c['cut']} longer than the model's "
                  f"{SEQ_LEN} positions (cut on the left), longest continuation {c['longest_continuation']} tokens")
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        theirs = harness(export, paths, work / "configs", args.batch_size)
        rows, results = [], {"coverage": cover, "harness": theirs}
        for layout in LAYOUTS:
            out = work / f"ours-{layout}.jsonl"
            out.unlink(missing_ok=True)
            mine = ours(ck, paths, layout, out, env, tokenizer)
            results[layout] = mine
            for name in paths:
                rows.append((name, layout, compare(name, paths[name], theirs[name], mine[name])))
        (work / "results.json").write_text(json.dumps({**results, "rows": [{"task": n, "layout": l, **r}
                                                                           for n, l, r in rows]}))
    print()
    print("| task | n | layout | acc: harness, ours | acc_norm: harness, ours | largest relative difference of a "
          "choice's log-likelihood | same requests | same decisions | acc_norm picks another choice than acc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, layout, row in rows:
        t, n = theirs[name], row["n"]
        print(f"| {name} | {n} | {layout} | {t['acc']:.4f}, {row['acc']:.4f} | {t['acc_norm']:.4f}, "
              f"{row['acc_norm']:.4f} | {row['max_rel_ll']:.1e} | {row['same_requests']}/{n} | "
              f"{row['decisions_agree']}/{n} | {row['norm_differs']}/{n} |")
    failed = [(name, layout) for name, layout, row in rows if not row["ok"]]
    if args.json:
        print(json.dumps({"rows": [{"task": n, "layout": l, **r} for n, l, r in rows], "coverage": cover}))
    if failed:
        print(f"DIFFERENT: {failed} (acc, acc_norm, a request, a decision, or a log-likelihood beyond {REL:g} "
              f"relative)")
        return 1
    print(f"the same: acc, acc_norm, every request and every decision equal, every log-likelihood within {REL:g} "
          f"relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
