"""Eval equals PyTorch perplexity; bench reports every field from real runs; check; pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from layerdrop import api
from layerdrop.cli import main
from layerdrop.export.builder import builder_available
from tests.torch_reference import tiny_model


def _torch_perplexity(model, windows: np.ndarray) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for row in windows:
            ids = torch.tensor(row[None])
            logits = model(ids, use_cache=False).logits.double()
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
    return float(np.exp(total / count))


def _torch_fidelity(base, other, windows: np.ndarray) -> tuple[float, float]:
    """Mean KL(base || other) over every position of the windows, from PyTorch's logits in float64, and the share
    of positions whose arg-max agrees."""
    from scipy.special import log_softmax

    from tests.torch_reference import logits

    first, second = logits(base, windows).astype(np.float64), logits(other, windows).astype(np.float64)
    p, q = log_softmax(first, axis=-1), log_softmax(second, axis=-1)
    return float((np.exp(p) * (p - q)).sum(-1).mean()), float(np.mean(first.argmax(-1) == second.argmax(-1)))


def test_eval_vs_reports_the_fidelity_pytorch_computes_on_the_held_out_windows(exported, tmp_path, capsys):
    from tests.torch_reference import replaced

    base, pruned = exported("llama", True), tmp_path / "pruned"
    api.drop(base, pruned, targets=[("attn", 1)])
    capsys.readouterr()
    assert main(["eval", str(base), "--vs", str(pruned), "--samples", "3", "--seq-len", "32", "--no-progress",
                 "--json", str(tmp_path / "eval.json")]) == 0
    assert "KL(base || other)" in capsys.readouterr().out
    found = json.loads((tmp_path / "eval.json").read_text())["fidelity"]
    windows = api.windows_for(base, None, role="eval", samples=3, seq_len=32)
    assert found["text"]["starts"] == windows.source["starts"] and found["tokens"] == 3 * 32
    kl, top1 = _torch_fidelity(tiny_model("llama"), replaced(tiny_model("llama"), [("attn", 1)]), windows.ids)
    assert found["kl"] == pytest.approx(kl, rel=1e-3) and kl > 0
    assert found["top1_agreement"] == pytest.approx(top1)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_eval_perplexity_equals_torch(exported, family):
    folder = exported(family, True)
    result = api.evaluate(folder, samples=3, seq_len=48, progress=False)
    windows = api.windows_for(folder, None, role="eval", samples=3, seq_len=48).ids
    assert result["tokens"] == 3 * 47
    assert result["perplexity"] == pytest.approx(_torch_perplexity(tiny_model(family), windows), rel=1e-4)


def test_eval_side_by_side_with_generations(exported, tmp_path, capsys):
    base = exported("llama", True)
    api.drop(base, tmp_path / "p", targets=[("attn", 1)])
    code = main(["eval", str(base), "--vs", str(tmp_path / "p"), "--samples", "2", "--seq-len", "32",
                 "--prompt", "Anne was", "--max-new-tokens", "5", "--json", str(tmp_path / "e.json"), "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "e.json").read_text())
    assert len(report["models"]) == 2 and len(report["generations"]) == 2
    assert "ratio" in capsys.readouterr().out


def test_bench_reports_every_field_from_real_runs(exported, tmp_path):
    base = exported("llama", True)
    api.drop(base, tmp_path / "p", targets=[("attn", 1), ("attn", 2)])
    assert main(["bench", str(base), str(tmp_path / "p"), "--seq", "16,32", "--runs", "2", "--decode", "4",
                 "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert [e["seq"] for e in result["prefill"]] == [16, 32]
    for entry in result["prefill"]:
        assert len(entry["base"]["runs"]) == 2 and len(entry["pruned"]["runs"]) == 2
        assert entry["speedup"] == pytest.approx(entry["base"]["median_ms"] / entry["pruned"]["median_ms"])
        assert entry["ideal"] > 1.0 and 0 < entry["removed_share"] < 1
    assert result["kv_bytes_per_token"]["pruned"] * 4 == result["kv_bytes_per_token"]["base"] * 2
    assert all(v > 0 for v in result["decode_tokens_per_s"].values())
    assert result["model_bytes"]["pruned"] < result["model_bytes"]["base"]
    assert all(v > 0 for v in result["peak_memory_bytes"].values())
    assert result["provider"] == "cpu"
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_check_exit_codes(exported, tmp_path, capsys):
    folder = str(exported("llama", True))
    kv = api.inspect(folder)["kv_bytes_per_token"]
    assert main(["check", folder, "--max-kv-bytes-per-token", str(kv), "--max-bytes", "1GiB"]) == 0
    assert main(["check", folder, "--max-kv-bytes-per-token", str(kv - 1)]) == 1
    assert "over budget: kv_bytes_per_token" in capsys.readouterr().err
    assert main(["check", folder, "--max-attention-layers", "3", "--json", str(tmp_path / "c.json")]) == 1
    assert json.loads((tmp_path / "c.json").read_text())["within_budget"] is False
    assert main(["check", folder, "--max-bytes", "12 parsecs"]) == 2
    assert main(["check", str(tmp_path / "missing"), "--max-bytes", "1MB"]) == 2
    assert main(["check", folder]) == 2


def test_pipeline_end_to_end_on_a_tiny_model_and_resume(hf_folder, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["pipeline", str(hf_folder("qwen2")), "-o", str(out), "--samples", "4", "--seq-len", "32",
            "--eval-samples", "2", "--seq", "16", "--runs", "1", "--no-progress"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "| perplexity |" in table and "attn-1" in table and "KV cache bytes/token" in table
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "attn-1"
    assert {p.name for p in out.iterdir()} >= {"export", "scored", "pruned", "report.json", "report.md"}
    assert main(args) == 2, "a non-empty OUTDIR needs --resume or --force"
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("up to date, skipped") == 3 + 1 + builder_available()  # export score drop, base, builder
    assert "the bench has no builder column" in err or not builder_available()  # head size 8: GQA refuses it
    notes = json.loads((out / "report.json").read_text())["notes"]  # the API returns the note the CLI printed
    assert [n for n in notes if "the bench has no builder column" in n] == ([notes[0]] if builder_available() else [])
    report = json.loads((out / "report.json").read_text())
    from tests.torch_reference import replaced

    windows = api.windows_for(out / "bench-base", None, role="eval", samples=2, seq_len=32)
    assert report["fidelity"]["text"]["starts"] == windows.source["starts"]
    removed = [("attn", layer) for layer in report["removed_by_kind"]["attn"]]
    kl, top1 = _torch_fidelity(tiny_model("qwen2"), replaced(tiny_model("qwen2"), removed), windows.ids)
    assert report["fidelity"]["kl"] == pytest.approx(kl, rel=1e-3) and report["fidelity"]["top1_agreement"] == top1
    assert "KL(base ‖ attn-1)" in (out / "report.md").read_text()


def test_pipeline_writes_its_output_fused_and_benches_it_against_the_fused_base(hf_folder, tmp_path, rng):
    """The default output is fused (ORT's fused norms, fewer nodes) and equals PyTorch with the dropped layer
    removed; the bench's base is the export fused the same way; `--no-fuse` writes and benches the plain graphs."""
    from tests.helpers import ort_logits
    from tests.torch_reference import VOCAB, logits, replaced

    out, plain = tmp_path / "fused", tmp_path / "plain"
    args = [str(hf_folder("llama")), "--samples", "4", "--seq-len", "32", "--eval-samples", "2", "--seq", "16",
            "--runs", "1", "--no-progress", "--no-builder"]
    assert main(["pipeline", *args, "-o", str(out)]) == 0
    assert main(["pipeline", *args, "-o", str(plain), "--no-fuse"]) == 0
    fused_report = json.loads((out / "report.json").read_text())
    plain_report = json.loads((plain / "report.json").read_text())
    assert fused_report["bench_base"] == str(out / "bench-base") and plain_report["bench_base"] == str(plain / "export")
    assert fused_report["reference"] is None and not (out / "builder").exists()
    ops = {name: [n.op_type for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node]
           for name, folder in (("base", out / "bench-base"), ("pruned", out / "pruned"), ("plain", plain / "pruned"))}
    for name in ("base", "pruned"):
        assert "SkipSimplifiedLayerNormalization" in ops[name], name
    assert "SkipSimplifiedLayerNormalization" not in ops["plain"] and len(ops["pruned"]) < len(ops["plain"])
    dropped = [(e["kind"], e["layer"]) for e in api.inspect(out / "pruned")["removed"]]
    assert dropped == [(e["kind"], e["layer"]) for e in api.inspect(plain / "pruned")["removed"]] and dropped
    ids = rng.randint(0, VOCAB, size=(1, 12))
    expected = logits(replaced(tiny_model("llama"), dropped), ids)
    for folder in (out / "pruned", plain / "pruned"):
        np.testing.assert_allclose(ort_logits(folder, ids), expected, atol=1e-4)
    np.testing.assert_allclose(ort_logits(out / "bench-base", ids), logits(tiny_model("llama"), ids), atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_prompt_prefilled_in_chunks_through_the_cache_decodes_like_torch(exported, family, rng):
    """Chunks of 5 tokens (shorter than Gemma-3's sliding window of 6, and crossing it) give PyTorch's tokens."""
    from layerdrop.runtime.generate import greedy_batch
    from tests.helpers import session
    from tests.torch_reference import VOCAB, greedy

    prompt = rng.randint(0, VOCAB, size=(1, 23))
    tokens, _ = greedy_batch(session(exported(family, True)), prompt, np.ones_like(prompt), 6, prefill_chunk=5)
    assert tokens[0] == greedy(tiny_model(family), prompt, 6)[0]


def test_generation_memory_shows_the_kv_cache_that_a_drop_removes(exported, tmp_path, capsys):
    """Generating with a large cache, the pruned model's peak memory is lower by about the KV bytes it no longer
    holds (its cache, and the step's copy of it), where a single prefill shows no difference."""
    base = exported("llama", True)
    api.drop(base, tmp_path / "p", targets=[("attn", 1), ("attn", 2)])
    batch, context, new = 128, 500, 4
    assert main(["bench", str(base), str(tmp_path / "p"), "--seq", "16", "--runs", "1", "--decode", "2",
                 "--generation-memory", f"{batch},{context},{new}", "--json", str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    memory = result["generation_memory"]
    assert (memory["batch"], memory["context"], memory["new_tokens"]) == (batch, context, new)
    saved = (result["kv_bytes_per_token"]["base"] - result["kv_bytes_per_token"]["pruned"]) * batch * (context + new)
    assert saved > 0 and memory["base"] - memory["pruned"] > 0.5 * saved
    assert "peak memory, generating 4 tokens after 500 x 128 (MiB)" in capsys.readouterr().out


def test_generation_memory_is_refused_beyond_the_context(exported, tmp_path, capsys):
    base = exported("llama", True)
    code = main(["bench", str(base), str(base), "--generation-memory", "1,100000,4"])
    assert code == 2 and "the model's context is" in capsys.readouterr().err
    code = main(["bench", str(base), str(base), "--generation-memory", "8,2048"])
    assert code == 2 and "give BATCH,CONTEXT,NEW_TOKENS" in capsys.readouterr().err


def test_a_child_measures_its_own_peak_memory_not_its_parents(exported):
    """The memory of a small model measured from a parent that holds 1.5 GB is the child's, not the parent's."""
    from layerdrop.runtime.bench import peak_memory

    ballast = np.ones(1_500_000_000 // 8)  # resident in this process
    measured = peak_memory(exported("llama", True), 16)
    assert measured < 1_000_000_000 and ballast.sum() > 0


def test_the_ideal_of_fused_graphs_counts_the_removed_branches_found_by_structure(exported, tmp_path, monkeypatch):
    """Fused nodes are renamed on every rewrite, so the ideal of a fused pair comes from the branches the pruned
    model's record names, found in the base by structure. With every node costing the same, the share it counts is
    the nodes the drop removed but for at most one per branch (its residual Add, or the skip-norm it was fused
    into), fused or not; and `bench` on the fused pair reports that ideal."""
    import onnx

    import layerdrop.search.measure as measure
    from layerdrop.search.measure import module_ideal

    def nodes(folder):
        return [n.name for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node]

    base = exported("llama", True)
    targets = [("attn", 1), ("mlp", 2)]
    api.fuse(base, tmp_path / "base-fused")
    api.drop(base, tmp_path / "fused", targets=targets, fuse=True)
    api.drop(base, tmp_path / "plain", targets=targets)
    monkeypatch.setattr(measure, "node_times", lambda folder, seq, **_: dict.fromkeys(nodes(Path(folder)), 1.0))
    for folder, pruned in ((tmp_path / "base-fused", tmp_path / "fused"), (base, tmp_path / "plain")):
        counted = module_ideal(folder, set(targets), 16)["removed_share"] * len(nodes(folder))
        removed = len(nodes(folder)) - len(nodes(pruned))
        assert removed - len(targets) <= round(counted) <= removed and counted > 10 * len(targets)
    monkeypatch.undo()
    result = api.bench(tmp_path / "base-fused", tmp_path / "fused", seqs=(16,), runs=1, decode_tokens=2)
    entry = result["prefill"][0]
    assert entry["ideal_from"] == "regions" and entry["ideal"] > 1 and 0 < entry["removed_share"] < 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_windows_the_model_samples_through_the_cache_equal_torch_with_the_same_draws(exported, family):
    """Sampled windows (two batches, a BOS first, longer than Gemma-3's sliding window of 6) are the tokens that
    PyTorch's softmax, recomputed over the whole sequence each step, gives for the same uniform draws."""
    from layerdrop.runtime.generate import sample_windows
    from tests.helpers import session
    from tests.torch_reference import VOCAB, sampled

    first = np.arange(3, VOCAB)
    windows = sample_windows(session(exported(family, True)), 3, 14, first, bos_id=1, seed=7, batch_size=2)
    assert windows.shape == (3, 14) and (windows[:, 0] == 1).all() and (windows[:, 1] >= 3).all()
    np.testing.assert_array_equal(windows, sampled(tiny_model(family), 3, 14, first, seed=7, bos_id=1, batch_size=2))
    assert len({tuple(row) for row in windows}) == 3  # sampled, not one greedy continuation


def test_sampling_windows_needs_a_kv_cache(exported):
    from layerdrop.errors import LayerdropError
    from layerdrop.runtime.generate import sample_windows
    from tests.helpers import session

    with pytest.raises(LayerdropError, match="needs a graph with a KV cache"):
        sample_windows(session(exported("llama", False)), 2, 8, np.arange(10))
