"""A damaged GGUF file: seeded truncations and bit flips in its header, metadata and tensor table each end in one
line and exit 2, or in a correct export; never a traceback or a hang, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerdrop.cli import main

SEEDS = 48


def write_tiny_llama_gguf(path: Path, *, token_scores: bool = True) -> None:
    """A two-layer llama of width 32 with a byte-level BPE tokenizer, as llama.cpp's converter lays it out."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn, layers = 32, 4, 2, 64, 2
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    if token_scores:
        writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", hidden // heads * kv_heads, hidden)
        weight(f"blk.{i}.attn_v.weight", hidden // heads * kv_heads, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    weight("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _regions(path: Path) -> dict[str, tuple[int, int]]:
    """Byte ranges of the header, the metadata and the tensor table (the gguf package's reader finds them)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    table = min(tensor.field.offset for tensor in reader.tensors)
    return {"header": (0, 24), "metadata": (24, table), "tensor table": (table, reader.data_offset)}


def _damage(raw: bytes, regions: dict[str, tuple[int, int]], seed: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    region = list(regions)[seed % len(regions)]
    low, high = regions[region]
    if rng.random() < 0.3:
        return raw[:int(rng.integers(low, high))], f"truncated in the {region}"
    data = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        data[int(rng.integers(low, high))] ^= 1 << int(rng.integers(8))
    return bytes(data), f"bits flipped in the {region}"


# Runs every case in one child process, so that a hang fails the test at its timeout instead of stalling the suite.
_RUN_CASES = """
import contextlib, io, json, sys, time
from pathlib import Path
from layerdrop.cli import main
for case in sys.argv[1:]:
    err = io.StringIO()
    start = time.time()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["export", case, "-o", case[:-len(".gguf")] + "-out"])
    print(json.dumps({"case": case, "code": code, "err": err.getvalue(), "seconds": time.time() - start}),
          flush=True)
"""


@pytest.mark.slow  # four of the cases export for real: minutes on 2 cores
def test_a_damaged_gguf_ends_in_one_line_and_exit_2_or_a_correct_export(tmp_path):
    original = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(original)
    raw = original.read_bytes()
    regions = _regions(original)
    cases, damage = [], {}
    for seed in range(SEEDS):
        data, what = _damage(raw, regions, seed)
        folder = tmp_path / f"case{seed}"
        folder.mkdir()
        case = folder / "model.gguf"
        case.write_bytes(data)
        cases.append(str(case))
        damage[str(case)] = what
    done = subprocess.run([sys.executable, "-c", _RUN_CASES, *cases], capture_output=True, text=True, timeout=1500)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == SEEDS, done.stderr[-2000:]
    exports = 0
    for result in results:
        case = Path(result["case"])
        out = case.parent / "model-out"
        lines = [line for line in result["err"].splitlines() if line.startswith("layerdrop: error")]
        assert "Traceback" not in result["err"], (damage[result["case"]], result["err"])
        if result["code"] == 0:
            exports += 1
            assert (out / "model.onnx").is_file() and (out / "tokenizer.json").is_file()
            assert sorted(p.name for p in case.parent.iterdir()) == ["model-out", "model.gguf"]
        else:
            assert result["code"] == 2 and len(lines) == 1, (damage[result["case"]], result["err"])
            assert [p.name for p in case.parent.iterdir()] == ["model.gguf"], damage[result["case"]]
    assert exports < SEEDS // 2, "the damage must reach the reader, not only bytes it ignores"



def test_a_gguf_whose_tokenizer_cannot_be_built_is_refused_before_tracing(tmp_path, capsys):
    """The model loads but transformers cannot build its tokenizer (no token scores): one line, exit 2, nothing
    written, and no time spent tracing first."""
    path = tmp_path / "model.gguf"
    write_tiny_llama_gguf(path, token_scores=False)
    assert main(["export", str(path), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("layerdrop: error") == 1 and "tracing" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
