"""Graphs from onnxruntime-genai's model builder in and out.

The builder's graph (GroupQueryAttention with rotary inside, packed qkv, SkipSimplifiedLayerNormalization) goes
through scoring, drops and HARP; the result equals PyTorch with the same modules replaced, and onnxruntime-genai
generates from the rewritten folder exactly what a plain ONNX Runtime session generates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from layerdrop import api
from layerdrop.passes.metadata import kv_layer_map, updated_genai_config
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.generate import greedy_generate
from layerdrop.runtime.session import make_session
from tests.genai_helpers import genai_greedy, run_builder
from tests.helpers import ort_logits
from tests.torch_reference import VOCAB, hook_scores, logits, replaced

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install -e '.[genai]')")

TOL = 1e-4
CASES = {
    "attn": ([("attn", 1), ("attn", 3)], None),
    "mlp": ([("mlp", 0), ("mlp", 2)], None),
    "block": ([("block", 2)], None),
    "harp": ([], {3: 0.7, 2: 0.0, 1: 0.4}),
}


@pytest.fixture(scope="module")
def torch_model() -> torch.nn.Module:
    """A tiny Llama whose head size (16) the CPU GroupQueryAttention kernel accepts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


@pytest.fixture(scope="module")
def built(torch_model, tiny_tokenizer_file, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("genai")
    torch_model.save_pretrained(root / "hf")
    shutil.copy(tiny_tokenizer_file, root / "hf" / "tokenizer.json")
    return run_builder(root / "hf", root / "built")


def test_builder_graph_is_the_fused_form(built):
    ops = [n.op_type for n in onnx.load(str(built / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 4 and ops.count("SkipSimplifiedLayerNormalization") == 8
    assert "Softmax" not in ops and not any(op == "Add" for op in ops)  # every residual is hidden in a skip-norm


def test_regions_come_from_structure_not_names(built, tmp_path):
    regions = api.inspect(built)["regions"]
    assert sorted((r["kind"], r["layer"]) for r in regions) == sorted(
        (kind, layer) for kind in ("attn", "mlp") for layer in range(4))
    anonymous = tmp_path / "anonymous"
    shutil.copytree(built, anonymous)
    proto = onnx.load(str(anonymous / "model.onnx"), load_external_data=False)
    for index, node in enumerate(proto.graph.node):
        node.name = f"n{(index * 7919) % 1000}"
    onnx.save(proto, str(anonymous / "model.onnx"))
    assert api.inspect(anonymous)["regions"] == regions


def test_scores_on_builder_graph_equal_torch_hooks(built, torch_model, tmp_path):
    result = api.score(built, tmp_path / "scored", samples=3, seq_len=24, progress=False)
    windows = api.windows_for(built, None, role="calib", samples=3, seq_len=24).ids
    reference = hook_scores(torch_model.double(), windows)
    torch_model.float()
    for row in result["regions"]:
        assert row["score"] == pytest.approx(reference[(row["kind"], row["layer"])], abs=1e-5), row


@pytest.mark.parametrize("case", sorted(CASES))
def test_rewrite_of_builder_graph_matches_torch_and_runs_in_genai(built, torch_model, case, tmp_path, rng):
    targets, alphas = CASES[case]
    out = tmp_path / case
    if alphas is None:
        api.drop(built, out, targets=targets)
    else:
        api.harp(built, out, alphas=alphas)
    ids = rng.randint(0, VOCAB, size=(2, 11))
    reference = logits(replaced(torch_model.double(), targets, alphas), ids)
    torch_model.float()
    np.testing.assert_allclose(ort_logits(out, ids), reference, atol=TOL, rtol=0)

    kept = 4 - len({layer for kind, layer in targets if kind in ("attn", "block")}) - len(alphas or {})
    config = json.loads((out / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == kept
    inputs = [i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input]
    assert [n for n in inputs if n.endswith(".key")] == [f"past_key_values.{i}.key" for i in range(kept)]
    original = json.loads((built / "genai_config.json").read_text())
    del config["model"]["decoder"]["num_hidden_layers"], original["model"]["decoder"]["num_hidden_layers"]
    assert config == original  # everything else is kept

    prompt = [int(t) for t in rng.randint(3, VOCAB, size=7)]
    ours, _ = greedy_generate(make_session(out / "model.onnx"), np.array([prompt]), 32)
    theirs = genai_greedy(out, prompt, 32)
    assert theirs == ours[:len(theirs)] and len(ours) == 32
    assert len(theirs) == 32 or theirs[-1] == config["model"]["eos_token_id"]  # genai stops only at the end token


def test_sliding_window_layer_list_is_renumbered(built, tmp_path):
    folder = tmp_path / "windowed"
    shutil.copytree(built, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"] = {"window_size": 64, "layers": [0, 2, 3]}
    (folder / "genai_config.json").write_text(json.dumps(config))
    out = tmp_path / "dropped"
    api.drop(folder, out, targets=[("attn", 0), ("attn", 1)])  # cache layers 2, 3 become 0, 1
    written = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert written["sliding_window"] == {"window_size": 64, "layers": [0, 1]} and written["num_hidden_layers"] == 2
    again = tmp_path / "again"
    api.drop(out, again, targets=[("attn", 2)])  # original layer 2 (now cache 0) goes as well
    written = json.loads((again / "genai_config.json").read_text())["model"]["decoder"]
    assert written["sliding_window"]["layers"] == [0] and written["num_hidden_layers"] == 1


def test_unmodified_builder_folder_runs_through_our_runtime(built, torch_model, rng):
    """The builder leaves the cache head size symbolic; make_session fills it in from genai_config.json."""
    ids = rng.randint(0, VOCAB, size=(1, 9))
    reference = logits(torch_model.double(), ids)
    torch_model.float()
    session = make_session(built / "model.onnx")
    np.testing.assert_allclose(session.run(["logits"], prefill_feed(session, ids))[0], reference, atol=TOL, rtol=0)
    assert api.evaluate(built, samples=2, seq_len=32, progress=False)["perplexity"] > 1


def test_genai_config_without_decoder_is_kept(tmp_path, built):
    folder = tmp_path / "odd"
    shutil.copytree(built, folder)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "llama"}}))
    from layerdrop.model_folder import load

    _, model = load(folder)
    config = {"model": {"type": "llama"}}
    assert updated_genai_config(config, kv_layer_map(model), model) == config


def test_fuse_restores_the_builder_form(built, torch_model, tmp_path, rng):
    out = tmp_path / "fused"
    api.drop(built, out, targets=[("attn", 2)], fuse=True)
    ops = [n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 7 and ops.count("GroupQueryAttention") == 3
    ids = rng.randint(0, VOCAB, size=(2, 11))
    reference = logits(replaced(torch_model.double(), [("attn", 2)]), ids)
    torch_model.float()
    np.testing.assert_allclose(ort_logits(out, ids), reference, atol=TOL, rtol=0)
    prompt = [int(t) for t in rng.randint(3, VOCAB, size=7)]
    ours, _ = greedy_generate(make_session(out / "model.onnx"), np.array([prompt]), 16)
    theirs = genai_greedy(out, prompt, 16)
    assert theirs == ours[:len(theirs)] and len(theirs) > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_layerdrops_own_exports_and_their_rewrites_are_served_by_genai(exported, family, tmp_path, rng):
    """A KV export carries genai_config.json; onnxruntime-genai generates what a plain ORT session generates, on
    the export and on a drop, a HARP bypass with the mean shift, and a fitted layer of it."""
    from layerdrop.api.common import save_model
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.search.fit import fit_attention
    from layerdrop.search.measure import branch_means
    from layerdrop.windows import Windows

    source = exported(family, True)
    folder, model = api.open_model(source)
    windows = Windows(rng.randint(0, VOCAB, size=(3, 16)), {})
    api.drop(source, tmp_path / "drop", targets=[("attn", 1), ("mlp", 2)])
    means = branch_means(model, folder.path, windows, [3])
    run_passes(model, api.rewrite_passes([], {3: 0.5}, "test", means=means,
                                         fits=fit_attention(model, folder.path, windows, [0]).maps))
    save_model(model, tmp_path / "shift-fit", folder, force=False)  # genai_config.json follows the rewrite
    prompt = [int(t) for t in rng.randint(0, VOCAB, size=8)]
    for out, layers in ((source, 4), (tmp_path / "drop", 3), (tmp_path / "shift-fit", 2)):
        config = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
        assert config["num_hidden_layers"] == layers and config["inputs"]["position_ids"] == "position_ids"
        ours, _ = greedy_generate(make_session(out / "model.onnx"), np.array([prompt]), 16)
        assert genai_greedy(out, prompt, 16) == ours


def test_a_float16_export_and_its_drop_are_served_by_genai(hf_folder, tmp_path, rng):
    """`--dtype float16`: onnxruntime-genai generates what a plain ORT session generates from the same fp16 graph,
    before and after a drop; and the fp16 graph's logits are the fp32 PyTorch model's within fp16 rounding."""
    from layerdrop.export.onnx_export import export_folder
    from tests.helpers import ort_logits
    from tests.torch_reference import logits, tiny_model

    source = export_folder(hf_folder("llama"), tmp_path / "fp16", kv_cache=True, dtype="float16")
    api.drop(source, tmp_path / "drop", targets=[("attn", 1)])
    ids = rng.randint(0, VOCAB, size=(1, 12))
    reference = logits(tiny_model("llama"), ids)
    assert np.abs(ort_logits(source, ids).astype(np.float64) - reference).max() < 2e-2 * np.abs(reference).max()
    prompt = [int(t) for t in rng.randint(0, VOCAB, size=8)]
    for out in (source, tmp_path / "drop"):
        ours, _ = greedy_generate(make_session(out / "model.onnx"), np.array([prompt]), 12)
        assert genai_greedy(out, prompt, 12) == ours


def test_pipeline_benches_the_builder_graph_of_the_same_model_as_a_third_column(built, tmp_path, capsys):
    """With onnxruntime-genai installed the pipeline builds the builder's graph of the same Hugging Face folder and
    times it in the same alternating runs as the fused base and the fused output; `bench --reference` does the same
    for any folder."""
    from layerdrop.cli import main

    out = tmp_path / "run"
    assert main(["pipeline", str(built.parent / "hf"), "-o", str(out), "--samples", "4", "--seq-len", "32",
                 "--eval-samples", "2", "--seq", "16,32", "--runs", "2", "--no-progress"]) == 0
    table = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["reference"] == str(out / "builder") and report["bench"]["reference"] == str(out / "builder")
    ops = [n.op_type for n in onnx.load(str(out / "builder" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 4  # the builder's own graph, not a copy of ours
    for entry in report["bench"]["prefill"]:
        times = entry["reference"]["runs"]
        assert len(times) == 2 and entry["vs_reference"] == pytest.approx(
            entry["reference"]["median_ms"] / entry["pruned"]["median_ms"])
    assert report["bench"]["kv_bytes_per_token"]["reference"] == report["bench"]["kv_bytes_per_token"]["base"]
    header = table.splitlines()[0]
    assert "| builder fp32 |" in header and "attn-1 vs builder fp32" in header
    assert main(["bench", str(out / "bench-base"), str(out / "pruned"), "--reference", str(built), "--seq", "16",
                 "--runs", "1", "--decode", "2", "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["decode_tokens_per_s"]["reference"] > 0
    prompt = [int(t) for t in np.random.RandomState(0).randint(0, VOCAB, size=8)]
    ours, _ = greedy_generate(make_session(out / "pruned" / "model.onnx"), np.array([prompt]), 16)
    assert genai_greedy(out / "pruned", prompt, 16) == ours  # the fused output is served too


def test_pipeline_with_quantize_benches_int4_against_int4_and_the_builders_int4(built, tmp_path):
    """`--quantize int4`: the output and the bench's base are both fused and int4 (remove first, then quantize:
    the dropped layer's four projections are gone from the MatMulNBits), and the reference is the builder's own
    `-p int4` graph of the same model."""
    from layerdrop.cli import main

    def ops(folder):
        return [n.op_type for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node]

    out = tmp_path / "run"
    assert main(["pipeline", str(built.parent / "hf"), "-o", str(out), "--samples", "4", "--seq-len", "32",
                 "--eval-samples", "2", "--seq", "16", "--runs", "1", "--no-progress", "--quantize", "int4"]) == 0
    report = json.loads((out / "report.json").read_text())
    base, pruned, reference = ops(out / "bench-base"), ops(out / "pruned"), ops(out / "builder")
    assert "MatMul" not in base and "MatMul" not in pruned and pruned.count("MatMulNBits") == base.count(
        "MatMulNBits") - 4
    assert "SkipSimplifiedLayerNormalization" in base and "SkipSimplifiedLayerNormalization" in pruned
    assert reference.count("MatMulNBits") > 0 and reference.count("GroupQueryAttention") == 4
    assert report["reference_label"] == "builder int4" and report["bench"]["prefill"][0]["ideal"] > 1
    assert report["bench"]["model_bytes"]["pruned"] < report["bench"]["model_bytes"]["base"]


@pytest.fixture(scope="module")
def previous_token_fits(exported, tmp_path_factory):
    """factory(family) -> (folder rewritten with maps that read the previous token in layers 1 and 3, written by
    `save_model` with its genai_config.json; PyTorch's model with the same maps)."""
    from layerdrop.api.common import save_model
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.search.fit import fit_attention
    from layerdrop.windows import Windows
    from tests.torch_reference import tiny_model, with_maps

    made = {}

    def make(family: str):
        if family not in made:
            folder, model = api.open_model(exported(family, True))
            windows = np.random.RandomState(7).randint(0, VOCAB, size=(4, 24))
            fit = fit_attention(model, folder.path, Windows(windows, {}), [1, 3], ridges=(1e-2,), previous=True)
            run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
            out = save_model(model, tmp_path_factory.mktemp(f"previous-{family}") / "model", folder, force=False)
            made[family] = out, with_maps(tiny_model(family), fit.maps)
        return made[family]

    return make


def _prompts(folder: Path, rng) -> list[list[int]]:
    """Three prompts of different lengths without the folder's pad and end tokens."""
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    tokens = [t for t in range(VOCAB) if t not in (config.get("pad_token_id", 0), config.get("eos_token_id"))]
    return [[int(t) for t in rng.choice(tokens, size=size)] for size in (9, 3, 6)]


# not phi3: its tiny config's end token (32000) lies outside its vocabulary, which onnxruntime-genai refuses
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "llama", "mistral", "qwen2", "qwen3"])
def test_genai_carries_the_previous_token_state_as_a_recurrent_state(previous_token_fits, family, rng):
    """onnxruntime-genai finds each fitted layer's state among the graph's inputs (its RecurrentState) next to the
    other layers' KV cache: its greedy tokens are a plain ONNX Runtime session's and PyTorch's with the same maps,
    for one prompt and for a right-padded batch of prompts of different lengths (each row as if alone)."""
    from tests.genai_helpers import genai_greedy_batch
    from tests.torch_reference import greedy

    out, reference = previous_token_fits(family)
    config = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert config["num_hidden_layers"] == 2 and config["inputs"]["past_key_names"] == "past_key_values.%d.key"
    prompts = _prompts(out, rng)
    expected = [greedy(reference, np.array([p]), 10)[0] for p in prompts]
    ours, _ = greedy_generate(make_session(out / "model.onnx"), np.array([prompts[0]]), 10)
    assert ours == expected[0]
    single = genai_greedy(out, prompts[0], 10)
    assert single == expected[0][:len(single)] and single
    if family == "gemma3":  # its 6-token window counts the right padding's holes in the cache, state or no state
        prompts = [prompts[0], prompts[0][::-1]]
        expected = [expected[0], greedy(reference, np.array([prompts[1]]), 10)[0]]
    for row, alone in zip(genai_greedy_batch(out, prompts, 10), expected):
        assert row == alone[:len(row)] and row


@pytest.mark.slow
def test_smollm2_with_previous_token_maps_is_served_by_genai(tmp_path):
    """SmolLM2 with maps that read the previous token in two layers: onnxruntime-genai's greedy tokens, for one prompt
    and for a right-padded batch of prompts of different lengths, are a plain ONNX Runtime session's and PyTorch's
    (float64, the same maps) for each prompt alone."""
    from layerdrop.api.common import save_model
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.search.fit import fit_attention
    from layerdrop.windows import Sampling
    from tests.genai_helpers import genai_greedy_batch
    from tests.real_models import cached_export, float64_model
    from tests.torch_reference import greedy, with_maps

    source = cached_export("smollm2-135m")
    folder, model = api.open_model(source)
    calib = api.windows_for(source, None, role="calib", samples=8, seq_len=256)
    fit = fit_attention(model, folder.path, calib, [20, 26], ridges=(1e-2,), previous=True)
    run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
    out = save_model(model, tmp_path / "fitted", folder, force=False)
    reference = with_maps(float64_model("smollm2-135m"), fit.maps)
    text = api.windows_for(source, None, role="eval", samples=3, seq_len=24, sampling=Sampling(from_start=True)).ids
    prompts = [[int(t) for t in row[:size]] for row, size in zip(text, (20, 7, 13))]
    expected = [greedy(reference, np.array([p]), 12)[0] for p in prompts]
    session = make_session(out / "model.onnx")
    assert [greedy_generate(session, np.array([p]), 12)[0] for p in prompts] == expected
    assert genai_greedy(out, prompts[0], 12) == expected[0]
    assert genai_greedy_batch(out, prompts, 12) == expected


def test_builder_graph_with_previous_token_maps_is_served_by_genai(built, torch_model, tmp_path, rng):
    """The model builder's graph (GroupQueryAttention over a shared past/present buffer) with maps that read the
    previous token: onnxruntime-genai's greedy tokens are PyTorch's with the same maps, and the state inputs sit
    beside the kept layers' renumbered cache."""
    from layerdrop.api.common import save_model
    from layerdrop.passes.cleanup import run_passes
    from layerdrop.search.fit import fit_attention
    from layerdrop.windows import Windows
    from tests.torch_reference import greedy, with_maps

    folder, model = api.open_model(built)
    fit = fit_attention(model, folder.path, Windows(rng.randint(0, VOCAB, size=(6, 32)), {}), [1, 3],
                        ridges=(1e-2,), previous=True)
    run_passes(model, api.rewrite_passes([], {}, "fit", fits=fit.maps))
    out = save_model(model, tmp_path / "fitted", folder, force=False)
    inputs = [i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input]
    assert sorted(n for n in inputs if n.startswith("past_key_values.")) == sorted(
        [f"past_key_values.{i}.{part}" for i in (0, 1) for part in ("key", "value")]
        + [f"past_key_values.{i}.{part}" for i in (1, 3) for part in ("conv_state", "recurrent_state")])
    prompt = [int(t) for t in rng.randint(3, VOCAB, size=7)]
    expected, _ = greedy(with_maps(torch_model, fit.maps), np.array([prompt]), 16)
    theirs = genai_greedy(out, prompt, 16)
    assert theirs == expected[:len(theirs)] and theirs
