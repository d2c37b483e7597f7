"""Layout parity for the Llama family: recipes/llama-tiny.yaml (grouped-query attention with
n_kv_head=2, so at tp=4 two ranks share each key/value head; RoPE, RMSNorm, SwiGLU, an untied
head as its own pipeline layer) gives the same losses, gradient norms and validation losses,
fp32, relative difference <= 1e-5, at the layouts of GPT-2's parity test but (1,1,2) and (4,4,1), with
and without sequence parallelism (docs/design.md, the acceptance test); and the checkpoint the (4,1,1)
sequence-parallel run saves after step 3 resumes bit for bit there and re-shards to (2,2,2). The
runs are the session's parity runs (conftest.py: parity_runs, tag "llama").

The default path, without the document mask, runs at (2,2,2) inside the mixture-of-experts parity
runs (tests/e2e/test_moe_parity.py: the same attention, norms and untied head, and the Llama MLP as the
shared expert); tp=4 > 2 key/value heads without SP is tests/model/test_llama.py's, in process, and with SP
the masked (4,1,1) here. Its own (1,1,1) shows that the mask changes the losses. Every other run trains with the document mask (`data.document_mask`,
tag "docmask"), so they also show layout parity with the mask on: the segment ids crossing stages with the hidden
states, with DeepSpeed's partitioned sends (tp=2 pp=2 without SP) and without them (SP), under
full recompute (DeepSpeed's checkpointing of blocks) at (2,2,2) and selective recompute at
(2,2,2) with SP. Recomputation changes memory, not losses (tests/runtime/test_recompute.py). The
unmasked Llama model is also checked against transformers and the dense model in tests/model/test_llama.py;
the per-token losses of the masked (2,2,2) SP run in tests/model/test_document_mask.py."""
import pytest

from helpers.parity_runs import LAYOUTS as GPT2_LAYOUTS, SAVE_AT, SP_LAYOUTS as GPT2_SP_LAYOUTS
from helpers.launcher import LLAMA_TINY, launch_forked, read_metrics

RTOL = 1e-5
REFERENCE = (1, 1, 1, "llama", "docmask")
RECOMPUTE = {(2, 2, 2): "full", (2, 2, 2, "sp"): "selective"}
# (1,1,2) runs unmasked only in GPT-2's test: data parallelism touches neither the architecture nor the mask;
# (4,4,1) only there too: four stages are GPT-2's test, tp = 4 over 2 key/value heads is (4,1,1)'s.
LAYOUTS = [layout[:3] + ("llama",) + layout[3:] + ("docmask",) + ((RECOMPUTE[layout],) if layout in RECOMPUTE else ())
           for layout in GPT2_LAYOUTS + GPT2_SP_LAYOUTS if layout not in ((1, 1, 2), (4, 4, 1))]
# Context parallelism with the mask: documents crossing the CP shards' boundaries, and
# (tp, cp, pp, dp) = (2,2,1,1) with SP, where tp x cp = 4 ranks share the 2 key/value heads.
CP_LAYOUTS = [(1, 1, 1, "llama", "cp2", "docmask"), (2, 1, 1, "llama", "sp", "cp2", "docmask")]
LAYOUTS += CP_LAYOUTS
# The default path, no document mask: TP with pipeline stages and data parallelism, and tp=4 > 2 key/value heads.
NO_MASK_REFERENCE = (1, 1, 1, "llama")


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * abs(want)


@pytest.mark.slow
def test_llama_tiny_reference_learns_with_clipping(parity_runs):
    ref = parity_runs[REFERENCE]["metrics"]
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1 and sum(m["grad_norm"] > 0.5 for m in ref) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=["-".join(map(str, layout)) for layout in LAYOUTS])
def test_llama_tiny_layout_matches_single_process(parity_runs, layout):
    ref, got = parity_runs[REFERENCE]["metrics"], parity_runs[layout]["metrics"]
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in r:
                assert _close(g[key], r[key]), (layout, r["step"], key, g[key], r[key])


@pytest.mark.slow
def test_llama_tiny_without_the_mask_trains_another_model(parity_runs):
    """The unmasked reference is its own run: the mask changes the losses (here from step 4 and
    every validation, the first batches holding no document boundary inside a sequence)."""
    masked, unmasked = parity_runs[REFERENCE]["metrics"], parity_runs[NO_MASK_REFERENCE]["metrics"]
    assert [(m["loss"], m.get("val_loss")) for m in masked] != [(m["loss"], m.get("val_loss")) for m in unmasked]
    assert unmasked[-1]["loss"] < unmasked[0]["loss"] - 0.1


@pytest.mark.slow
def test_llama_tiny_resumes_bitwise_and_reshards(parity_runs, tmp_path):
    """Saved at tp=4 (two ranks per key/value head) after step 3 of 5: resumed at tp=4 it repeats
    steps 4-5 bit for bit; re-sharded to (2,2,2) it matches them within 1e-5 (docs/design.md contract 13)."""
    saved = parity_runs[(4, 1, 1, "llama", "sp", "docmask")]
    full = saved["metrics"]
    checkpoint = saved["dir"] / "ck" / f"step{SAVE_AT:08d}"

    def resume(n, args, name):
        out = tmp_path / f"{name}.jsonl"
        result = launch_forked(n, ["--recipe", str(LLAMA_TINY), "--steps", str(len(full)), "--load", str(checkpoint),
                                   "--set", "model.sequence_parallel=true", "--set", "data.document_mask=true",
                                   "--metrics-out", str(out)] + args)
        assert result.returncode == 0, result.stderr[-3000:]
        return read_metrics(out)

    same = resume(4, ["--tp", "4"], "same")
    assert [(m["loss"], m["grad_norm"]) for m in same] == [(m["loss"], m["grad_norm"]) for m in full[SAVE_AT:]]
    other = resume(8, ["--tp", "2", "--pp", "2"], "other")
    for got, want in zip(other, full[SAVE_AT:]):
        assert got["step"] == want["step"]
        assert _close(got["loss"], want["loss"]) and _close(got["grad_norm"], want["grad_norm"])
