"""A process that streams a local parquet corpus with read-ahead, draws a few micro-batches (the
worker is then reading and tokenizing ahead), closes its batches as the training loop does at
the end of a run, and ends the ordinary way: `main` returns and the interpreter exits
(tests/data/test_read_ahead_exit.py runs several and reads their exit codes).

    python -m helpers.exit_reading_ahead CORPUS_DIR CACHE_DIR
"""
import os
import sys

B, MICRO, SEQ_LEN = 32, 4, 63
DRAWN = 3  # micro-batches drawn before the exit: the worker is busy refilling what they emptied


def run_data(corpus: str):
    """The RunData of the corpus's parquet files, streamed with 50 steps of read-ahead; its caches
    (the unit list, the stream checks) in GPT3D_CACHE."""
    from data.builtin import load_tokenizer
    from data.run import prepare_run_data
    from data.spec import DataSpec

    spec = DataSpec(name=f"{corpus}/part*.parquet", streaming=True, val_fraction=0.0, streams=8,
                    shuffle_buffer=16, read_ahead_steps=50)
    return prepare_run_data(spec, load_tokenizer("builtin"), SEQ_LEN, seed=1, global_batch_size=B,
                            micro_batch_size=MICRO, evaluate=False)


def main(corpus: str, cache: str) -> None:
    os.environ["GPT3D_CACHE"] = cache
    data = run_data(corpus)
    batches = data.train_batches(0, 1)
    for _ in range(DRAWN):
        next(batches)
    data.close_batches(batches)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
