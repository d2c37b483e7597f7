"""Export to transformers GPT-2, import with --init-from-hf, evaluation at any layout.

One tiny run at tp=2 pp=2 with a padded vocabulary (4100 real tokens, padded to 4112 at tp=2
and 4104 at tp=1) is saved, exported and evaluated; the transformers model, our dense model,
launch/evaluate.py at three layouts and the run's own validation loss must agree, and a
multiple-choice task scored at those layouts must give what lm-evaluation-harness's rules give the
transformers model; a run
started from the export at tp=2 pp=2 must compute the transformers loss at step 1 and export
back to the same bits. The TP split/merge rules are checked in-process against the layers'
own sharding."""
import json
import math
import subprocess
import sys

import pytest
import torch
from torch.nn import functional
from safetensors.torch import load_file
import transformers  # the model classes load on first use (transformers' lazy module), not at collection

from helpers.fake_groups import fake_groups
from launch import evaluate, export_hf, train
from launch.checkpoints import hf_export
from launch.config.layout import check_and_derive_layout
from launch.config.recipe import load_recipe
from launch.feed.run_inputs import load_run_data
from helpers.launcher import REPO, TINY, launch_forked, read_metrics
from helpers.multiple_choice_task import TASK, write_task
from model.config import GPTConfig
from model.gpt.model import GPT
from model.hf.convert import from_gpt2_state_dict, load_dense_into, merge, rule_for, split
from model.hf.gpt2 import gpt2_config_kwargs, to_gpt2_state_dict
from model.parallel.cross_entropy import vocab_parallel_cross_entropy

VOCAB = ["--set", "model.vocab_size=4100", "--set", "model.vocab_pad_multiple=8"]
REL = 1e-5


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


# ------------------------------------------------------------------ in-process: the rules

def _tp_model(config: GPTConfig, tp: int, rank: int, monkeypatch) -> GPT:
    """The GPT the layers build on TP rank `rank` of `tp` (no process group: only the
    constructors run, and they ask the group for nothing but its size and rank)."""
    fake_groups(monkeypatch, size=lambda g: 1 if g is None else tp, rank=lambda g: 0 if g is None else rank)
    return GPT(config, tp_group="fake-tp-group")


@pytest.mark.parametrize("tp", [2, 4])
def test_split_and_merge_follow_the_layers(tp, monkeypatch):
    """The one name table agrees with each parameter's partition_dim/partition_stride; split
    gives exactly the shard the layers initialise on each rank (stride 3 for QKV, vocab
    padding included) and merge inverts it, padding stripped."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=8, vocab_size=97, vocab_pad_multiple=8, seed=3)
    dense = {k: v.detach() for k, v in GPT(config).named_parameters()}
    dense["embed.wte.weight"] = dense["embed.wte.weight"][: config.vocab_size]
    shards = [dict(_tp_model(config, tp, rank, monkeypatch).named_parameters()) for rank in range(tp)]
    for name, full in dense.items():
        param, rule = shards[0][name], rule_for(name)
        assert rule.dim == (param.partition_dim if getattr(param, "tensor_model_parallel", False) else None), name
        assert rule.stride == getattr(param, "partition_stride", 1), name
        for rank in range(tp):
            assert torch.equal(split(name, full, rank, tp, config.padded_vocab_size(tp)), shards[rank][name]), name
        assert torch.equal(merge(name, [s[name].detach() for s in shards], config.vocab_size), full), name


def test_hf_weights_round_trip_bitwise_through_every_tp_split():
    """export(import(w)) == w: GPT-2 weights -> shards of tp=2 and tp=4 -> merged -> GPT-2."""
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=8, vocab_size=97, vocab_pad_multiple=8)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config_kwargs(config)))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()  # every value distinct, biases and LayerNorms included
    w = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    dense = from_gpt2_state_dict(w, config.n_layer)
    for tp in (2, 4):
        padded = config.padded_vocab_size(tp)
        merged = {name: merge(name, [split(name, full, r, tp, padded) for r in range(tp)], config.vocab_size)
                  for name, full in dense.items()}
        ours = GPT(config)
        load_dense_into(ours, merged, None, 0, 1, config.padded_vocab_size(1))
        back = to_gpt2_state_dict(ours)
        assert back.keys() == w.keys()
        assert [k for k in w if not torch.equal(back[k], w[k])] == []


# ------------------------------------------------------------------ one saved run, exported

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run at tp=2 pp=2 saved, scoring TASK after its last step (eval.tasks), and its
    export through the command line."""
    root = tmp_path_factory.mktemp("export")
    task = root / "hellaswag.jsonl"
    write_task(task)
    proc = launch_forked(4, ["--recipe", str(TINY), "--tp", "2", "--pp", "2", "--steps", "2", "--save", str(root / "ck"),
                             "--metrics-out", str(root / "m.jsonl"), "--set", f"eval.tasks=[hellaswag={task}]"] + VOCAB)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (root / "stdout.txt").write_text(proc.stdout)
    out = subprocess.run([sys.executable, "launch/export_hf.py", "--load", str(root / "ck"), "--out", str(root / "hf")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "exported" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def data():
    recipe = load_recipe(TINY, VOCAB[1::2])
    run_data, vocab_size = load_run_data(recipe, check_and_derive_layout(recipe, 1, 1, 1, on_cpu=True))
    assert vocab_size == 4100
    return run_data


def _windows(batches, n_micro):
    xs, ys = zip(*[next(batches) for _ in range(n_micro)])
    return torch.cat(xs), torch.cat(ys)


def _hf_logits(path, x) -> torch.Tensor:
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(x).logits


def _hf_loss(path, x, y) -> float:
    logits = _hf_logits(path, x)
    return functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()


@pytest.mark.slow
def test_export_computes_our_loss_and_generates(run, data):
    hf_dir = run / "hf"
    assert (hf_dir / "model.safetensors").is_file() and not list(hf_dir.glob("*.bin"))
    assert json.loads((hf_dir / "config.json").read_text())["vocab_size"] == 4100  # padding stripped
    x, y = _windows(data.val_batches(0, 1, 1), 8)  # the run's validation batch (16 windows)
    _, config, dense = hf_export.read_checkpoint_weights(run / "ck")
    with torch.no_grad():
        our_logits = hf_export.dense_gpt(config, dense)(x)
        ours = vocab_parallel_cross_entropy(our_logits, y, None).mean().item()
    theirs = _hf_loss(hf_dir, x, y)
    val_loss = read_metrics(run / "m.jsonl")[-1]["val_loss"]  # the run's own, at tp=2 pp=2
    assert _close(ours, theirs) and _close(val_loss, theirs), (ours, theirs, val_loss)
    # The logits too: two steps from the initialisation leave attention nearly uniform, and an export
    # with the query's columns of c_attn reversed moved the loss by 2.4e-7 of itself, the logits by 1.3e-3.
    torch.testing.assert_close(_hf_logits(hf_dir, x), our_logits[..., :config.vocab_size], rtol=REL, atol=1e-5)

    generate = transformers.pipeline("text-generation", model=str(hf_dir))
    text = generate("The Python", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert text.startswith("The Python") and len(generate.tokenizer(text)["input_ids"]) > 2


def _evaluate(n, args):
    proc = launch_forked(n, args, script="evaluate.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _harness_hellaswag(hf_dir, docs, seq_len):
    """The transformers model scored by lm-evaluation-harness's rules, written here from its
    HellaSwag task and its HFLM: the query is preprocess(activity_label + ": " + ctx_a + " " +
    ctx_b.capitalize()), each choice " " + preprocess(ending); the continuation's tokens are
    enc(query + choice) after len(enc(query)); the input is their concatenation's last seq_len + 1
    tokens but one; acc_norm divides by the ending's characters. (log-likelihoods, acc, acc_norm)"""
    import re

    from transformers import AutoTokenizer

    def preprocess(text):
        text = text.strip().replace(" [title]", ". ")
        return re.sub("\\[.*?\\]", "", text).replace("  ", " ")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    scores, acc, acc_norm = [], 0, 0
    for doc in docs:
        query = preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
        endings = [preprocess(e) for e in doc["endings"]]
        row = []
        for ending in endings:
            query_ids = tokenizer(query)["input_ids"]  # HFLM's default: the tokenizer's own special tokens
            continuation = tokenizer(query + " " + ending)["input_ids"][len(query_ids):]
            ids = (query_ids + continuation)[-(seq_len + 1):]
            with torch.no_grad():
                logprobs = model(torch.tensor([ids[:-1]])).logits[0].double().log_softmax(-1)
            n = len(continuation)
            row.append(logprobs[-n:].gather(1, torch.tensor(ids[-n:])[:, None]).sum().item())
        scores.append(row)
        acc += max(range(4), key=lambda j: row[j]) == doc["label"]
        acc_norm += max(range(4), key=lambda j: row[j] / len(endings[j])) == doc["label"]
    return scores, acc / len(docs), acc_norm / len(docs)


@pytest.mark.slow
def test_evaluate_gives_the_same_loss_and_task_scores_at_every_layout(run, data, tmp_path):
    """Saved at tp=2 pp=2, evaluated at (1,1,1), (2,2,2) and cp 2 (other vocab paddings too; at dp 2
    each replica scores its share of the examples, 3 and 2, and the log-likelihoods are summed):
    the loss of the transformers model on the same validation batch; and a HellaSwag-schema task
    (--tasks) gives every choice the log-likelihood lm-evaluation-harness's rules give the
    transformers model (within 1e-5) and the same acc and acc_norm, at every layout. The training
    run scored the same task after its last step (eval.tasks: the saved weights): the same acc and
    acc_norm, and the gold choices' mean log-likelihood within 1e-5, on its console line too. Bits per
    byte, the evaluation's and the training run's last validation, equal the transformers model's
    summed loss over the UTF-8 bytes of the text the targets decode to."""
    x, y = _windows(data.val_batches(0, 1, 1), 8)
    theirs = _hf_loss(run / "hf", x, y)
    # bits per byte: the summed loss over the UTF-8 bytes the targets decode to (documents' ends as no text)
    text_bytes = sum(len(data.tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in y.tolist())
    their_bpb = theirs * y.numel() / (math.log(2) * text_bytes)
    task = write_task(tmp_path / "hellaswag.jsonl")
    reference, acc, acc_norm = _harness_hellaswag(run / "hf", TASK, 32)
    assert 0 < acc_norm < 1 or 0 < acc < 1  # the examples tell the choices apart
    last_step = read_metrics(run / "m.jsonl")[-1]  # validated on the same first batch (recipes/tiny.yaml)
    assert _close(last_step["val_loss"], theirs) and _close(last_step["val_bpb"], their_bpb), (last_step, their_bpb)
    in_training = last_step["tasks"]["hellaswag"]
    gold = sum(row[doc["label"]] for row, doc in zip(reference, TASK)) / len(TASK)
    assert (in_training["acc"], in_training["acc_norm"], in_training["n"]) == (acc, acc_norm, len(TASK)), in_training
    assert abs(in_training["gold_loglikelihood"] - gold) <= REL * abs(gold), (in_training, gold)
    assert [len(m.get("tasks", {})) for m in read_metrics(run / "m.jsonl")] == [0, 1]  # after the last step only
    assert any(line.startswith("step 2/2") and f"hellaswag acc {acc:.4f} acc_norm {acc_norm:.4f}" in line
               for line in (run / "stdout.txt").read_text().splitlines())
    losses = []
    for procs, flags in ((1, []), (8, ["--tp", "2", "--pp", "2"]), (2, ["--cp", "2"])):
        out, scores = tmp_path / f"eval{procs}.json", tmp_path / f"tasks{procs}.jsonl"
        recipe = [] if procs == 1 else ["--recipe", str(TINY)]  # the checkpoint's recipe by default
        proc = _evaluate(procs, ["--load", str(run / "ck"), *flags, "--batches", "1", "--json-out", str(out),
                                 "--tasks", f"hellaswag={task}", "--metrics-out", str(scores)] + recipe)
        result = json.loads(out.read_text())
        assert f"loss {result['loss']:.6f} ppl" in proc.stdout and f"bpb {result['bpb']:.6f}" in proc.stdout
        assert _close(result["bpb"], their_bpb), (result["bpb"], their_bpb)
        assert result["data"] == "validation" and result["batches"] == 1
        losses.append(result["loss"])
        (record,) = read_metrics(scores)
        assert (record["task"], record["n"], record["acc"], record["acc_norm"]) == ("hellaswag", len(TASK), acc, acc_norm)
        assert f"hellaswag: acc {acc:.4f} acc_norm {acc_norm:.4f} n {len(TASK)}" in proc.stdout
        for ours, harness in zip(record["choice_loglikelihoods"], reference):
            assert all(abs(a - b) <= REL * abs(b) for a, b in zip(ours, harness)), (flags, ours, harness)
    assert all(_close(loss, theirs) for loss in losses), (losses, theirs)


@pytest.mark.slow
def test_evaluate_hf_weights_on_training_data(run, tmp_path):
    """--init-from-hf at pp=2, with no validation data configured: the first training batches."""
    no_val = ["--set", "data.val_fraction=0", "--set", "train.eval_every=0"]
    recipe = load_recipe(TINY, no_val[1::2] + VOCAB[1::2])
    run_data, _ = load_run_data(recipe, check_and_derive_layout(recipe, 1, 1, 1, on_cpu=True))
    x, y = _windows(run_data.train_batches(0, 1), 16)  # two global batches
    out = tmp_path / "eval.json"
    _evaluate(2, ["--init-from-hf", str(run / "hf"), "--recipe", str(TINY), "--pp", "2", "--batches", "2",
                  "--json-out", str(out)] + no_val)
    result = json.loads(out.read_text())
    assert result["data"] == "train" and _close(result["loss"], _hf_loss(run / "hf", x, y)), result


@pytest.mark.slow
def test_init_from_hf_places_every_shard_and_exports_back(run, data, tmp_path):
    """A run started from the export at tp=2 pp=2: its step-1 loss is the transformers model's
    on the same first batch (every shard in place), and with a learning rate far below one
    ulp of any weight its checkpoint exports back to the same bits."""
    metrics = tmp_path / "m.jsonl"
    proc = launch_forked(4, ["--recipe", str(TINY), "--tp", "2", "--pp", "2", "--steps", "1", "--init-from-hf",
                      str(run / "hf"), "--set", "train.lr=1e-30", "--set", "train.eval_every=0",
                      "--save", str(tmp_path / "ck"), "--metrics-out", str(metrics)] + VOCAB)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    x, y = _windows(data.train_batches(0, 1), 8)  # step 1's global batch
    assert _close(read_metrics(metrics)[0]["loss"], _hf_loss(run / "hf", x, y))

    assert export_hf.main(["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    before, after = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


# ------------------------------------------------------------------ bad input

def _one_line_error(main, argv, words, capsys):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), (argv, err)


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ck, hf = run / "ck", str(run / "hf")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    out = ["--out", str(tmp_path / "new")]
    for argv, words in [
        (["--load", str(tmp_path / "nope")] + out, ["no such directory"]),
        (["--load", str(tmp_path / "other")] + out, ["no complete checkpoint"]),
        (["--load", str(ck), "--out", str(tmp_path / "full")], ["not empty", "--overwrite"]),
        (["--load", str(ck), "--tokenizer", str(tmp_path / "no-tokenizer")] + out,
         ["without a tokenizer", "--tokenizer"]),
    ]:
        _one_line_error(export_hf.main, argv, words, capsys)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()

    tiny = ["--recipe", str(TINY)] + VOCAB
    for argv, words in [
        (["--init-from-hf", hf, "--set", "model.n_layer=2"], ["n_layer=4", "model.n_layer"]),
        (["--init-from-hf", hf, "--set", "model.vocab_size=4200"], ["vocab_size=4100", "4200"]),
        (["--init-from-hf", str(tmp_path / "other")], ["no readable config.json"]),
        (["--init-from-hf", str(tmp_path / "llama")], ["arch='llama'", "model.arch='gpt2'"]),  # #12: Llama imports
        (["--init-from-hf", hf, "--load", str(ck)], ["pass only one"]),
    ]:
        _one_line_error(train.main, tiny + argv, words, capsys)
    for argv, words in [
        (["--load", str(tmp_path / "other")], ["no complete checkpoint"]),
        (["--init-from-hf", hf, "--recipe", str(TINY), "--set", "model.n_head=2"], ["model.n_head=2", "weights"]),
        (["--load", str(ck), "--init-from-hf", hf], ["not allowed with"]),
        (["--load", str(ck), "--tasks", "mmlu"], ["--tasks 'mmlu'", "NAME=PATH", "hellaswag, arc_easy"]),
        (["--load", str(ck), "--tasks", f"hs={tmp_path / 'none.jsonl'}"], ["none.jsonl", "does not exist"]),
        (["--load", str(ck), "--tasks", f"hs={tmp_path / 'other' / 'notes.txt'}"], ["notes.txt", "JSON"]),
    ]:
        _one_line_error(evaluate.main, argv, words, capsys)

    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(ck), str(damaged)], check=True)
    layer = next(damaged.glob("step*/layer_03-model_01-*"))
    layer.write_bytes(layer.read_bytes()[:100])
    _one_line_error(export_hf.main, ["--load", str(damaged)] + out, ["is damaged", layer.name], capsys)
