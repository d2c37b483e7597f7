"""The data of a run, the one entry point launch/ uses: `prepare_run_data` checks the recipe's
data section against the run, before any process group starts, and gives its RunData
(data/pipeline.py): one source (data/pipeline.py's SourceData) or a mixture, `data.mix`
(data/mixture_run.py's MixtureData). Both have the methods the training loop calls.
"""
from transformers import PreTrainedTokenizerBase

from data.mixture_run import prepare_mixture
from data.pipeline import RunData
from data.prepare_source import prepare_source_data
from data.spec import DataSpec


def prepare_run_data(spec: DataSpec, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int,
                     global_batch_size: int, micro_batch_size: int, evaluate: bool,
                     eval_batches: int = 1) -> RunData:
    """Check the data against the run and build (or reuse) its caches; raises DataError."""
    prepare = prepare_mixture if spec.mix else prepare_source_data
    return prepare(spec, tokenizer, seq_len, seed, global_batch_size, micro_batch_size, evaluate, eval_batches)
