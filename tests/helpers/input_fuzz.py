"""A seeded generator of start-up input, good and bad, for tests/runtime/test_input_fuzz.py.

Each case is a command line for launch/train.py, a world size, and the files it names, written
into a work directory: recipe overrides drawn from the recipe sections' own declarations (every
field, with values of its type and of every other: NaN, infinities, integers past 64 bits, control
characters, URLs with secrets), misspelt keys, layouts, and the files a user hands the start-up:
recipe files, task files, local data, tokenizer and Hugging Face directories, `--load` checkpoints.
The same seed gives the same cases."""
import dataclasses
import json
import random
import shutil
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from launch.config.recipe import Recipe

RECIPES = ("recipes/tiny.yaml", "recipes/tiny.yaml", "recipes/llama-tiny.yaml", "recipes/moe-tiny.yaml")
WORLD_SIZES = (1, 1, 1, 1, 2, 3, 4, 8)
TRICKY_TEXT = ["", " ", "x", "builtin", "null", "5", "[a]", "{a: 1}", "a\nb", "\x1b[31mred", "tab\there", "\u2028",
               "é中", "../../etc/hostname", "/no/such/path", "ftp://host/x.jsonl", "https://user:secret@host/x.jsonl",
               "HTTPS://host/x.jsonl?sig=secret", "s3://user:secret@bucket/x", "nosuch/dataset", "x" * 300]
TRICKY_NUMBERS = ["0", "1", "-1", "2", "3", "4", "8", "0.5", "1.5", "-0.0", "1e-9", "1.0e+9", ".nan", ".inf", "-.inf",
                  "1e400", "1.0e+400", "1" + "0" * 30, "1" + "0" * 400, str(2 ** 63), str(2 ** 31)]
TRICKY_SHAPES = ["null", "true", "[]", "{}", "[1, 2]", "[0, 4]", "[-1, 5]", "[[1]]", "{a: {b: {c: 1}}}",
                 "{1: 2, a: 3}", "{factor: .nan}", "{type: linear, factor: 2.0}", "{rope_type: yarn, factor: 1.0e+400}",
                 "{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
                 "original_max_position_embeddings: " + "9" * 30 + "}"]
JSON_VALUES = [None, True, 5, -1, 0, 1.5, "x", "", [], {}, [None], ["a"], {"a": 1}, 10 ** 30, "\x1b[2J", float("inf"),
               float("nan")]
"""json.dumps writes inf and nan as Infinity and NaN, which json.loads reads back."""
DEEPSPEED_KEYS = ["zero_optimization.stage", "zero_optimization.reduce_bucket_size", "fp16.loss_scale_window",
                  "bf16.enabled", "gradient_clipping", "communication_data_type", "train_batch_size",
                  "pipeline.pipe_partitioned", "steps_per_print", "nonsense"]


@dataclass
class Case:
    argv: List[str]
    world_size: int
    what: str
    """What the case varies, for the report."""


def recipe_fields(section: Any = None, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, type) of every field of every recipe section, from their declarations."""
    section = Recipe() if section is None else section
    for name, annotation in typing.get_type_hints(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            yield from recipe_fields(value, f"{prefix}{name}.")
        elif name != "deepspeed":
            yield prefix + name, annotation


def value_for(rng: random.Random, annotation: Any) -> str:
    """YAML text for a field: mostly of its own type, often of another."""
    kinds = [TRICKY_TEXT, TRICKY_NUMBERS, TRICKY_SHAPES]
    own = (TRICKY_NUMBERS if annotation in (int, float) else
           TRICKY_TEXT if annotation is str else ["true", "false", "yes", "1"] if annotation is bool else
           TRICKY_SHAPES)
    pool = own if rng.random() < 0.6 else rng.choice(kinds)
    return rng.choice(pool)


def misspelt(rng: random.Random, key: str) -> str:
    i = rng.randrange(len(key))
    return rng.choice([key[:i] + key[i + 1:], key[:i] + rng.choice("xq_\n\x1b") + key[i:], key.upper(), key + ".x"])


class InputFuzz:
    """Cases drawn from one seed; files under `work`. `valid_tokenizer` is the builtin tokenizer's
    directory, `valid_meta` a checkpoint manifest (complete.json) a real save writes for tiny.yaml."""

    def __init__(self, seed: int, work: Path, valid_tokenizer: Path, valid_meta: Dict[str, Any]):
        self.rng, self.work = random.Random(seed), work
        self.valid_tokenizer, self.valid_meta = valid_tokenizer, valid_meta
        self.fields = list(recipe_fields())
        self.dirs = 0

    def cases(self, n: int) -> Iterator[Case]:
        makers = [(self.overrides, 10), (self.misspelt_key, 2), (self.layout, 3), (self.recipe_file, 2),
                  (self.task_file, 2), (self.data_file, 2), (self.tokenizer_dir, 1), (self.hf_dir, 2),
                  (self.checkpoint, 3)]
        for _ in range(n):
            make = self.rng.choices([m for m, _ in makers], [w for _, w in makers])[0]
            yield make()

    def _dir(self) -> Path:
        self.dirs += 1
        path = self.work / f"case{self.dirs}"
        path.mkdir()
        return path

    def _base(self) -> List[str]:
        return ["--recipe", self.rng.choice(RECIPES), "--steps", "2"]

    def overrides(self) -> Case:
        argv, keys = self._base(), []
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            if self.rng.random() < 0.1:
                key, text = "deepspeed." + self.rng.choice(DEEPSPEED_KEYS), self.rng.choice(TRICKY_NUMBERS + TRICKY_SHAPES)
            else:
                key, annotation = self.rng.choice(self.fields)
                text = value_for(self.rng, annotation)
            argv += ["--set", f"{key}={text}"]
            keys.append(key)
        return Case(argv, self.rng.choice(WORLD_SIZES), "--set " + " ".join(keys))

    def misspelt_key(self) -> Case:
        key, annotation = self.rng.choice(self.fields)
        return Case(self._base() + ["--set", f"{misspelt(self.rng, key)}={value_for(self.rng, annotation)}"], 1,
                    "a misspelt key")

    def layout(self) -> Case:
        argv = self._base()
        for flag in self.rng.sample(["--tp", "--pp", "--cp", "--ep", "--seed", "--steps", "--keep-last"], 2):
            argv += [flag, self.rng.choice(["-1", "0", "1", "2", "3", "4", "8", "two", "1" + "0" * 30])]
        return Case(argv, self.rng.choice(WORLD_SIZES), "a layout")

    def recipe_file(self) -> Case:
        text = Path("recipes/tiny.yaml").read_bytes()
        cut = self.rng.randrange(len(text))
        variants = [text[:cut] + self.rng.choice([b"\xff", b"\n  ", b"\x1b", b": ", b"- ", b"&a", b"*a", b"{", b"\t"])
                    + text[cut:],
                    text[:cut], text + text, b"\xfe\xff" + text, b"a: " + b"[" * 3000 + b"]" * 3000,
                    b"- 1\n- 2\n", b"train: &t\n  x: *t\n", text.replace(b"train:", b"train:\n  lr: 1.0e-3\ntrain:", 1)]
        path = self._dir() / "recipe.yaml"
        path.write_bytes(self.rng.choice(variants))
        return Case(["--recipe", str(path), "--steps", "2"], 1, "a recipe file")

    def _jsonl(self, path: Path, lines: List[Any]) -> None:
        with path.open("w") as f:
            for line in lines:
                f.write(line if isinstance(line, str) else json.dumps(line))
                f.write("\n")

    def _mutated(self, document: Dict[str, Any]) -> Any:
        """`document` with one field's value replaced, removed, or the whole line replaced."""
        choice = self.rng.random()
        if choice < 0.1:
            return self.rng.choice(["[", "null", "[1]", '"x"', "\xff", "[" * 5000 + "]" * 5000, "{\"a\": 1e400}"])
        document = dict(document)
        key = self.rng.choice(sorted(document))
        if choice < 0.2:
            del document[key]
        else:
            document[key] = self.rng.choice(JSON_VALUES + [[None] * 2, 7, 1e300])
        return document

    def task_file(self) -> Case:
        good = {"activity_label": "Cooking", "ctx_a": "A man takes a pan.", "ctx_b": "he", "label": 1,
                "endings": ["cooks.", "sings.", "runs.", "falls."]}
        path = self._dir() / "task.jsonl"
        self._jsonl(path, [good, self._mutated(good)])
        if self.rng.random() < 0.1:
            path.write_bytes(b"\xff\xfe" + path.read_bytes())
        return Case(self._base() + ["--set", f"eval.tasks=[hellaswag={path}]"], 1, "a task file")

    def data_file(self) -> Case:
        lines = [{"text": f"def f{i}(x):\n    return x + {i}\n" * 20} for i in range(300)]
        lines.insert(self.rng.randrange(300), self._mutated(lines[0]))
        path = self._dir() / "data.jsonl"
        self._jsonl(path, lines)
        return Case(self._base() + ["--set", f"data.name={path}", "--set", "data.val_fraction=0.1"], 1, "a data file")

    def tokenizer_dir(self) -> Case:
        path = self._dir() / "tokenizer"
        shutil.copytree(self.valid_tokenizer, path)
        name = self.rng.choice(sorted(p.name for p in path.iterdir() if p.suffix == ".json"))
        path.joinpath(name).write_bytes(self.rng.choice(
            [b"", b"[]", b"null", b"5", b"{", b"\xff\xfe", b"{\"model_max_length\": \"x\"}",
             b"{\"tokenizer_class\": \"NoSuchTokenizer\"}", b"{\"auto_map\": {\"AutoTokenizer\": \"x.Y\"}}"]))
        return Case(self._base() + ["--set", f"data.tokenizer={path}"], 1, f"a tokenizer's {name}")

    def hf_dir(self) -> Case:
        path = self._dir() / "hf"
        path.mkdir()
        config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 4, "n_head": 4,
                  "n_embd": 64, "n_positions": 32, "vocab_size": 4096, "layer_norm_epsilon": 1e-5}
        config = self._mutated(config)
        path.joinpath("config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        weights = self.rng.choice([b"", b"\x00" * 7, (10 ** 6).to_bytes(8, "little") + b"{}",
                                   (2).to_bytes(8, "little") + b"{}", (13).to_bytes(8, "little") + b"[1]" + b" " * 10])
        path.joinpath(self.rng.choice(["model.safetensors", "model.safetensors.index.json"])).write_bytes(weights)
        return Case(self._base()[:2] + ["--init-from-hf", str(path), "--steps", "2"], 1, "a Hugging Face directory")

    def checkpoint(self) -> Case:
        save = self._dir() / "run"
        tag = save / "step1"
        tag.mkdir(parents=True)
        meta = self._mutated(self.valid_meta) if self.rng.random() < 0.7 else self._deep_mutated(self.valid_meta)
        tag.joinpath("complete.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
        save.joinpath("latest").write_bytes(self.rng.choice(
            [b"step1", b"step1", b"step1\n", b"\xff", b"", b"../step1", b"/etc", b"step1\x1b[2J", b"step9"]))
        load = self.rng.choice([save, save, tag])
        extra = ["--save", str(save)] if self.rng.random() < 0.5 else []
        return Case(["--recipe", "recipes/tiny.yaml", "--steps", "5", "--load", str(load)] + extra, 1, "a checkpoint")

    def _deep_mutated(self, meta: Dict[str, Any]) -> Dict[str, Any]:
        """One value inside the saved recipe or layout replaced (a key of a newer version, a type)."""
        meta = json.loads(json.dumps(meta))
        holder = self.rng.choice([meta["recipe"]["model"], meta["recipe"]["train"], meta["layout"],
                                  meta["data_fingerprint"], meta])
        key = self.rng.choice(sorted(holder) + ["a_newer_key"])
        holder[key] = self.rng.choice(JSON_VALUES + [{"format": 1, "step": 1}, [["a", 1]], [[1, 2, 3]]])
        return meta
