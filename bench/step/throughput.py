"""Training tokens/s of our model through the real training path against transformers' GPT-2 and,
for `arch: llama` (GQA with --kv-heads, SwiGLU of --ffn, RoPE, RMSNorm, untied head), against
transformers' LlamaForCausalLM of the same shape; both architectures in one run by default.
`--archs moe` (on request) is our mixture of experts, arch mixtral (the Llama layout, every block's
MLP replaced by --experts SwiGLU experts of width --expert-ffn, each token sent to the --top-k
largest of a softmax router's probabilities, renormalised; no shared experts, no q/k norm), against
transformers' MixtralForCausalLM of the same shape (its default experts implementation); both add
the Switch load-balancing loss (weight MOE_AUX_COEF), neither a z-loss. The run checks that both
have the same number of parameters.

Ours: model/gpt/pipe.py's PipelineModule at tp=pp=dp=1 in a DeepSpeed engine configured by
launch/engine/ds_config.py (AdamW, ZeRO-1, clipping, the recipe's precision) and `train_batch`.
Peer: `GPT2LMHeadModel` (or `LlamaForCausalLM`) of the same dimensions in a plain PyTorch loop: torch AdamW with the
same hyper-parameters and weight-decay groups, the same clipping, batch and sequence length;
bf16 runs it under autocast with fp32 weights (DeepSpeed keeps fp32 master weights too).
Same random token batches, alternating repetitions, median. Runs on the GPU when one is present.
Ours runs twice, eager and with each block compiled (`train.compile`, model/gpt/compiled.py), in two
engines of the same seed; `--no-compile` leaves the compiled one out, and so does a machine where
the compiler cannot run (launch/engine/compiler.py says why in one line).

    python bench/step/throughput.py [--layers 4 --hidden 256 --heads 4 --seq-len 256 --batch 8]
                                    [--archs gpt2,llama --kv-heads 2 --ffn 688] [--no-compile]
                                    [--archs moe --experts 8 --top-k 2 --expert-ffn 256]
                                    [--steps 5 --repeats 3] [--precisions fp32,bf16] [--threads N] [--json]
"""
import argparse
import json
import statistics
import time
from typing import Tuple

import torch

from launch.engine.compiler import blocks_to_compile
from launch.engine.distributed import ensure_single_process_env
from launch.engine.engine import param_groups

VOCAB = 4096
MOE_AUX_COEF = 0.02  # Mixtral's weight of the load-balancing loss (model.moe.aux_loss_coef, router_aux_loss_coef)
PEER_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "moe": "Mixtral"}


def recipe_for(args, precision: str, arch: str = "gpt2"):
    from launch.config.recipe import Recipe
    recipe = Recipe()
    model_cfg, train_cfg = recipe.model, recipe.train
    model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd = args.layers, args.heads, args.hidden
    model_cfg.seq_len, model_cfg.vocab_size = args.seq_len, VOCAB
    if arch == "llama":
        model_cfg.arch, model_cfg.n_kv_head, model_cfg.ffn_hidden_size = "llama", args.kv_heads, args.ffn
    if arch == "moe":  # Mixtral's layout: every block MoE, top-k renormalised, no shared experts, no q/k norm
        from model.moe_config import MoEConfig
        model_cfg.arch, model_cfg.n_kv_head = "mixtral", args.kv_heads
        model_cfg.moe = MoEConfig(num_experts=args.experts, experts_per_token=args.top_k,
                                  expert_ffn_hidden_size=args.expert_ffn, aux_loss_coef=MOE_AUX_COEF, z_loss_coef=0.0)
    train_cfg.micro_batch_size = train_cfg.global_batch_size = args.batch
    train_cfg.precision, train_cfg.zero_stage = precision, 1
    train_cfg.grad_clip, train_cfg.warmup_steps = 1.0, 0
    train_cfg.steps = args.steps * (args.repeats + 1) + 1
    return recipe


def batches(args, device: str):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len + 1), generator=g)
    while True:
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def our_stepper(args, precision: str, arch: str, compiled: bool = False):
    from launch.config.layout import check_and_derive_layout
    from launch.engine.engine import build_engine
    from model.parallel.state import init_parallel_state

    recipe = recipe_for(args, precision, arch)
    layout = check_and_derive_layout(recipe, 1, 1, 1, on_cpu=True)
    config = recipe.gpt_config(VOCAB)
    state = init_parallel_state(1, 1, experts=config.moe.enabled)
    engine, _ = build_engine(recipe, layout, state, config, compiled)
    if config.moe.enabled:  # the router losses' backward scale, as the run sets it (1 here: fp32, one micro-batch)
        from launch.engine.experts import set_router_loss_scale
        set_router_loss_scale(engine, layout)
    data = batches(args, "cpu")  # the engine moves each micro-batch to its device

    def step() -> float:
        return engine.train_batch(data_iter=data).item()
    step.params = sum(p.numel() for p in engine.module.parameters())
    return step


def peer_model(args, arch: str):
    if arch == "moe":
        from transformers import MixtralConfig, MixtralForCausalLM

        from model.hf.llama import llama_config_kwargs
        config = recipe_for(args, "fp32", arch).gpt_config(VOCAB)
        kwargs = llama_config_kwargs(config)
        for key in ("attention_bias", "mlp_bias"):  # Mixtral has neither (nor have we: arch mixtral, bias off)
            assert not kwargs.pop(key)
        kwargs.update(intermediate_size=config.moe.expert_width(config.ffn_hidden_size),
                      num_local_experts=config.moe.num_experts, num_experts_per_tok=config.moe.experts_per_token,
                      output_router_logits=True, router_aux_loss_coef=MOE_AUX_COEF, router_jitter_noise=0.0)
        return MixtralForCausalLM(MixtralConfig(**kwargs))
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from model.hf.llama import llama_config_kwargs
        return LlamaForCausalLM(LlamaConfig(**llama_config_kwargs(recipe_for(args, "fp32", arch).gpt_config(VOCAB))))
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=args.seq_len, n_embd=args.hidden,
                                      n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def peer_stepper(args, precision: str, device: str, arch: str):
    t = recipe_for(args, precision, arch).train
    model = peer_model(args, arch).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(model), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay)
    data = batches(args, device)
    device_type = torch.device(device).type

    def step() -> float:
        x, y = next(data)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
            if arch == "moe":  # as MixtralForCausalLM adds it when given labels
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    step.params = sum(p.numel() for p in params)
    return step


def tokens_per_s(step, args) -> Tuple[float, float]:
    """(tokens per second of wall time, tokens per CPU second of this process). On a shared CPU
    the wall rate swings with the other jobs' load; the CPU rate counts only this process's own
    work (all its threads), so it compares eager and compiled code more steadily there."""
    from deepspeed.accelerator import get_accelerator
    get_accelerator().synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()  # .item() inside: each step has finished on the device
    tokens = args.steps * args.batch * args.seq_len
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - start_cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--archs", default="gpt2,llama", help="gpt2 against GPT2LMHeadModel, llama against "
                   "LlamaForCausalLM, moe (on request) against MixtralForCausalLM")
    p.add_argument("--kv-heads", type=int, default=2, help="llama, moe: key/value heads (default %(default)s)")
    p.add_argument("--ffn", type=int, default=688, help="llama: SwiGLU width (default %(default)s, ~8/3 * 256)")
    p.add_argument("--experts", type=int, default=8, help="moe: experts per block (default %(default)s)")
    p.add_argument("--top-k", type=int, default=2, help="moe: experts per token (default %(default)s)")
    p.add_argument("--expert-ffn", type=int, default=256, help="moe: each expert's SwiGLU width (default %(default)s)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also ours with each block compiled (default on; --no-compile skips it)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's intra-op threads for both models (default: torch's choice); on a CPU shared with "
                        "other jobs, 1 keeps each op off the cores' contention")
    p.add_argument("--json", action="store_true", help="last line: one JSON object with the results")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    ensure_single_process_env()
    from deepspeed.accelerator import get_accelerator

    from launch.engine.distributed import init_distributed
    init_distributed(600, verbose=False)
    device = get_accelerator().device_name(0)
    compiled = blocks_to_compile(args.compile, get_accelerator().device_name(), logging_rank=True)
    results = {"device": device, "dims": vars(args), "ratio": {}, "compiled_ratio": {}, "compiled_cpu_ratio": {}}
    for arch, precision in ((a, p) for a in args.archs.split(",") for p in args.precisions.split(",")):
        steppers = {"ours": our_stepper(args, precision, arch),
                    "transformers": peer_stepper(args, precision, device, arch)}
        if compiled:
            steppers["ours_compiled"] = our_stepper(args, precision, arch, compiled=True)
        params = {name: step.params for name, step in steppers.items()}
        if len(set(params.values())) != 1:  # not the same shape: the ratio would compare different models
            raise SystemExit(f"{arch}: the models differ in size, parameters {params}")
        first_step_s = {}
        for name, step in steppers.items():  # warm-up: first-step allocations, lazy initialisation, compilation
            start = time.perf_counter()
            step()
            first_step_s[name] = time.perf_counter() - start
        measured = {name: [] for name in steppers}
        measured_cpu = {name: [] for name in steppers}
        for _ in range(args.repeats):  # alternate, so drift of a noisy machine hits each alike
            for name, step in steppers.items():
                wall_rate, cpu_rate = tokens_per_s(step, args)
                measured[name].append(wall_rate)
                measured_cpu[name].append(cpu_rate)
        median = {k: statistics.median(v) for k, v in measured.items()}
        median_cpu = {k: statistics.median(v) for k, v in measured_cpu.items()}
        ratio = median["ours"] / median["transformers"]
        key = precision if arch == "gpt2" else f"{arch}-{precision}"  # GPT-2's keys as before
        results[key] = {"tokens_per_s": median, "runs": measured, "tokens_per_cpu_s": median_cpu,
                        "cpu_runs": measured_cpu, "first_step_s": first_step_s, "params": params["ours"]}
        results["ratio"][key] = ratio
        peer_name = PEER_NAMES[arch]
        print(f"{arch} {precision} on {device}: ours {median['ours']:,.0f} tok/s, transformers {peer_name} "
              f"{median['transformers']:,.0f} tok/s, ratio {ratio:.2f} (target >= 1.0)", flush=True)
        if compiled:
            results["compiled_ratio"][key] = median["ours_compiled"] / median["ours"]
            results["compiled_cpu_ratio"][key] = median_cpu["ours_compiled"] / median_cpu["ours"]
            print(f"{arch} {precision} on {device}: ours compiled {median['ours_compiled']:,.0f} tok/s against "
                  f"eager {median['ours']:,.0f} tok/s, ratio {results['compiled_ratio'][key]:.2f} (per CPU second "
                  f"{results['compiled_cpu_ratio'][key]:.2f}); first step {first_step_s['ours_compiled']:.1f} s "
                  f"compiled, {first_step_s['ours']:.1f} s eager", flush=True)
    results["threads"] = torch.get_num_threads()  # as the models ran (DeepSpeed's start-up may set it)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
