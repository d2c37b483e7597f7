"""The training windows of a run's data, step by step, read the way every dp rank reads them:
for tests that compare orders across dp sizes and resumes (tests/data/test_streaming.py,
tests/data/test_mixture.py)."""


def windows_per_step(data, dp, steps, start=0, data_state=None):
    """([step k's windows in global-batch order, each a tuple of input_ids + its last label], the
    stream states of the dp ranks after the last step): `steps` steps of `data` (a RunData or a
    mixture's data) from step `start`, resuming from `data_state` when given."""
    B, b = data.global_batch_size, data.micro_batch_size
    per_step, states = [[] for _ in range(steps)], []
    for rank in range(dp):
        it = data.train_batches(rank, dp, start_sample=start * B, data_state=data_state)
        for k in range(steps):
            for _ in range(B // dp // b):
                x, y = next(it)
                per_step[k] += [tuple(xi.tolist()) + (int(yi[-1]),) for xi, yi in zip(x, y)]
        states.append(it.state())
    return per_step, states
