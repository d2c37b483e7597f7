"""The GPT of `model/gpt/model.py` as a DeepSpeed `PipelineModule` (Huang et al. 2019; Narayanan 2021).

One LayerSpec per entry of the layer table (model/gpt/layer_table.py): the embedding is a
TiedLayerSpec('embed') when the head is tied, and the tied head the same TiedLayerSpec with
forward_fn = logits; an untied head is a LayerSpec(LMHead). DeepSpeed builds only the local
stage's layers; when tied, it ties shard k of the embedding on the first stage to shard k on the
last stage and all-reduces their gradients (docs/design.md contract 6).
Only the hidden states cross stage boundaries (with the document mask, a tuple of them and the
(B, T) segment ids: model/transformer/documents.py); positions and the mask are derived inside (contract 7).
With sequence parallelism they are (B, T/t, h): TP rank r of a stage sends its own sequence
chunk to TP rank r of the next stage (DeepSpeed's p2p groups pair the same model-parallel
coordinate; see `pipeline_config` for what must be switched off).
"""
import contextlib
import hashlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.moe.layer import MoE
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

from model.config import GPTConfig
from model.gpt.layer_table import layer_name, pipeline_layers
from model.gpt.model import LMHead, PositionEmbedding, TokenEmbedding
from model.parallel.context_parallel import token_weighted_mean
from model.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from model.parallel.layers import sequence_parallel_params
from model.parallel.state import ParallelState
from model.transformer.attention_inputs import StageAttentionInputs
from model.transformer.block import Block, norm_class
from model.transformer.moe import expert_group_name
from model.transformer.moe_losses import MoEStatistics

TP_DROPOUT_RNG = "tp-sharded-dropout"


def _logits(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)


def dropout_stream_seed(seed: int, *coordinate) -> int:
    """The seed of one rank's dropout stream, a hash of (seed, coordinate): distinct for every
    coordinate at any layout size, where Megatron's offsets (seed + 100 * stage, + 2718 + tp_rank,
    + 10 * dp_rank under data_parallel_random_init) collide once dp >= 10."""
    digest = hashlib.sha256(repr((seed,) + coordinate).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: every torch seeding API takes it


def seed_dropout_rngs(seed: int, state: ParallelState, *restart) -> None:
    """Megatron's two dropout streams (tensor_parallel/random.py), one per (stage, DP rank):

    - the default RNG, shared by the TP ranks of a stage: dropout of activations they all hold
      (embeddings, residual branches without sequence parallelism) must draw the same mask,
      else the replicas diverge;
    - the tracked stream TP_DROPOUT_RNG, one per TP rank as well: attention probabilities are
      TP-sharded (each rank its heads), and under sequence parallelism the embedding and
      residual dropout of each rank's sequence chunk forks it too, as Megatron does.
    Both differ across stages (blocks of the same shape on two stages would otherwise draw the
    same masks; Megatron adds 100 * stage to the seed for this) and across DP ranks (they hold
    different samples: shared streams would give sample i of every replica the same masks, so
    the masks of a global batch would depend on dp). DeepSpeed's activation checkpointing and
    launch/checkpoints/store.py save and restore both, so recomputation and resume replay them.
    `restart` (e.g. ("resumed", step)) starts fresh streams: a resume at another layout, which
    has no saved state for this rank's coordinate, must not replay the masks of step 1."""
    # The CP ranks of a replica hold different tokens (and, in attention, heads): their own streams.
    replica = (state.dp_rank,) if state.cp_size == 1 else (state.dp_rank, "cp", state.cp_rank)
    torch.manual_seed(dropout_stream_seed(seed, "replicated", state.pp_rank, *replica, *restart))
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(TP_DROPOUT_RNG, dropout_stream_seed(seed, "tp-sharded", state.pp_rank, *replica,
                                                    state.tp_rank, *restart))


def tp_dropout_rng():
    """The RNG of dropout on TP-sharded activations (attention probabilities): one stream per TP rank."""
    return get_cuda_rng_tracker().fork(TP_DROPOUT_RNG)


def layer_spec(kind: str, block: Optional[int], config: GPTConfig, state: ParallelState,
               attention_inputs: Optional[StageAttentionInputs] = None,
               moe_statistics: Optional[MoEStatistics] = None) -> LayerSpec:
    tp = state.tp_group
    # Without dropout nothing draws from the stream: no fork, which saves swapping the RNG state
    # around every attention core and, under train.compile, the graph breaks that swap causes.
    tp_dropout_rng_or_none = tp_dropout_rng if config.dropout > 0 else contextlib.nullcontext
    cp = state.cp_group
    if kind == "embed" and config.tie_embeddings:
        return TiedLayerSpec("embed", TokenEmbedding, config, tp, tied_weight_attr=["wte.weight"])
    if kind == "embed":
        return LayerSpec(TokenEmbedding, config, tp)
    if kind == "wpe":
        return LayerSpec(PositionEmbedding, config, tp, tp_dropout_rng_or_none, cp)
    if kind == "block":
        return LayerSpec(Block, config, block, tp, tp_dropout_rng_or_none, attention_inputs, cp_group=cp,
                         ep_group=state.ep_group, moe_statistics=moe_statistics)
    if kind == "ln_f":
        return LayerSpec(norm_class(config), config.n_embd, config.sequence_parallel_group(tp), eps=config.norm_eps)
    if kind == "lm_head":
        return LayerSpec(LMHead, config, tp)
    return TiedLayerSpec("embed", TokenEmbedding, config, tp, forward_fn=_logits, tied_weight_attr=["wte.weight"])


def layer_specs(config: GPTConfig, state: ParallelState) -> List[LayerSpec]:
    # One cache of RoPE's tables and the document mask for all blocks: DeepSpeed builds only this stage's
    # layers. Likewise one record of the router statistics for the stage's MoE blocks (model/transformer/moe_losses.py).
    attention_inputs = StageAttentionInputs(config)
    moe_statistics = MoEStatistics(config) if config.moe.enabled else None
    return [layer_spec(kind, block, config, state, attention_inputs, moe_statistics)
            for kind, block in pipeline_layers(config)]


class TokenMeanLoss:
    """The pipeline's loss_fn: the step's loss is the mean next-token loss over every counted token
    of the step (labels other than IGNORE_INDEX), across its micro-batches, DP replicas and CP shards,
    so the objective does not depend on the micro-batch size or on how many tokens each micro-batch
    counts (Megatron-LM's calculate_per_token_loss).

    DeepSpeed divides each micro-batch's loss by the gradient-accumulation steps m and averages the
    gradients (and the reported loss) over its data axis, dp x cp ranks. A micro-batch therefore
    returns its sum of token losses over `tokens_per_share` = N / (m x dp x cp), N the step's
    counted tokens, which the run sets before each step (launch/feed/step_tokens.py): the m x dp
    x cp shares then average to sum / N. A micro-batch without counted tokens returns 0, not NaN.
    Without it (a caller that drives the engine itself), each micro-batch is its own mean over its
    counted tokens (model/parallel/context_parallel.py: token_weighted_mean).

    The loss keeps the logits (its own alias of their memory) and writes its gradient into them in
    backward; nothing else reads them again (the head's backward needs its input and weight, not its
    output). DeepSpeed's last stage still holds the logits tensor in `pipe_buffers['outputs']` until
    that buffer's next forward (its `_exec_backward_pass` returns before clearing it on the last
    stage), so that tensor is emptied here: its memory then lives exactly as long as the loss's
    backward and the head's gradient need it, instead of being carried, one finished micro-batch's
    (B, T, V/p), into the next forward."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self.tokens_per_share: Optional[torch.Tensor] = None
        """0-d fp32 on the device, N / (m x dp x cp), or None: each micro-batch its own mean."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, T, V_pad/tp), (B, T) -> scalar; (B, T/cp, ...) under CP."""
        token_loss = vocab_parallel_cross_entropy(logits, labels, self.state.tp_group, consume_logits=True)
        logits.data = logits.new_empty(0)
        if self.tokens_per_share is not None:
            return token_loss.sum() / self.tokens_per_share
        # Under CP, (B, T/cp) tokens here: weighted over the CP group so that DeepSpeed's average
        # over dp x cp is the mean over the whole sequences' tokens (model/parallel/context_parallel.py).
        return token_weighted_mean(token_loss, labels != IGNORE_INDEX, self.state.cp_group)


def pipeline_config(sequence_parallel: bool) -> Dict[str, Any]:
    """The `pipeline` section of the DeepSpeed config this model needs.

    At tp > 1 DeepSpeed by default sends only 1/t of a stage's output (each TP rank its slice
    of the flattened tensor) and all-gathers it on the receiving stage: correct only when the
    TP ranks hold the same tensor. Under sequence parallelism they hold different chunks, so
    the slices would be stitched from different tensors; each rank must send its whole chunk
    (which is already 1/t of the sequence), and likewise for the gradients sent back."""
    if sequence_parallel:
        return {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    return {}


class ExpertParallelMarker(MoE):
    """What tells DeepSpeed's engine that the model has experts (it looks for a `deepspeed.moe.layer.MoE`
    module, then reduces, partitions and norms the expert parameters by their groups: see
    launch/engine/experts.py). No parameters and never called: our MoE blocks are model/transformer/moe.py's."""

    def __init__(self, num_experts: int, ep_size: int):
        torch.nn.Module.__init__(self)  # not MoE.__init__, which would build DeepSpeed's own experts
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = expert_group_name(ep_size)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine's call to create the groups: the run registered its own already."""

    def forward(self, *args):
        raise RuntimeError("ExpertParallelMarker is a marker for DeepSpeed's engine, not a layer")


class GPTPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule, plus stage boundaries given by the caller (`parts`, instead of
    a DeepSpeed partition method) and the sequence-parallel gradient sum (model/parallel/layers.py).

    After the last micro-batch's backward and before the data-parallel reduction and the
    optimizer step, DeepSpeed's pipeline engine all-reduces the gradient of every weight
    `get_tied_weights_and_groups` lists over its group (`_exec_reduce_tied_grads`; DeepSpeed's
    BF16 optimizer's fp32 gradients included). Listing this stage's sequence-parallel parameters
    with the TP group makes that the once-per-step TP sum they need, where an all-reduce per
    parameter per micro-batch in backward would cost m times the calls."""

    def __init__(self, tp_group, parts: Optional[Sequence[int]] = None, experts: Optional[Tuple[int, int]] = None,
                 virtual_stages: int = 1, **kwargs):
        self.given_parts = None if parts is None else tuple(parts)  # read by super().__init__
        # Interleaved stages (Narayanan et al. 2021, sec. 2.2.2): this rank holds v chunks, chunk c
        # being stage rank + c x pp of pp x v; `current_chunk` says which one `forward` runs
        # (launch/engine/interleaved.py sets it around each pass).
        self.virtual_stages, self.current_chunk = virtual_stages, 0
        self.chunk_ranges: List[Tuple[int, int]] = []  # each chunk's range of forward_funcs
        self.layer_indices: List[int] = []  # each entry of forward_funcs: its index in the layer table
        super().__init__(**kwargs)
        self.sequence_parallel_group = tp_group
        if experts is not None:  # (num_experts, ep): DeepSpeed's engine must see an MoE module
            self.expert_parallel_marker = ExpertParallelMarker(*experts)

    def _partition_layers(self, method: str = "uniform") -> None:
        """DeepSpeed's partition, or the stage boundaries the run computed (launch/analysis/partition.py):
        stage k builds layers parts[k]:parts[k+1], set as DeepSpeed's own methods set them."""
        if self.virtual_stages > 1:
            return self._partition_chunks(method)
        if self.given_parts is None:
            return super()._partition_layers(method)
        parts = list(self.given_parts)
        if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs) \
                or any(a > b for a, b in zip(parts, parts[1:])):
            raise ValueError(f"parts={parts} are not {self.num_stages} stages over {len(self._layer_specs)} layers")
        self.parts = parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    def _partition_chunks(self, method: str) -> None:
        """v chunks per rank: the given boundaries of pp x v stages (`parts`, pp x v + 1 of them), else
        DeepSpeed's partition over pp x v stages; this rank's chunk c is stage rank + c x pp. `_build`
        builds them all."""
        pp, stage = self.num_stages, self._topo.get_coord(self.global_rank).pipe
        if self.given_parts is not None:
            parts = list(self.given_parts)
            if len(parts) != pp * self.virtual_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs):
                raise ValueError(f"parts={parts} are not {pp} x {self.virtual_stages} stages over "
                                 f"{len(self._layer_specs)} layers")
            self.parts = parts
        else:
            self.num_stages = pp * self.virtual_stages
            try:
                super()._partition_layers(method)
            finally:
                self.num_stages = pp
        self.chunk_bounds = [(self.parts[stage + c * pp], self.parts[stage + c * pp + 1])
                             for c in range(self.virtual_stages)]
        self._set_bounds(start=self.chunk_bounds[0][0], stop=self.chunk_bounds[0][1])

    def _build(self) -> None:
        """DeepSpeed's build of one range, once per chunk: the modules keep their names (their index
        in the layer table), so the state dict does not depend on v or pp."""
        if self.virtual_stages == 1:
            super()._build()
            self.chunk_ranges = [(0, len(self.forward_funcs))]
            self.layer_indices = list(range(self._local_start, self._local_start + len(self.forward_funcs)))
            return
        for start, stop in self.chunk_bounds:
            first = len(self.forward_funcs)
            self._set_bounds(start=start, stop=stop)
            super()._build()
            self.chunk_ranges.append((first, len(self.forward_funcs)))
            self.layer_indices += list(range(start, stop))
        self._set_bounds(start=self.chunk_bounds[0][0], stop=self.chunk_bounds[0][1])

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank that builds layer `layer_idx` (DeepSpeed's tied groups read it)."""
        stage = super().stage_owner(layer_idx) if self.virtual_stages == 1 else \
            next(s for s in range(len(self.parts) - 1) if self.parts[s] <= layer_idx < self.parts[s + 1])
        return stage % self.num_stages

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """DeepSpeed's file name, from the layer's index in the layer table at any v (DeepSpeed's
        adds the local index to the one range's start)."""
        return self._at_layer(local_layer_idx, super().ckpt_layer_path, ckpt_dir)

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        return self._at_layer(local_layer_idx, super().ckpt_layer_path_list, ckpt_dir)

    def _at_layer(self, local_layer_idx: int, method, ckpt_dir):
        start = self._local_start
        self._local_start = self.layer_indices[local_layer_idx] - local_layer_idx
        try:
            return method(ckpt_dir, local_layer_idx)
        finally:
            self._local_start = start

    def forward(self, forward_input):
        """DeepSpeed's forward over this rank's layers, or over the current chunk's at v > 1."""
        if self.virtual_stages == 1:
            return super().forward(forward_input)
        start, stop = self.chunk_ranges[self.current_chunk]
        funcs = self.forward_funcs[start:stop]  # bound now: a recompute in backward replays these

        def run(first: int, last: int):
            def exec_func(*inputs):
                inputs = inputs[0] if len(inputs) == 1 else inputs
                for layer in funcs[first:last]:
                    inputs = layer(inputs)
                return inputs
            return exec_func
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return run(0, len(funcs))(forward_input)
        x = forward_input
        for first in range(0, len(funcs), interval):  # DeepSpeed's loop, over the chunk
            last = min(first + interval, len(funcs))
            x = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(funcs[first:last]):
                x = self.activation_checkpoint_func(run(first, last), *x)
            else:
                x = run(first, last)(*x)
        return x

    def get_tied_weights_and_groups(self):
        return super().get_tied_weights_and_groups() + [
            (param, self.sequence_parallel_group) for param in sequence_parallel_params(self)]


def build_pipeline(config: GPTConfig, state: ParallelState, activation_checkpoint_interval: int = 0,
                   parts: Optional[Sequence[int]] = None, virtual_stages: int = 1) -> PipelineModule:
    """One PipelineModule on the run's topology, cut at `parts` (stage k holds layers
    parts[k]:parts[k+1]; the training run computes them from train.partition), else by counting
    transformer blocks (DeepSpeed's type:Block); with `virtual_stages` v > 1, pp x v stages (`parts`
    then has pp x v + 1 boundaries), v chunks per rank."""
    seed_dropout_rngs(config.seed, state)
    experts = (config.moe.num_experts, state.ep_size) if config.moe.enabled else None
    return GPTPipelineModule(tp_group=state.tp_group, parts=parts, experts=experts,
                             virtual_stages=virtual_stages,
                             layers=layer_specs(config, state),
                             topology=state.topology,
                             loss_fn=TokenMeanLoss(state),
                             partition_method="type:Block",
                             activation_checkpoint_interval=activation_checkpoint_interval,
                             # Without it DeepSpeed would checkpoint the embedding layers too (contract 9).
                             checkpointable_layers=["Block"])


def stage_contents(pipe: PipelineModule, config: GPTConfig) -> List[Tuple[int, str]]:
    """[(stage, 'layers a-b: names')] from DeepSpeed's partition boundaries `pipe.parts` (pp x v stages
    at v > 1, each named with its rank and chunk)."""
    names = [layer_name(kind, block, config.tie_embeddings) for kind, block in pipeline_layers(config)]
    out = []
    interleaved = getattr(pipe, "virtual_stages", 1) > 1  # stage s is chunk s // pp of rank s % pp
    for stage in range(len(pipe.parts) - 1):
        start, stop = pipe.parts[stage], pipe.parts[stage + 1]
        where = f"(rank {stage % pipe.num_stages}, chunk {stage // pipe.num_stages}) " if interleaved else ""
        out.append((stage, f"{where}layers {start}-{stop - 1}: {', '.join(names[start:stop])}"))
    return out
