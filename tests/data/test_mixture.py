"""Data mixtures (data.mix): the interleave keeps every source within one sample of its share
after every sample (random mixes of 2 to 32 sources); each slot holds the source the rule gives
it (a brute-force recomputation) and each source's windows once per epoch, the same at every dp
and after a resume; validation losses are per source; bad mixtures are one line and exit 2; a
real run of recipes/mix-demo.yaml logs samples and validation loss per source, the same at dp=2
as on one process."""
import re
import threading
from fractions import Fraction

import datasets
import numpy as np
import pytest
import torch

from data.builtin import builtin_corpus, load_tokenizer
from data.mixture import Interleave, merge_mixture_states, mixture_micro_batches, source_seed
from data.mixture_run import MixtureData
from data.mixture_spec import parse_mixture
from data.pipeline import SourceData
from data.run import prepare_run_data
from data.spec import DataError, DataSpec
from helpers.launcher import REPO, TINY, launch_forked, read_metrics
from helpers.stream_steps import windows_per_step

MIX_DEMO = REPO / "recipes" / "mix-demo.yaml"
AWKWARD = [["0.7", "0.2", "0.1"], ["1", "1", "1"], ["0.01", "0.99"], ["5", "3", "2", "1"], ["0.333", "0.667", "0"],
           ["32", "3", "38", "40", "1"], ["0.15", "0.35", "0.5"], ["0.01", "0.03", "0.41", "0.53", "0.01"],
           ["9", "1", "1", "1", "0", "1", "1", "1", "1", "30"]]


def brute_force(weights, n_positions):
    """(source, that source's own position) of global positions 0..n-1, recomputed from Tijdeman's
    rule as docs/data.md states it, in exact fractions, scanning every source at every position:
    at n = g + 1, among the sources with share * n - count >= 1 - C (C = 1 - 1/(2(k-1)), k
    sources of positive weight), the smallest (count + C) / share, ties to the lower index."""
    total = sum(weights)
    shares = [w / total for w in weights]
    k = sum(w > 0 for w in weights)
    C = 1 - Fraction(1, 2 * (k - 1)) if k > 1 else Fraction(0)
    counts, out = [0] * len(weights), []
    for g in range(n_positions):
        n = g + 1
        allowed = [i for i, share in enumerate(shares) if share > 0 and share * n - counts[i] >= 1 - C]
        s = min(allowed, key=lambda i: ((counts[i] + C) / shares[i], i))
        out.append((s, counts[s]))
        counts[s] += 1
    return out


@pytest.mark.parametrize("weights", AWKWARD, ids=["-".join(w) for w in AWKWARD])
def test_counts_stay_within_one_sample_of_the_weights(weights):
    exact = [Fraction(w) for w in weights]
    interleave = Interleave(exact)
    shares = [w / sum(exact) for w in exact]
    n = 3 * interleave.period + 37  # past several cycles
    reference = brute_force(exact, n)
    counts = [0] * len(weights)
    for k in range(n + 1):
        assert interleave.counts(k).tolist() == counts, (weights, k)
        assert all(abs(c - share * k) <= 1 for c, share in zip(counts, shares)), (weights, k, counts)
        if k < n:
            counts[reference[k][0]] += 1
    far = 10 ** 9 + 7  # a resume deep into a long run costs no more than one cycle
    assert all(abs(c - share * far) <= 1 for c, share in zip(interleave.counts(far), shares))


def _share_errors(weights, n):
    """T * |count_s(g) - share_s * g| for g = 0..n, per source (T = sum of the integer weights),
    counted from the interleave's sources of positions [0, n) alone."""
    source, _ = Interleave([Fraction(w) for w in weights]).slots(0, n)
    counts = np.zeros((n + 1, len(weights)), dtype=np.int64)
    counts[1:] = np.cumsum(source[:, None] == np.arange(len(weights)), axis=0)
    g = np.arange(n + 1)[:, None]
    return np.abs(sum(weights) * counts - np.asarray(weights) * g)


@pytest.mark.parametrize("seed", range(4))
def test_every_source_stays_within_one_sample_of_its_share_for_any_number_of_sources(seed):
    """A property over 80 random mixtures per seed of 2 to 32 sources, and the five-source mix the
    largest-deficit rule broke: after every sample g up to 3000 (several cycles of the small
    mixes), |count_s(g) - share_s * g| < 1 for every source, and within Tijdeman's
    1 - 1/(2(k-1)) for k sources of positive weight (docs/data.md). The weights: small integers
    (some 0), shares in thousandths (a Dirichlet draw: a few large sources, many tiny ones), and
    weights spread over three decades."""
    rng = np.random.default_rng(seed)
    mixes = [[1, 3, 41, 53, 1]] if seed == 0 else []  # 0.01/0.03/0.41/0.53/0.01
    for i in range(80):
        k = int(rng.integers(2, 33))
        if i % 3 == 0:
            weights = rng.integers(0, int(rng.choice([3, 10, 100])), k)
        elif i % 3 == 1:
            weights = np.round(rng.dirichlet(np.full(k, 0.5)) * 1000)
        else:
            weights = 10 ** rng.uniform(0, 3, k)
        mixes.append([int(w) for w in weights])
    for weights in mixes:
        if not any(weights):
            weights[0] = 1
        total, positive = sum(weights), sum(w > 0 for w in weights)
        errors = _share_errors(weights, 3000)
        assert (errors < total).all(), (weights, np.argwhere(errors >= total)[:3].tolist())
        if positive > 1:
            assert (2 * (positive - 1) * errors <= (2 * positive - 3) * total).all(), weights


def _windows(sizes, width=5):
    """Source s's window i holds the id 1000*s + i in every token."""
    return [np.full((n, width), 1000 * s, dtype=np.int64) + np.arange(n)[:, None] for s, n in enumerate(sizes)]


def _global_batches(windows, interleave, seed, dp, steps, start_step=0, B=8, b=2):
    """[[window ids of step k, in global-batch order]]: dp rank r's micro-batches are the r-th 1/dp."""
    per_step = [[] for _ in range(steps)]
    for rank in range(dp):
        seeds = [source_seed(seed, s) for s in range(len(windows))]
        it = mixture_micro_batches(windows, seeds, [True] * len(windows), interleave, B, b, rank, dp, start_step * B)
        for k in range(steps):
            for _ in range(B // dp // b):
                x, y = next(it)
                assert torch.equal(x[:, 1:], y[:, :-1])
                per_step[k] += x[:, 0].tolist()
    return per_step


def test_order_is_the_same_at_every_dp_and_after_resume():
    sizes, seed, B = [7, 13, 13], 5, 8  # small sources: several epochs in the run
    weights = [Fraction("0.5"), Fraction("0.3"), Fraction("0.2")]
    sources = parse_mixture(DataSpec(mix=[{"label": f"s{i}", "weight": float(w)} for i, w in enumerate(weights)]))
    interleave = Interleave([s.weight for s in sources])
    windows = _windows(sizes)
    steps = 30
    expected = _global_batches(windows, interleave, seed, 1, steps)
    # Each slot holds the window of the source the rule gives its position (brute force), each
    # source's windows once per epoch, in an order that differs between epochs and between two
    # sources of one size; the same seed gives the same order, another seed another.
    rule = brute_force(weights, steps * B)
    drawn = [i for step in expected for i in step]
    assert [i // 1000 for i in drawn] == [s for s, _ in rule]
    epochs = {}  # (source, epoch) -> its window indices in order
    for (s, position), i in zip(rule, drawn):
        epochs.setdefault((s, position // sizes[s]), []).append(i % 1000)
    for (s, epoch), order in epochs.items():
        assert len(set(order)) == len(order) and (len(order) < sizes[s] or sorted(order) == list(range(sizes[s])))
    for s in range(3):
        complete = {tuple(order) for (t, _), order in epochs.items() if t == s and len(order) == sizes[s]}
        assert len(complete) > 1, s
    assert epochs[1, 0] != epochs[2, 0]
    assert _global_batches(windows, interleave, seed, 1, steps) == expected
    assert _global_batches(windows, interleave, seed + 1, 1, steps) != expected
    for dp in (2, 4):
        assert _global_batches(windows, interleave, seed, dp, steps) == expected, dp
    for start, dp in ((3, 1), (11, 2), (17, 4)):  # a resume needs only the sample count
        assert _global_batches(windows, interleave, seed, dp, steps - start, start) == expected[start:], (start, dp)


def test_validation_loss_is_each_sources_own_weighted_by_the_mixture():
    """Each source's validation loss comes from its own validation windows; the mixture's is their
    mean weighted by the mixture's weights (3 and 1: 3/4 and 1/4)."""
    sources = parse_mixture(DataSpec(mix=[{"label": "a", "weight": 3}, {"label": "b", "weight": 1}]))
    parts = [SourceData(spec=s.spec, tokenizer=None, seq_len=4, seed=0, global_batch_size=2, micro_batch_size=1,
                        train_windows=w, val_windows=w + 1) for s, w in zip(sources, _windows([2, 2]))]
    mixture = MixtureData(sources=sources, parts=parts, windows_per_epoch=[2, 2], interleave=Interleave([3, 1]),
                          tokenizer=None, seq_len=4, seed=0, global_batch_size=2, micro_batch_size=1)
    loss, by_source = mixture.validation_losses(lambda part: float(part.val_windows[0, 0]))
    assert by_source == {"a": 1.0, "b": 1001.0}
    assert loss == 0.75 * 1.0 + 0.25 * 1001.0


def test_a_one_source_mixture_is_the_plain_source():
    tokenizer = load_tokenizer("builtin")
    plain = prepare_run_data(DataSpec(val_fraction=0.1), tokenizer, 31, 3, 8, 2, evaluate=False)
    mixed = prepare_run_data(DataSpec(val_fraction=0.1, mix=[{"weight": 2.5}]), tokenizer, 31, 3, 8, 2,
                             evaluate=False)
    for rank in range(2):
        a, b = plain.train_batches(rank, 2, start_sample=16), mixed.train_batches(rank, 2, start_sample=16)
        for _ in range(10):
            (xa, ya), (xb, yb) = next(a), next(b)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert mixed.samples_by_source(48) == {"builtin": 48}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A small streamed source (it repeats within a few steps): 48 short documents in 4 parquet shards."""
    root = tmp_path_factory.mktemp("shards")
    texts = [text[:120] for text in builtin_corpus().select(range(48))["text"]]
    for f in range(4):
        datasets.Dataset.from_dict({"text": texts[f * 12:(f + 1) * 12]}).to_parquet(str(root / f"part{f}.parquet"))
    return str(root / "part*.parquet")


def _mixture_steps(data, dp, steps, start=0, data_state=None):
    """[[step k's windows in global-batch order]] over all dp ranks, and the merged stream positions."""
    per_step, states = windows_per_step(data, dp, steps, start, data_state)
    return per_step, merge_mixture_states(states)


def test_streamed_sources_keep_the_order_at_every_dp_and_resume_exactly(shards):
    tokenizer = load_tokenizer("builtin")
    streamed = {"name": shards, "streaming": True, "streams": 4, "shuffle_buffer": 8}
    # One streamed source alone is the plain streamed source.
    plain = prepare_run_data(DataSpec(**streamed), tokenizer, 15, 2, 16, 2, evaluate=False)
    alone = prepare_run_data(DataSpec(mix=[streamed]), tokenizer, 15, 2, 16, 2, evaluate=False)
    for rank in range(2):
        a, b = plain.train_batches(rank, 2), alone.train_batches(rank, 2)
        for _ in range(12):
            assert all(torch.equal(u, v) for u, v in zip(next(a), next(b)))
    # A streamed source beside a cached one: the same steps at dp 1, 2, 4; a resume from the
    # gathered positions (at another dp) continues them exactly.
    spec = DataSpec(mix=[dict(streamed, label="streamed", weight=0.35), {"label": "cached", "weight": 0.65}])
    data = prepare_run_data(spec, tokenizer, 15, 2, 16, 2, evaluate=False)
    reference, end = _mixture_steps(data, 1, 40)
    assert sorted(end["sources"]) == ["0"] and sorted(end["sources"]["0"]) == ["0", "1", "2", "3"]
    assert min(s["block"][0] for s in end["sources"]["0"].values()) >= 1  # the streamed source repeated
    for dp in (2, 4):
        assert _mixture_steps(data, dp, 40)[0] == reference, dp
    for stop, dp_before, dp_after in ((9, 2, 4), (23, 4, 1)):
        _, state = _mixture_steps(data, dp_before, stop)
        assert state["step"] == stop
        data.check_data_state(state, stop * 16)
        assert _mixture_steps(data, dp_after, 40 - stop, stop, state)[0] == reference[stop:], (stop, dp_before)
    # Without positions (an older checkpoint) the run re-reads up to its step: the same batches.
    assert _mixture_steps(data, 2, 5, 30)[0] == reference[30:35]
    row_based = {"step": 30, "sources": {"0": {}}}  # positions saved before units (no "format"): re-read too
    assert _mixture_steps(data, 2, 5, 30, row_based)[0] == reference[30:35]
    # Positions that do not fit the run are one line each, before training.
    for run, saved, words in ((data, state, "not after its"), (plain, state, "mixture"),
                              (data, {"format": "units", "streams_total": 4, "step": 23, "streams": {}}, "one streamed source")):
        with pytest.raises(DataError) as e:
            run.check_data_state(saved, 24 * 16)
        assert words in str(e.value), str(e.value)


def test_closing_a_runs_batches_ends_its_read_ahead_in_every_data_mode(shards):
    """RunData.close_batches, what the training loop calls at the end and on a failure: the one
    read-ahead thread of streamed data (one source, or a mixture with a streamed source) has
    ended when it returns; cached data starts none."""
    tokenizer = load_tokenizer("builtin")
    streamed = {"name": shards, "streaming": True, "streams": 4, "shuffle_buffer": 8}
    mixed = [dict(streamed, label="s"), {"label": "c"}]
    for spec, threads in ((DataSpec(**streamed), 1), (DataSpec(mix=mixed), 1),
                          (DataSpec(), 0), (DataSpec(mix=[{"label": "a"}, {"label": "b"}]), 0)):
        data = prepare_run_data(spec, tokenizer, 15, 2, 16, 2, evaluate=False)
        batches = data.train_batches(0, 2)
        before = set(threading.enumerate())
        next(batches)
        started = set(threading.enumerate()) - before
        assert len([t for t in started if t.name.startswith("read-ahead")]) == threads, (spec, started)
        data.close_batches(batches)  # the read-ahead thread, and the threads still opening its streams
        assert not [t for t in set(threading.enumerate()) - before if t.is_alive()], spec
        data.close_batches(batches)  # again: nothing left to do


@pytest.mark.parametrize("mix,words", [
    ("[{weight: -1}]", ["data.mix[0].weight=-1", "negative"]),
    ("[{weight: 0, label: a}, {weight: 0.0, label: b}]", ["every weight is 0"]),
    ("[{nmae: builtin}]", ["data.mix[0]", "unknown field 'nmae'", "text_field"]),
    ("[{weight: 1}, {weight: 2}]", ["share the label 'builtin'"]),
    ("[{tokenizer: gpt2}]", ["one tokenizer", "data.tokenizer"]),
    ("[{label: a}, {name: BODY, label: b}]", ["source 'b'", "text_field='text'", "columns: body"]),
    ("[{label: a}, {name: SHORT, label: b, val_fraction: 0.0}]", ["source 'b'", "not one complete window"]),
])
def test_bad_mixtures_are_one_line_and_exit_2(mix, words, tmp_path, monkeypatch, capsys):
    """launch/train.py's main in this process, before any process group (as tests/data/test_streaming.py)."""
    from launch.train import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("data.windows.default_cache_dir", lambda: tmp_path / "cache")
    (tmp_path / "body.jsonl").write_text('{"body": "text"}\n')
    (tmp_path / "short.jsonl").write_text('{"text": "too short"}\n')
    mix = mix.replace("BODY", str(tmp_path / "body.jsonl")).replace("SHORT", str(tmp_path / "short.jsonl"))
    assert main(["--recipe", str(TINY), "--set", f"data.mix={mix}", "--set", "train.eval_every=0"]) == 2
    err = capsys.readouterr().err  # in this process datasets' progress bars land here too
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(w in last for w in words) and "Traceback" not in err, err


def test_prepare_data_builds_every_source_in_one_call(tmp_path, monkeypatch, capsys):
    from launch.prepare_data import main
    monkeypatch.setattr("data.windows.default_cache_dir", lambda: tmp_path / "cache")
    assert main(["--recipe", str(MIX_DEMO), "--set", "model.seq_len=32"]) == 0
    first = capsys.readouterr().out
    assert "python: built" in first and "docs: built" in first, first
    entries = sorted(path.name for path in (tmp_path / "cache" / "data").iterdir())
    assert len(entries) == 4  # two caches and their locks
    assert main(["--recipe", str(MIX_DEMO), "--set", "model.seq_len=32"]) == 0  # the second call reuses them
    again = capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "cache" / "data").iterdir()) == entries
    directories = re.compile(r"(?:built|reused) (\S+):")
    assert directories.findall(again) == directories.findall(first) and len(directories.findall(first)) == 2


@pytest.mark.slow  # two training runs through launch/train.py
def test_mix_demo_trains_with_metrics_per_source_and_the_same_losses_at_dp2(tmp_path):
    """recipes/mix-demo.yaml's data through launch/train.py, on a small model: samples_by_source
    follows the weights (0.8, 0.2) within one sample after every step; val_loss_by_source has both
    sources and val_loss is their weighted mean; dp=2 gives the losses of one process."""
    small = ["--recipe", str(MIX_DEMO), "--steps", "3", "--set", "model.n_layer=2", "--set", "model.n_embd=64",
             "--set", "model.seq_len=32", "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=2",
             "--set", "train.eval_every=2", "--set", "train.eval_batches=1"]
    runs = {}
    for procs in (1, 2):
        out = tmp_path / f"dp{procs}.jsonl"
        proc = launch_forked(procs, small + ["--metrics-out", str(out)])
        assert proc.returncode == 0, (procs, proc.stdout[-3000:], proc.stderr[-3000:])
        runs[procs] = read_metrics(out)
    one, two = runs[1], runs[2]
    assert "data.mix: 2 sources over 3 steps" in proc.stdout and "docs: weight 0.2" in proc.stdout
    for record in one:
        samples, counts = record["samples"], record["samples_by_source"]
        assert sum(counts.values()) == samples
        assert abs(counts["python"] - 0.8 * samples) <= 1 and abs(counts["docs"] - 0.2 * samples) <= 1, record
    for step in (2, 3):
        by_source = one[step - 1]["val_loss_by_source"]
        assert sorted(by_source) == ["docs", "python"]
        assert abs(one[step - 1]["val_loss"] - (0.8 * by_source["python"] + 0.2 * by_source["docs"])) < 1e-9
    for a, b in zip(one, two):
        assert a["samples_by_source"] == b["samples_by_source"]
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a or key in b:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
        for label, loss in a.get("val_loss_by_source", {}).items():
            assert abs(loss - b["val_loss_by_source"][label]) <= 1e-5 * abs(loss)
