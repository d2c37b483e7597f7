"""Multiple-choice tasks scored through the pipeline engine's eval path, at any (tp, pp, dp, cp,
ep) (the rules in data/multiple_choice.py).

Every choice is one sequence of the model's length: its context and continuation cut on the left,
padded on the right, labels only at the continuation's tokens. While scoring, the pipeline's loss
is each sequence's summed token loss, (B,) per micro-batch (`ContinuationLoss`; a CP rank sums
its shard and the CP group adds them), which `eval_batch(reduce_output=None)` hands back per
micro-batch on the last stage. Examples are dealt to the dp replicas in turn, each example's
choices to one replica; every replica runs the same number of global batches (the short ones
padded with sequences that count no token). Each last-stage rank of TP and CP rank 0 writes its
sequences' log-likelihoods at their places in one vector of the whole task, which an all-reduce
sums over the world: every rank then holds every choice's log-likelihood and counts acc and
acc_norm itself, so the counts come from the log-likelihoods, not from per-replica means.
The log-likelihoods do not depend on the layout but for fp32 rounding (the model runs in fp32)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from data.multiple_choice import Example, continuation_tokens, scored_window
from model.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from launch.config.layout import Layout
    from model.parallel.state import ParallelState


ChoiceSequence = Tuple[List[int], List[int]]  # (inputs, labels), each seq_len long


class ContinuationLoss:
    """The pipeline's loss_fn while scoring: (B, T/cp, V/tp) logits, (B, T/cp) labels -> (B,) each
    sequence's summed loss of its counted tokens (minus its continuation's log-likelihood)."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        sums = vocab_parallel_cross_entropy(logits.float(), labels, self.state.tp_group).sum(dim=1)
        if self.state.cp_group is not None:  # each CP rank holds T/cp of every sequence
            dist.all_reduce(sums, group=self.state.cp_group)
        return sums


def choice_sequences(examples: List[Example], encode: Callable[[str], List[int]], seq_len: int
                     ) -> List[ChoiceSequence]:
    """(inputs, labels), each seq_len long, of every choice of every example in order."""
    out = []
    for example in examples:
        for choice in example.choices:
            tokens, scored = scored_window(*continuation_tokens(encode, example.context, choice), seq_len)
            inputs, targets = tokens[:-1], tokens[1:]
            labels = [IGNORE_INDEX] * (len(targets) - scored) + targets[len(targets) - scored:]
            pad = seq_len - len(inputs)
            out.append((inputs + [0] * pad, labels + [IGNORE_INDEX] * pad))
    return out


@dataclass(frozen=True)
class TaskSequences:
    """A task's examples and every choice's sequence, tokenized once per run (a HellaSwag
    evaluation is 40k sequences: seconds of tokenizing that every `eval.every` would repeat)."""
    name: str
    examples: List[Example]
    sequences: List[ChoiceSequence]
    seq_len: int  # of every sequence


def task_sequences(tasks: Sequence[Tuple[str, List[Example]]], tokenizer, seq_len: int) -> List[TaskSequences]:
    """Each (name, examples) of `tasks` with its choices' sequences."""
    def encode(text: str) -> List[int]:
        return tokenizer(text)["input_ids"]
    return [TaskSequences(name, examples, choice_sequences(examples, encode, seq_len), seq_len)
            for name, examples in tasks]


def score_choices(engine, state: ParallelState, layout: Layout, task: TaskSequences,
                  device: torch.device, progress: Callable[[], None] = lambda: None) -> List[List[float]]:
    """Every example's choices' log-likelihoods, on every rank (collective: every rank calls it);
    `progress()` after each batch (a full task may take longer than the hang bound of a step)."""
    from model.parallel.context_parallel import sequence_shards
    examples, sequences, seq_len = task.examples, task.sequences, task.seq_len
    first = [0]
    for example in examples:
        first.append(first[-1] + len(example.choices))
    # Example i goes to replica i % dp; the replica's sequences in order, with their global places.
    mine = [k for i in range(state.dp_rank, len(examples), layout.dp) for k in range(first[i], first[i + 1])]
    per_replica = [sum(first[i + 1] - first[i] for i in range(r, len(examples), layout.dp)) for r in range(layout.dp)]
    b, m = layout.micro_batch_size, layout.grad_accum_steps
    batches = math.ceil(max(per_replica) / (b * m))
    idle = ([0] * seq_len, [IGNORE_INDEX] * seq_len)  # counts no token
    kept = engine.module.loss_fn
    engine.module.loss_fn = ContinuationLoss(state)
    losses: List[float] = []
    try:
        for k in range(batches):
            chunk = [sequences[i] for i in mine[k * b * m:(k + 1) * b * m]]
            chunk += [idle] * (b * m - len(chunk))
            micro = [(torch.tensor([s[0] for s in chunk[j * b:(j + 1) * b]], device=device),
                      torch.tensor([s[1] for s in chunk[j * b:(j + 1) * b]], device=device)) for j in range(m)]
            # DeepSpeed sums every forward's loss into total_loss and resets it only in train_batch:
            # a (B,) loss cannot add into an earlier evaluation's scalar.
            engine.total_loss = None
            outputs = engine.eval_batch(iter(sequence_shards(iter(micro), state.cp_rank, state.cp_size)),
                                        reduce_output=None, bcast_loss=False, num_micro_batches=m)
            if engine.is_last_stage():
                losses += torch.cat([o.reshape(-1) for o in outputs]).tolist()
            progress()
    finally:
        engine.module.loss_fn, engine.total_loss = kept, None
    found = torch.zeros(len(sequences), dtype=torch.float64, device=device)
    if engine.is_last_stage() and state.tp_rank == 0 and state.cp_rank == 0:
        found[mine] = -torch.tensor(losses[:len(mine)], dtype=torch.float64, device=device)
    dist.all_reduce(found)
    values = found.tolist()
    return [values[first[i]:first[i + 1]] for i in range(len(examples))]


def accuracy(examples: List[Example], loglikelihoods: List[List[float]]) -> Dict[str, float]:
    """acc (the highest log-likelihood is the gold choice) and acc_norm (per character of the
    choice), the harness's multiple_choice metrics; ties go to the first choice, as numpy's argmax."""
    def pick(scores: List[float]) -> int:
        return max(range(len(scores)), key=lambda j: (scores[j], -j))
    correct = sum(pick(ll) == ex.gold for ex, ll in zip(examples, loglikelihoods))
    normed = sum(pick([v / max(n, 1) for v, n in zip(ll, ex.lengths)]) == ex.gold for ex, ll in zip(examples, loglikelihoods))
    n = len(examples)
    return {"acc": correct / n, "acc_norm": normed / n, "n": n}


def score_tasks(engine, state: ParallelState, layout: Layout, tasks: List[TaskSequences],
                device: torch.device, progress: Callable[[], None] = lambda: None) -> Dict[str, Dict[str, Any]]:
    """Task name -> acc, acc_norm, n, gold_loglikelihood (the gold choices' mean log-likelihood, a
    number that moves before the accuracy does) and choice_loglikelihoods (collective)."""
    scores = {}
    for task in tasks:
        loglikelihoods = score_choices(engine, state, layout, task, device, progress)
        gold = sum(ll[ex.gold] for ex, ll in zip(task.examples, loglikelihoods)) / len(task.examples)
        scores[task.name] = {**accuracy(task.examples, loglikelihoods), "gold_loglikelihood": gold,
                             "choice_loglikelihoods": loglikelihoods}
    return scores
