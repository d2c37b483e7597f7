"""megatron-core's training step on the job launch/train.py would run: one rank of the peer that
bench/peers/peers.py launches beside ours (through DeepSpeed's launcher, as ours), in .venv-megatron.

It takes launch/train.py's own command line and reads it the way train.py does
(`prepare_training_job`): the same recipe and `--set` overrides, layout, tokenizer and data, so the
same micro-batches in the same order; `--init-from-hf DIR` names the transformers checkpoint both
start from (bench/peers/megatron_weights.py maps it), `--metrics-out FILE` gets one JSON line per step.

The step is megatron-core's own: GPTModel with the local layer spec, `use_cpu_initialization`, its
pipeline schedule (`get_forward_backward_func`: no pipelining at pp 1, 1F1B at pp > 1), the
tied-embedding gradient all-reduce between the first and last stage (as its
finalize_model_grads does), then torch AdamW with the recipe's hyper-parameters, weight-decay
groups (launch/engine/engine.py's param_groups) and learning-rate schedule
(launch/optim/lr_schedule.py). No clipping: bench/peers/peers.py runs ours with train.grad_clip=0.
Only dp = 1 is supported (tp x pp = world).

Each step's line holds, as ours' metrics line does, its loss (the mean over its micro-batches'
token means, as ours with every token counted), `tokens` so far, `step_time_s` and `elapsed_s` (the
loop's clock at the line: its differences are whole loop iterations, the next step's data drawn
included); and the time of each part: `forward_backward` (the schedule, p2p included), within
it `forward` and `backward` (the schedule's forward_step and backward_step calls), then
`embedding_grads`, `optimizer` (AdamW and the lr step), `zero_grad`.
"""
import json
import os
import sys
import time
from functools import partial

import torch


def transformer_config(config, layout):
    """megatron-core's TransformerConfig for our GPTConfig (fp32, dropout 0, fusions off)."""
    from megatron.core.transformer import TransformerConfig

    from bench.peers.megatron_shims import UNFUSED
    llama = config.arch != "gpt2"
    activation = torch.nn.functional.silu if llama else partial(torch.nn.functional.gelu, approximate="tanh")
    return TransformerConfig(
        num_layers=config.n_layer, hidden_size=config.n_embd, num_attention_heads=config.n_head,
        num_query_groups=config.n_kv_head, kv_channels=config.head_dim,
        ffn_hidden_size=config.ffn_hidden_size if llama else 4 * config.n_embd,
        normalization="RMSNorm" if llama else "LayerNorm", layernorm_epsilon=config.norm_eps,
        gated_linear_unit=llama, activation_func=activation, add_bias_linear=not llama, add_qkv_bias=not llama,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp, sequence_parallel=False,
        use_cpu_initialization=True, attention_softmax_in_fp32=True, **UNFUSED)


def build_model(config, layout, vocab_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    llama = config.arch != "gpt2"
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm")
    return GPTModel(transformer_config(config, layout), spec, vocab_size=vocab_size,
                    max_sequence_length=config.seq_len,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=config.tie_embeddings,
                    position_embedding_type="rope" if llama else "learned_absolute",
                    rotary_base=int(config.rope_theta) if llama else 10000)


def loaded_model(job, config):
    """megatron-core's GPTModel of this stage for `job` (megatron's model parallel state set up for
    its layout, the CPU shims installed), loaded from its `--init-from-hf` checkpoint."""
    from megatron.core import parallel_state

    from bench.peers import megatron_shims
    from bench.peers.megatron_weights import load_hf_checkpoint, load_into
    megatron_shims.install()
    parallel_state.initialize_model_parallel(job.layout.tp, job.layout.pp)
    model = build_model(config, job.layout, job.vocab_size)
    load_into(model, load_hf_checkpoint(job.args.init_from_hf), config.arch, config.n_head, config.n_kv_head,
              parallel_state.get_tensor_model_parallel_rank(), job.layout.tp)
    return model


def token_losses(model, tokens, labels):
    """(b, s) ids and labels -> megatron-core's GPTModel's per-token loss (b, s) on the last stage."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, None, labels=labels)


def forward_step(data_iterator, model):
    """One micro-batch, as megatron-core's schedule calls it."""
    output = token_losses(model, *next(data_iterator))

    def loss_func(per_token):
        loss = per_token.float().mean()
        # A clone: the schedule divides the returned loss in place (by the number of micro-batches),
        # which would change the value reported here too.
        return loss.clone(), {"loss": loss.detach()}
    return output, loss_func


def all_reduce_tied_embedding_grads(model) -> None:
    """The first stage's word embedding and the last stage's output layer are one weight at pp > 1
    (GPT-2's tied head): their gradients are summed over the embedding group, as megatron-core's
    finalize_model_grads does (its version reads the main_grad buffers of its DDP wrapper)."""
    from megatron.core import parallel_state
    if (not model.share_embeddings_and_output_weights or parallel_state.get_pipeline_model_parallel_world_size() == 1
            or not parallel_state.is_rank_in_embedding_group()):
        return  # untied (Llama): two weights; pp 1: one weight, its gradient already whole
    weight = model.shared_embedding_or_output_weight()
    torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


class PassClock:
    """Seconds in the schedule's forward_step and backward_step calls this step (schedules.py calls
    them by their module names, so wrapping those names times every micro-batch's passes)."""

    def __init__(self):
        from megatron.core.pipeline_parallel import schedules

        from bench.peers.timed_calls import timed_into
        self.seconds = {"forward": 0.0, "backward": 0.0}
        schedules.forward_step = timed_into(self.seconds, "forward", schedules.forward_step)
        schedules.backward_step = timed_into(self.seconds, "backward", schedules.backward_step)

    def take(self) -> dict:
        seconds = dict(self.seconds)
        self.seconds.update(forward=0.0, backward=0.0)  # in place: the wrappers add into this dict
        return seconds


def main(argv) -> int:
    from launch.config.cli import parse_training_args
    from launch.engine.distributed import threads_per_rank, usable_cpus
    from launch.engine.engine import param_groups
    from launch.optim.lr_schedule import lr_ratio
    from launch.trainer.startup import prepare_training_job

    job = prepare_training_job(parse_training_args(argv))
    recipe, layout, t = job.recipe, job.layout, job.recipe.train
    if layout.dp != 1 or layout.cp != 1:
        raise SystemExit("bench/peers/megatron_peer.py: tp x pp must be the world (dp = cp = 1)")
    torch.set_num_threads(threads_per_rank(os.environ, usable_cpus(), layout.world_size))  # as ours' start_rank
    torch.distributed.init_process_group("gloo")

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = recipe.gpt_config(job.vocab_size, job.data.tokenizer.eos_token_id)
    model = loaded_model(job, config)
    optimizer = torch.optim.AdamW(param_groups(model), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_ratio(i, t.warmup_steps, t.steps, t.min_lr_ratio))
    forward_backward = get_forward_backward_func()
    passes = PassClock()
    batches = job.data.train_batches(0, 1)
    writes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    out = open(job.args.metrics_out, "w") if writes and job.args.metrics_out else None
    tokens_per_step = layout.global_batch_size * recipe.seq_len

    loop_start = time.perf_counter()
    for step in range(1, t.steps + 1):
        micro_batches = [next(batches) for _ in range(layout.grad_accum_steps)]
        start = time.perf_counter()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
                                  num_microbatches=layout.grad_accum_steps, seq_length=recipe.seq_len,
                                  micro_batch_size=layout.micro_batch_size, forward_only=False)
        t_fb = time.perf_counter()
        all_reduce_tied_embedding_grads(model)
        t_emb = time.perf_counter()
        optimizer.step()
        schedule.step()
        t_opt = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        pass_seconds = passes.take()
        if out is not None:
            loss = torch.stack([x["loss"] for x in losses]).mean().item()
            out.write(json.dumps({"step": step, "loss": loss, "tokens": step * tokens_per_step,
                                  "step_time_s": end - start, "tokens_per_s": tokens_per_step / (end - start),
                                  "elapsed_s": time.perf_counter() - loop_start,  # as ours' metrics line
                                  "parts_s": {"forward_backward": t_fb - start, **pass_seconds,
                                              "embedding_grads": t_emb - t_fb,
                                              "optimizer": t_opt - t_emb, "zero_grad": end - t_opt}}) + "\n")
            out.flush()
    if out is not None:
        out.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
