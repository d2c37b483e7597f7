"""Bad input: one line naming the values and the fix, exit code 2, no traceback, before any
process group or engine starts, and nothing already written is touched."""
import os
import socket
import subprocess
import sys
import time

import pytest

from launch.train import main
from helpers.launcher import REPO, TINY, launch

CASES = [
    # (world size, argv, words the message must contain)
    (6, ["--tp", "4"], ["world size 6", "tp*pp = 4*1 = 4"]),
    (3, ["--tp", "3"], ["n_head=4", "--tp 3"]),
    (1, ["--set", "model.n_embd=66"], ["n_embd=66", "n_head=4"]),
    (1, ["--set", "model.vocab_size=100"], ["vocab_size=100", "4096"]),
    (1, ["--set", "model.vocab_pad_multiple=0"], ["vocab_pad_multiple=0"]),
    (8, ["--pp", "8"], ["n_layer=4", "8 pipeline stages"]),
    (1, ["--tp", "0"], ["--tp 0", ">= 1"]),  # was read as not given: tp 1, silently
    (1, ["--pp", "0", "--tp", "1"], ["--tp 1 --pp 0", ">= 1"]),
    (1, ["--ep", "-1"], ["--ep -1", ">= 1"]),
    (2, ["--set", "train.global_batch_size=15"], ["global_batch_size=15", "2*2 = 4"]),
    (4, ["--pp", "2", "--set", "train.zero_stage=2"], ["zero_stage=2", "--pp 2"]),
    (1, ["--set", "train.zero_stage=3"], ["zero_stage=3", "stage 0 or 1"]),
    (1, ["--set", "model.n_head=0"], ["model.n_head=0", ">= 1"]),
    (1, ["--set", "train.learning_rate=1e-3"], ["unknown recipe key train.learning_rate", "train.lr"]),
    (1, ["--set", "train.steps=ten"], ["train.steps='ten'", "expected int"]),
    (1, ["--set", "deepspeed.train_batch_size=64"], ["deepspeed.train_batch_size", "global_batch_size"]),
    (1, ["--recipe", "recipes/nope.yaml"], ["recipes/nope.yaml", "not found"]),
    (1, ["--set", "data.seq_len=64"], ["data.seq_len=64", "model.seq_len=32"]),
    (2, ["--tp", "2", "--set", "model.sequence_parallel=true", "--set", "data.seq_len=31"],
     ["model.sequence_parallel", "--tp 2", "sequence length 31"]),
    (4, ["--tp", "2", "--pp", "2", "--set", "model.sequence_parallel=true",
         "--set", "deepspeed.pipeline.pipe_partitioned=true"], ["deepspeed.pipeline.pipe_partitioned=true", "--tp 2"]),
    (1, ["--set", "train.recompute=partial"], ["train.recompute='partial'", "none, selective, full"]),
    (1, ["--set", "train.activation_checkpoint_interval=1"],
     ["unknown recipe key train.activation_checkpoint_interval"]),
    (1, ["--tp", "two"], ["--tp", "'two'"]),
    (1, ["--set", "data.tokenizer=/no/such/tokenizer"], ["data.tokenizer='/no/such/tokenizer'"]),
    (1, ["--set", "data.name=/no/such/corpus"], ["data.name='/no/such/corpus'"]),
    (1, ["--set", "wandb.name=[oops"], ["--set 'wandb.name=[oops'", "not valid YAML", "quote it"]),
    (1, ["--set", "train.dist_timeout_s=0"], ["train.dist_timeout_s=0", "[1, 604800]"]),
    (1, ["--set", "train.heartbeat_timeout_s=2"], ["train.heartbeat_timeout_s=2", "heartbeat interval, 2 s"]),
    (1, ["--set", "train.stop_grace_s=0"], ["train.stop_grace_s=0", "> 0"]),
    (1, ["--set", "train.max_starts_without_progress=-1"], ["train.max_starts_without_progress=-1", ">= 0",
                                                            "0: no cap"]),
    (1, ["--set", "train.hang_timeout_s=2"], ["train.hang_timeout_s=2", "at least 5 s", "dist_timeout_s=600"]),
    (1, ["--set", "train.hang_timeout_s=600"], ["train.hang_timeout_s=600", "below train.dist_timeout_s=600"]),
    (1, ["--set", "train.hang_timeout_s=60", "--set", "train.first_step_timeout_s=30"],
     ["train.first_step_timeout_s=30", "at least train.hang_timeout_s=60"]),
    (1, ["--set", "wandb.mode=cloud"], ["wandb.mode='cloud'", "online, offline, disabled"]),
    (1, ["--set", "train.zero_stage=0", "--set", "train.precision=bf16"], ["zero_stage=0", "bf16", "zero_stage=1"]),
    # Muon: the optimizer's name, its momentum and steps, the one precision x ZeRO it refuses.
    (1, ["--set", "train.optimizer=sgd"], ["train.optimizer='sgd'", "adamw, muon"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_momentum=1"], ["train.muon_momentum=1", "[0, 1)"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_ns_steps=0"], ["train.muon_ns_steps=0", ">= 1"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_lr_rule=kj"],
     ["train.muon_lr_rule='kj'", "moonlight, keller, none"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_ns_dtype=fp16"], ["train.muon_ns_dtype='fp16'", "fp32, bf16"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_adamw_lr=0"], ["train.muon_adamw_lr=0", "> 0"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_adamw_beta1=1"], ["train.muon_adamw_beta1=1", "[0, 1)"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_adamw_beta2=-0.5"], ["train.muon_adamw_beta2=-0.5", "[0, 1)"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.muon_adamw_weight_decay=-1"],
     ["train.muon_adamw_weight_decay=-1", ">= 0"]),
    (1, ["--set", "train.optimizer=muon", "--set", "train.precision=fp16", "--set", "train.zero_stage=0"],
     ["train.optimizer=muon", "fp16", "train.zero_stage=1"]),
    (2, ["--pp", "2", "--set", "train.optimizer=muon", "--set", "train.partition=[4, 0]"],
     ["train.optimizer=muon", "blocks per stage [4, 0]", "train.partition=[3, 1]"]),
    # Tasks scored while training: a schedule without tasks, an item without a path, a missing file.
    (1, ["--set", "eval.every=100"], ["eval.every=100", "no eval.tasks"]),
    (1, ["--set", "eval.tasks=[mmlu]"], ["eval.tasks 'mmlu'", "NAME=PATH", "arc_easy"]),
    (1, ["--set", "eval.tasks=[hellaswag=/no/such.jsonl]"], ["task file '/no/such.jsonl' does not exist"]),
    (1, ["--set", "train.partition=even"], ["train.partition='even'", "balanced, blocks", "[3, 1]"]),
    (2, ["--pp", "2", "--set", "train.partition=[3, 2]"], ["train.partition=[3, 2]", "--pp 2", "n_layer=4",
                                                           "summing to 4"]),
    (2, ["--pp", "2", "--set", "train.partition=[4]"], ["train.partition=[4]", "give 2 numbers"]),
    (2, ["--pp", "2", "--set", "train.partition=[0, 4]"], ["train.partition=[0, 4]", "each >= 1 (the last may be 0)"]),
    (1, ["--set", "train.partition=3"], ["train.partition=3", "expected str or List[int]"]),
    (2, ["--pp", "2", "--set", "train.schedule=zb-h1", "--set", "train.precision=bf16",
         "--set", "deepspeed.bf16.immediate_grad_update=true"],
     ["deepspeed.bf16.immediate_grad_update=true", "zb-h1 --pp 2", "dropped"]),
    (2, ["--pp", "2", "--set", "train.schedule=zb-h1", "--set", "deepspeed.bfloat16.immediate_grad_update=true"],
     ["deepspeed.bfloat16.immediate_grad_update=true", "zb-h1 --pp 2"]),
    # Context parallelism: the world, the heads, the sequence (with SP: x tp), the key/value heads.
    (3, ["--cp", "2"], ["world size 3", "tp*cp*pp = 1*2*1 = 2"]),
    (1, ["--cp", "0"], ["--cp 0", ">= 1"]),
    (6, ["--cp", "3"], ["n_head=4", "tp*cp = 1*3 = 3"]),
    (8, ["--tp", "2", "--cp", "4"], ["n_head=4", "tp*cp = 2*4 = 8"]),
    (2, ["--cp", "2", "--set", "data.seq_len=31"], ["sequence length 31", "--cp 2", "multiple of 2"]),
    (4, ["--tp", "2", "--cp", "2", "--set", "model.sequence_parallel=true", "--set", "data.seq_len=30"],
     ["sequence length 30", "cp*tp = 2*2 = 4 (sequence parallel)"]),
    (2, ["--recipe", "recipes/llama-tiny.yaml", "--cp", "2", "--set", "model.n_head=12", "--set", "model.n_embd=96",
         "--set", "model.n_kv_head=3"], ["n_kv_head=3", "tp*cp = 1*2 = 2"]),
    # Mixture of experts: ep against the data-parallel ranks and the experts, k, options it cannot use.
    (4, ["--recipe", "recipes/moe-tiny.yaml", "--pp", "2", "--ep", "4"], ["--ep 4", "2 data-parallel ranks"]),
    (6, ["--recipe", "recipes/moe-tiny.yaml", "--ep", "3", "--set", "train.global_batch_size=12"],
     ["model.moe.num_experts=8", "--ep 3"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.experts_per_token=9"],
     ["experts_per_token=9", "num_experts=8"]),
    (2, ["--ep", "2"], ["--ep 2", "num_experts=0"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--ep", "0"], ["--ep 0", ">= 1"]),
    (2, ["--recipe", "recipes/moe-tiny.yaml", "--tp", "2", "--set", "model.moe.expert_ffn_hidden_size=33"],
     ["expert_ffn_hidden_size=33", "--tp 2"]),
    (1, ["--set", "model.moe.num_experts=4"], ["model.moe.num_experts=4", "model.arch=gpt2"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.mlp=gelu"], ["model.mlp='gelu'", "SwiGLU"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.num_experts=0"],
     ["model.arch=qwen3_moe", "num_experts=0"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.router=topk_softmax",
         "--set", "model.moe.norm_topk_prob=false"], ["router=topk_softmax", "norm_topk_prob=false"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.router=top2"], ["model.moe.router='top2'"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.router_dtype=bf16"],
     ["model.moe.router_dtype='bf16'", "fp32, activations"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.balance=loss_free"],
     ["model.moe.balance='loss_free'", "aux_loss, bias, none"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.balance=bias",
         "--set", "model.moe.balance_scope=global_batch"], ["balance_scope=global_batch", "balance='bias'"]),
    (1, ["--recipe", "recipes/moe-tiny.yaml", "--set", "model.moe.capacity=1.25"],
     ["unknown recipe key model.moe.capacity", "model.moe.num_experts"]),
    (4, ["--recipe", "recipes/moe-tiny.yaml", "--tp", "4", "--set", "model.qk_norm=projection"],
     ["qk_norm=projection", "n_kv_head=2", "--tp 4"]),
    # Values torch or DeepSpeed would refuse only after the process group started.
    (1, ["--set", "train.beta1=5"], ["train.beta1=5", "[0, 1)"]),
    (1, ["--set", "train.beta2=-0.5"], ["train.beta2=-0.5", "[0, 1)"]),
    (1, ["--set", "train.eps=0"], ["train.eps=0", "(0, 1)"]),
    (1, ["--set", "train.weight_decay=-0.1"], ["train.weight_decay=-0.1", ">= 0"]),
    (1, ["--seed", "-1"], ["train.seed=-1", "[0, 4294967295]"]),
    (1, ["--set", "train.seed=" + "1" + "0" * 30], ["train.seed=an integer of about 31 digits", "64-bit"]),
    (1, ["--set", "train.steps=1" + "0" * 5000], ["train.steps=1000", "...'", "will not read"]),
    (1, ["--set", "train.dist_timeout_s=100000000000000"], ["train.dist_timeout_s=100000000000000", "604800"]),
    (1, ["--set", "train.stop_grace_s=1.0e+300"], ["train.stop_grace_s=1e+300", "at most 604800 s"]),
    (1, ["--set", "deepspeed.zero_optimization.stage=3"], ["deepspeed.zero_optimization.stage=3", "0 or 1"]),
    (1, ["--set", "deepspeed.zero_optimization.reduce_bucket_size=abc"],
     ["DeepSpeed refuses it", "reduce_bucket_size", "valid integer"]),
    # A URL given as an output or checkpoint path was a relative directory named `s3:` (Path collapses //).
    (1, ["--save", "az://bucket/run"], ["argument --save: 'az://bucket/run' is a URL", "s3://"]),
    (1, ["--load", "https://host/run"], ["argument --load: 'https://host/run' is a URL"]),
    # A key or value holding a line break or a terminal escape is printed escaped, on one line.
    (1, ["--set", "train.l\nr\x1b[2J=3"], ["unknown recipe key train.l\\nr\\x1b[2J"]),
]


@pytest.mark.parametrize("world_size,argv,words", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(world_size, argv, words, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("earlier run\n")
    recipe = [] if "--recipe" in argv else ["--recipe", str(TINY)]
    assert main(recipe + argv + ["--metrics-out", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    assert metrics.read_text() == "earlier run\n"


def test_plain_process_prints_only_the_error():
    proc = subprocess.run([sys.executable, "launch/train.py", "--recipe", str(TINY), "--set", "train.lr=fast"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == "error: train.lr='fast' has the wrong type: expected float\n"


def test_a_bad_recipe_is_refused_before_torch_is_imported():
    """Refused in a tenth of a second, not after the 4 s of importing torch and DeepSpeed."""
    check = ("import sys; from launch.train import main; "
             f"code = main(['--recipe', {str(TINY)!r}, '--set', 'train.lr=fast']); "
             "print(code, [m for m in ('torch', 'deepspeed') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.stdout == "2 []\n", proc.stdout + proc.stderr


@pytest.mark.slow
def test_cpu_launcher_default_says_how_to_start_16_processes():
    """On CPU `deepspeed launch/train.py --tp 4 --pp 4` starts one process: say --num_gpus 16."""
    proc = launch(None, ["--tp", "4", "--pp", "4", "--recipe", str(TINY)])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "is not divisible by tp*pp = 4*4 = 16" in proc.stderr
    assert "deepspeed --num_gpus 16 launch/train.py --tp 4 --pp 4" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def _one_line_exit_2(argv, capsys, *words):
    assert main(["--recipe", str(TINY)] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.mark.parametrize("flag", ["--metrics-out", "--save", "--timeline", "--comm-counts"])
def test_unwritable_output_path_is_refused_before_start(flag, tmp_path, monkeypatch, capsys):
    """A path under a regular file cannot be created, whoever runs (root included)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_exit_2([flag, str(blocker / "out")], capsys, flag, str(blocker))


@pytest.mark.parametrize("name,value", [("GPT3D_PEAK_TFLOPS", "fast"), ("GPT3D_PEAK_TFLOPS", "-5"),
                                        ("GPT3D_FAULT_INJECT", "1"), ("GPT3D_CACHE_LOCK_TIMEOUT_S", "0")])
def test_malformed_environment_override(name, value, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(name, value)
    _one_line_exit_2([], capsys, f"{name}={value!r}")


def test_wandb_online_without_api_key_is_refused_before_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no entry for api.wandb.ai
    (tmp_path / "netrc").write_text("machine example.com login u password p\n")
    _one_line_exit_2(["--wandb", "online"], capsys, "--wandb online", "WANDB_API_KEY", "wandb login")
    # with a netrc entry, the check lets it through (to wandb itself, not run here)
    from launch.trainer.preflight import wandb_api_key_present
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    assert wandb_api_key_present()


def test_tokenizer_without_eos_is_refused_before_tokenizing(tmp_path, monkeypatch, capsys):
    from data.builtin import load_tokenizer
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    tokenizer = load_tokenizer("builtin")
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "no-eos")
    _one_line_exit_2(["--set", f"data.tokenizer={tmp_path / 'no-eos'}"], capsys, "no EOS token",
                     f"data.tokenizer='{tmp_path / 'no-eos'}'")


@pytest.mark.slow  # waits out the lock's timeout in a second process: 15 s
def test_data_cache_lock_gives_up_naming_the_holder(tmp_path, monkeypatch, capsys):
    """A builder that hangs (here: one that sleeps) holds the lock of the builtin corpus; a run
    that needs the same file gives up after GPT3D_CACHE_LOCK_TIMEOUT_S with the holder's pid."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("GPT3D_CACHE", str(tmp_path))
    monkeypatch.setenv("GPT3D_CACHE_LOCK_TIMEOUT_S", "1")
    hang = ("import time; from data.builtin import python_version; "
            "from data.cache import build_once, default_cache_dir; "
            "build_once(default_cache_dir() / f'builtin-corpus-py{python_version()}', lambda tmp: time.sleep(120))")
    holder = subprocess.Popen([sys.executable, "-c", hang], env=dict(os.environ))
    try:
        lock = None
        for _ in range(600):  # until the holder has the lock and wrote its name
            locks = [p for p in tmp_path.glob(".builtin-corpus-*.lock") if p.read_text()]
            if locks:
                lock = locks[0]
                break
            time.sleep(0.1)
        assert lock is not None, "the holder never took the lock"
        start = time.monotonic()
        err = _one_line_exit_2([], capsys, f"pid {holder.pid} on host {socket.gethostname()}", str(lock),
                               "GPT3D_CACHE_LOCK_TIMEOUT_S")
        assert time.monotonic() - start < 30, err
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("supported", [False, True], ids=["unsupported", "supported"])
def test_fp16_where_the_accelerator_has_none_is_refused_before_start(supported, monkeypatch, capsys):
    """The accelerator's own capability answer decides, whatever this machine's is (tests/helpers/fp16_on_cpu
    lifts it for fp16 runs): refused where it says no, accepted where it says yes."""
    from deepspeed.accelerator import get_accelerator

    from launch.engine.distributed import check_precision_supported
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: supported)
    if supported:
        check_precision_supported("fp16")
    else:
        _one_line_exit_2(["--set", "train.precision=fp16"], capsys, "train.precision=fp16", "fp32 or bf16")


def test_immediate_grad_update_is_refused_only_under_zero_bubble():
    """The same key at pp = 1 (1F1B runs), with 1F1B, and set to false passes the layout's checks."""
    from launch.config.layout import check_and_derive_layout
    from launch.config.recipe import load_recipe
    immediate = "deepspeed.bf16.immediate_grad_update"
    for pp, overrides in [(1, ["train.schedule=zb-h1", f"{immediate}=true"]),
                          (2, ["train.schedule=1f1b", f"{immediate}=true"]),
                          (2, ["train.schedule=zb-h1", f"{immediate}=false"])]:
        check_and_derive_layout(load_recipe(TINY, overrides), 2, 1, pp, True)


def _train_batch_with_an_inline_schedule(self, data_iter=None):
    from deepspeed.runtime.pipe.schedule import TrainSchedule
    self._exec_schedule(TrainSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id))


@pytest.mark.parametrize("owner,member,replacement", [
    ("PipelineEngine", "_train_schedule", None),
    ("PipelineEngine", "train_batch", _train_batch_with_an_inline_schedule),
    ("PipelineEngine", "_exec_backward_pass", None),
    ("BF16_Optimizer", "update_hp_grads", None),
], ids=["no-_train_schedule", "inline-schedule", "no-_exec_backward_pass", "no-update_hp_grads"])
def test_deepspeed_without_a_zero_bubble_hook_is_refused_before_start(owner, member, replacement, monkeypatch,
                                                                       capsys):
    """A DeepSpeed lacking one of the private members ZB-H1 overrides, or whose engine builds its
    train schedule inline (train_batch never calls `_train_schedule`), would run 1F1B under the
    name zb-h1: refused before any process group starts, naming the version and the hook."""
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.pipe.engine import PipelineEngine
    cls = {"PipelineEngine": PipelineEngine, "BF16_Optimizer": BF16_Optimizer}[owner]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if replacement is None:
        monkeypatch.delattr(cls, member)
    else:
        monkeypatch.setattr(cls, member, replacement)
    # Unrefused, the run would start: fail here instead of in a rank's one-line exit (os._exit)
    monkeypatch.setattr("launch.trainer.loop.run_training", lambda job: pytest.fail("training started"))
    hook = "PipelineEngine._train_schedule" if member == "train_batch" else f"{owner}.{member}"
    _one_line_exit_2(["--pp", "2", "--set", "train.schedule=zb-h1"], capsys, f"DeepSpeed {deepspeed.__version__}",
                     hook, "train.schedule=1f1b")


def test_a_malformed_slow_save_hook_is_refused_before_the_start(monkeypatch, capsys):
    """GPT3D_SLOW_SAVE (launch/checkpoints/slow_save.py), a test hook, is checked with the others."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("GPT3D_SLOW_SAVE", "soon")
    assert main(["--recipe", str(TINY)]) == 2
    assert capsys.readouterr().err == "error: GPT3D_SLOW_SAVE='soon' must be seconds in [0, 3600) (a test hook, e.g. 8)\n"


def _float_fields(section, prefix: str):
    """Every float field (Optional included) of a recipe section and of the sections inside it,
    from their own declarations."""
    import dataclasses
    import typing
    for name, annotation in typing.get_type_hints(type(section)).items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, f"{prefix}{name}.")
        elif annotation is float or float in typing.get_args(annotation):
            yield prefix + name


def test_every_float_field_refuses_nan_infinities_and_numbers_past_floats_range(capsys):
    """NaN passes a range check written `x <= 0` and inf passes `x > 0`; 10**400 made float() raise
    OverflowError, a traceback. Every float field of every section, each value given as --set (YAML
    reads `.nan`, `.inf`, `1e400` and a 401-digit integer): one line naming the field, exit 2."""
    from launch.config.recipe import Recipe
    recipe = Recipe()
    fields = [f for section in ("model", "data", "train", "wandb", "eval")
              for f in _float_fields(getattr(recipe, section), section + ".")]
    assert {"train.lr", "model.norm_eps", "model.moe.aux_loss_coef", "train.grad_clip"} <= set(fields), fields
    for field in fields:
        for value in (".nan", ".inf", "-.inf", "1e400", "1" + "0" * 400):
            _one_line_exit_2(["--set", f"{field}={value}"], capsys, f"error: {field}=", "must be a finite number")


RECIPE_FILES = [
    # (the file's bytes, words of the one line): what PyYAML accepts silently or raises a traceback on.
    (b"train:\n  lr: 1.0e-3\ntrain:\n  steps: 3\n", ["key 'train' is given twice (lines 1 and 3)"]),
    (b"\xff\xfetrain: {}\n", ["is not UTF-8 text (byte 0xff at offset 0)"]),
    (b"a: " + b"[" * 3000 + b"]" * 3000, ["nested too deeply"]),
    (b"train: &t\n  x: *t\n", ["nested more than 32 levels"]),
    (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
        b"%c: &%c [%s]\n" % (98 + i, 98 + i, b", ".join([b"*%c" % (97 + i)] * 10)) for i in range(5)),
     ["holds more than 100000 values"]),
    (b"- 1\n- 2\n", ["is a YAML list, not a mapping of sections"]),
    (b"train:\n  l\x1b[2Jr: 1\n", ["unacceptable character #x001b"]),
    (b'train:\n  "l\\nr\\e[2J": 1\n', ["unknown recipe key train.l\\nr\\x1b[2J"]),  # YAML's own escapes
]


@pytest.mark.parametrize("text,words", RECIPE_FILES, ids=[w[0][:30] for _, w in RECIPE_FILES])
def test_a_malformed_recipe_file_is_one_line(text, words, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text)
    assert main(["--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: recipe '{recipe}'") or "unknown recipe key" in err, err
    assert err.count("\n") == 1 and err[:-1].isprintable(), err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("script,argv", [
    ("export_hf", ["--load", "/no/such", "--out", "s3://bucket/model"]),
    ("evaluate", ["--load", "gs://bucket/run"]),
    ("plan", ["--recipe", str(TINY), "--plot", "s3://bucket/plan.png"]),
    ("prepare_data", ["--recipe", "https://host/recipe.yaml"]),
])
def test_every_entry_point_refuses_a_url_as_a_path(script, argv, tmp_path, monkeypatch, capsys):
    """Path('s3://bucket/x') is the relative path s3:/bucket/x: an output there was written silently."""
    import importlib
    monkeypatch.chdir(tmp_path)
    assert importlib.import_module(f"launch.{script}").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --") and "is a URL" in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # no directory named s3: or gs:
