"""The memory guard: a heavy command whose estimated peak memory is over the limit (--memory-limit, else
$LAYERDROP_MEMORY_LIMIT, else 16 GB) or whose output the disk cannot hold is refused before it starts, in one line,
exit 2, with nothing written; the option it names as fitting does fit. Estimates read parameters from file headers,
checked here against PyTorch's and numpy's own counts."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from layerdrop import memory
from layerdrop.cli import main
from tests.gguf_files import TENSORS, write_gguf
from tests.torch_reference import VOCAB, tiny_model


def _parameters(family: str) -> int:
    return sum(p.numel() for p in tiny_model(family).parameters())


def _export(capsys, tmp_path, folder, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["export", str(folder), "-o", str(tmp_path / "out"), *extra])
    return code, capsys.readouterr().err


def _refused_with_nothing_written(code: int, err: str, tmp_path) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == []


def test_parameters_of_a_folder_are_what_torch_counts(hf_folder):
    assert memory.parameter_count(hf_folder("qwen2")) == _parameters("qwen2")


def test_a_gguf_header_states_its_metadata_and_parameters_without_reading_tensors(tmp_path):
    header = memory.gguf_header(write_gguf(tmp_path / "m.gguf", "qwen2", "Tiny Qwen"))
    assert header.metadata["general.architecture"] == "qwen2" and header.metadata["general.name"] == "Tiny Qwen"
    assert header.metadata["qwen2.block_count"] == 1
    assert header.parameters == sum(math.prod(shape) for shape in TENSORS.values())


def test_an_export_over_a_stated_memory_limit_is_refused_before_it_starts(hf_folder, capsys, tmp_path):
    estimate = memory.export_peak(_parameters("qwen2"), "float32")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(estimate - 1))
    _refused_with_nothing_written(code, err, tmp_path)


def test_the_memory_limit_can_be_stated_in_the_environment(hf_folder, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, "1KB")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"))
    _refused_with_nothing_written(code, err, tmp_path)


def test_where_float16_fits_the_refused_float32_export_names_it_and_it_passes(hf_folder, capsys, tmp_path):
    parameters = _parameters("qwen2")
    limit = memory.export_peak(parameters, "float16")
    assert limit < memory.export_peak(parameters, "float32")
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(limit))
    _refused_with_nothing_written(code, err, tmp_path)
    assert "--dtype float16" in err
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"), "--memory-limit", str(limit), "--dtype", "float16")
    assert code == 0 and (tmp_path / "out" / "model.onnx").is_file(), err


def test_an_export_the_disk_cannot_hold_is_refused_before_it_starts(hf_folder, capsys, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    needed = 4 * _parameters("qwen2")
    monkeypatch.setattr("layerdrop.memory.shutil.disk_usage", lambda _path: usage._replace(free=needed - 1))
    code, err = _export(capsys, tmp_path, hf_folder("qwen2"))
    _refused_with_nothing_written(code, err, tmp_path)


@pytest.mark.parametrize("text, size", [("16GB", 16 * 1000**3), ("1.5GiB", 1_610_612_736), ("123", 123)])
def test_sizes_read_with_decimal_and_binary_units(text, size):
    assert memory.parse_size(text) == size


def _weight_bytes(folder) -> int:
    """The folder's initializer bytes as numpy counts them, external data loaded."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(folder / "model.onnx"))
    return sum(numpy_helper.to_array(tensor).nbytes for tensor in model.graph.initializer)


def test_the_estimate_of_a_folder_is_session_peak_of_the_bytes_numpy_counts(exported, monkeypatch):
    from layerdrop.api import guard_memory

    folder = exported("llama", True)
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    for copies, tokens, extra in ((1, 0, 0), (2, 16, 1000)):
        activations = copies * int(memory.ACTIVATION_COPIES * tokens * VOCAB * 4)  # float32 logits of each run
        estimate = memory.session_peak(_weight_bytes(folder), copies) + activations + extra
        guard_memory("a run", [folder], estimate, copies=copies, tokens=tokens, extra=extra)  # at the estimate: runs
        with pytest.raises(memory.LayerdropError):
            guard_memory("a run", [folder], estimate - 1, copies=copies, tokens=tokens, extra=extra)


TOKENS = 16  # every run feeds one window of 16 tokens
FAST = ["--samples", "2", "--seq-len", str(TOKENS), "--no-progress"]
# command -> (its arguments after the model, ONNX Runtime sessions on the model at its peak, weight copies at its
# peak, how many times the model is held at once, extra bytes, whether it writes -o)
COMMANDS = {
    "score": (["-o", "{out}", *FAST], 1, 1, 1, 0, True),
    "drop": (["--attn", "1", "--iterative", "-o", "{out}", *FAST], 1, 1, 1, 0, True),
    "harp": (["--top", "1", "--search", "-o", "{out}", *FAST], 1, 1, 1, 0, True),
    # eval --vs: the fidelity holds both models at once where they fit together, else one at a time (below)
    "eval": (["--vs", "{model}", *FAST], 1, 1, 1, 0, False),
    # bench holds both models at once where they fit together, else one at a time (below)
    "bench": (["{model}", "--seq", str(TOKENS), "--runs", "1", "--decode", "2"], 1, 1, 1, 0, False),
    "quantize": (["--block-size", "16", "-o", "{out}"], 0, memory.QUANTIZE_COPIES, 1, 0, True),
    "fuse": (["-o", "{out}"], 0, 0, 1, 0, True),
    "plan": (["--budget", "attn=1", "--moves", "drop", "--accuracy-items", "0", "--speedup-runs", "0",
              "--validation-samples", "0", "--validation-items", "0",
              "--search-samples", "2", "--eval-samples", "2", "--fit-samples", "2", "-o", "{out}", *FAST], 1, 1, 1,
             "prefix", True),  # two sessions at once where they fit, else one at a time (below)
}


def _argv(command: str, model, out) -> list[str]:
    args = COMMANDS[command][0]
    return [command, str(model), *(a.format(out=out, model=model) for a in args)]


def _estimate(command: str, model) -> int:
    """Weights times copies, plus each session's activations: ACTIVATION_COPIES float32 copies of a run's logits."""
    from layerdrop.api.plan.measure import FIDELITY_BYTES, PREFIX_BYTES

    _, sessions, copies, held, extra, _ = COMMANDS[command]
    activations = held * sessions * int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    return (memory.session_peak(held * _weight_bytes(model), copies) + activations
            + (PREFIX_BYTES + FIDELITY_BYTES if extra == "prefix" else 0))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_over_a_stated_memory_limit_is_refused_before_it_writes_anything(exported, command, capsys,
                                                                                   tmp_path):
    model = exported("llama", True)
    capsys.readouterr()
    argv = [*_argv(command, model, tmp_path / "out"), "--json", str(tmp_path / "report.json")]
    code = main([*argv, "--memory-limit", str(_estimate(command, model) - 1)])
    _refused_with_nothing_written(code, capsys.readouterr().err, tmp_path)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_within_the_default_memory_limit_runs(exported, command, capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    model = exported("llama", True)
    capsys.readouterr()
    code = main(_argv(command, model, tmp_path / "out"))
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.onnx").is_file() == COMMANDS[command][5]


class _Sessions:
    """The most ONNX Runtime sessions on (nearly) the whole model alive at once while a command runs: every session
    made (`runtime.session.make_session`) is tracked until it is garbage; graphs of under half the model's nodes
    (a branch, a piece of the model) do not count."""

    def __init__(self, monkeypatch, model_dir):
        import gc
        import weakref

        import onnx

        from layerdrop.runtime import session as session_module

        whole = len(onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph.node)
        self.live: list = []
        self.most = 0
        make = session_module.make_session

        def counted(model, *args, **kwargs):
            gc.collect()
            nodes = (sum(1 for _ in model.graph.all_nodes()) if hasattr(model, "graph")
                     else len(onnx.load(str(model), load_external_data=False).graph.node))
            made = make(model, *args, **kwargs)
            if nodes >= whole // 2:
                self.live = [ref for ref in self.live if ref() is not None] + [weakref.ref(made)]
                self.most = max(self.most, len(self.live))
            return made

        monkeypatch.setattr(session_module, "make_session", counted)

    def reset(self) -> None:
        self.live, self.most = [], 0


def test_a_bench_whose_two_sessions_do_not_fit_together_times_one_model_at_a_time(exported, capsys, tmp_path,
                                                                                  monkeypatch):
    """Between the estimate of one session and that of two, bench runs, says so in one note, and never holds two
    sessions at once; at the estimate of two it holds both (alternating runs) and says nothing."""
    model = exported("llama", True)
    sessions = _Sessions(monkeypatch, model)
    one, both = _estimate("bench", model), _estimate("bench", model) + _estimate("bench", model) - memory.SESSION_MARGIN
    for limit, held, noted in ((one, 1, True), (both, 2, False)):
        sessions.reset()
        capsys.readouterr()
        code = main([*_argv("bench", model, tmp_path / "out"), "--json", str(tmp_path / "bench.json"),
                     "--memory-limit", str(limit)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert sessions.most == held
        assert ("one model at a time" in err) == noted, err
        result = json.loads((tmp_path / "bench.json").read_text())
        assert ("one_at_a_time" in result) == noted
        assert all(entry["base"]["median_ms"] > 0 and entry["pruned"]["median_ms"] > 0 for entry in result["prefill"])
        assert result["decode_tokens_per_s"]["base"] > 0 and result["decode_tokens_per_s"]["pruned"] > 0


def test_an_eval_vs_whose_two_sessions_do_not_fit_together_measures_the_same_fidelity_one_at_a_time(
        exported, capsys, tmp_path, monkeypatch):
    """Between the estimate of one session and that of two, eval --vs holds one session on a model at a time (the
    base's log-probabilities kept on disk), says so in one note, and finds the KL divergence and top-1 agreement that
    the two sessions side by side find, to float32 rounding; at the estimate of two it holds both."""
    import tempfile

    model = exported("llama", True)
    assert main(["drop", str(model), "--attn", "1", "--iterative", "-o", str(tmp_path / "dropped"), *FAST]) == 0
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the base's log-probabilities go
    sessions = _Sessions(monkeypatch, model)
    one = _estimate("eval", model)
    both = one + _estimate("eval", tmp_path / "dropped") - memory.SESSION_MARGIN
    found = {}
    for limit, held, noted in ((one, 1, True), (both, 2, False)):
        sessions.reset()
        capsys.readouterr()
        code = main(["eval", str(model), "--vs", str(tmp_path / "dropped"), *FAST, "--json",
                     str(tmp_path / f"eval-{held}.json"), "--memory-limit", str(limit)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert sessions.most == held
        assert ("one model at a time" in err) == noted, err
        found[held] = json.loads((tmp_path / f"eval-{held}.json").read_text())["fidelity"]
    assert found[1]["kl"] > 0 and found[1]["kl"] == pytest.approx(found[2]["kl"], rel=1e-5)
    assert found[1]["top1_agreement"] == found[2]["top1_agreement"] and found[1]["tokens"] == found[2]["tokens"]
    assert not list((tmp_path / "tmp").iterdir())  # nothing left on disk


@pytest.mark.parametrize("budget", ["attn=1", "speedup=1.01@16"])
def test_a_plan_whose_base_and_row_sessions_do_not_fit_together_builds_one_at_a_time(exported, capsys, tmp_path,
                                                                                    monkeypatch, budget):
    """Between the estimate of one session and that of two, a plan whose rows are timed runs with one session on
    the model at a time (the base timed alone first), says so in one note, and still reports every row's speedup;
    with room for two it holds the base's beside each row's."""
    from layerdrop.api.plan.measure import FIDELITY_BYTES, PREFIX_BYTES

    model = exported("llama", True)
    sessions = _Sessions(monkeypatch, model)
    one = _estimate("plan", model)
    both = one + _estimate("plan", model) - memory.SESSION_MARGIN - PREFIX_BYTES - FIDELITY_BYTES
    args = ["plan", str(model), "--budget", budget, "--moves", "drop,bypass" if budget.startswith("attn") else "blocks",
            "--accuracy-items", "0", "--validation-samples", "0", "--validation-items", "0", "--speedup-runs", "2",
            "--speedup-tokens", str(TOKENS),
            "--search-samples", "2", "--eval-samples", "2", "--fit-samples", "2", *FAST]
    for limit, held, noted in ((one, 1, True), (both, 2, False)):
        sessions.reset()
        capsys.readouterr()
        out = tmp_path / f"out-{held}"
        code = main([*args, "-o", str(out), "--json", str(tmp_path / "plan.json"), "--memory-limit", str(limit)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert sessions.most == held
        assert ("one graph at a time" in err) == noted, err
        rows = json.loads((tmp_path / "plan.json").read_text())["methods"]
        assert rows and all(row["speedup"] > 0 for row in rows)


def test_where_a_float16_export_fits_a_refused_command_names_it_and_on_it_the_command_runs(hf_folder, exported,
                                                                                          capsys, tmp_path):
    model = exported("llama", True)
    limit = _estimate("score", model) - 1
    capsys.readouterr()
    code = main(["score", str(model), *FAST, "--memory-limit", str(limit)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--dtype float16" in err, err
    assert main(["export", str(hf_folder("llama")), "-o", str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    assert _estimate("score", tmp_path / "f16") <= limit
    assert main(["score", str(tmp_path / "f16"), *FAST, "--memory-limit", str(limit)]) == 0


PIPELINE_RUN = ["--samples", "2", "--seq-len", str(TOKENS), "--eval-samples", "2", "--seq", str(TOKENS), "--runs", "1",
                "--no-progress", "--no-builder"]


def test_a_pipeline_over_a_stated_memory_limit_is_refused_before_it_writes_anything(exported, capsys, tmp_path):
    """An ONNX folder in: every stage holds one session on the model at a time where two do not fit, so the estimate
    is one session after a run of the longest window; one byte under it is refused with nothing written, and at it
    the whole pipeline runs, holding one session at a time and saying so once for the bench and once for the
    fidelity."""
    model = exported("llama", True)
    estimate = memory.session_peak(_weight_bytes(model), 1) + int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    capsys.readouterr()
    # unfused: onnxscript's fusions add a few bytes of constants to a tiny model (and fold more away on a real one)
    argv = ["pipeline", str(model), "-o", str(tmp_path / "out"), *PIPELINE_RUN, "--no-fuse"]
    code = main([*argv, "--memory-limit", str(estimate - 1)])
    _refused_with_nothing_written(code, capsys.readouterr().err, tmp_path)
    code = main([*argv, "--memory-limit", str(estimate)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (tmp_path / "out" / "pruned" / "model.onnx").is_file()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "one_at_a_time" in report["bench"] and "one_at_a_time" in report["fidelity"]
    assert err.count("one model at a time") == 2, err
    assert (tmp_path / "out" / "report.md").read_text().count("one model at a time") == 2
    assert report["bench"]["prefill"][0]["pruned"]["median_ms"] > 0 and report["fidelity"]["kl"] > 0


def test_a_pipeline_with_room_for_two_sessions_holds_base_and_output_together(exported, capsys, tmp_path,
                                                                              monkeypatch):
    """With room for both sessions the bench alternates base and output runs with both held (no note); where only
    one fits it never holds two."""
    model = exported("llama", True)
    one = memory.session_peak(_weight_bytes(model), 1) + int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    both = memory.session_peak(_weight_bytes(model), 2) + 2 * int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    sessions = _Sessions(monkeypatch, model)
    for limit, held in ((one, 1), (both * 2, 2)):
        sessions.reset()
        capsys.readouterr()
        out = tmp_path / f"out-{held}"
        code = main(["pipeline", str(model), "-o", str(out), *PIPELINE_RUN, "--no-fuse", "--memory-limit", str(limit)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert sessions.most == held
        assert ("one model at a time" in err) == (held == 1), err


def test_a_pipeline_from_a_hugging_face_folder_is_refused_before_it_exports_and_names_the_float16_start(
        hf_folder, capsys, tmp_path):
    """A Hugging Face folder in, with the builder's graph: the estimate is two copies of the float32 weights of the
    parameters PyTorch counts (the builder's conversion holds the weights and the graph it writes) and one session's
    activations (no session runs beside the builder); the refusal names the float16 export to start from."""
    parameters = _parameters("qwen2")
    activations = int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    estimate = memory.session_peak(4 * parameters, 2) + activations
    folder = hf_folder("qwen2")  # made before the captured output is cleared: saving it prints a progress bar
    capsys.readouterr()
    argv = ["pipeline", str(folder), "-o", str(tmp_path / "out"), *PIPELINE_RUN[:-1]]
    code = main([*argv, "--memory-limit", str(estimate - 1)])
    err = capsys.readouterr().err
    _refused_with_nothing_written(code, err, tmp_path)
    assert "--dtype float16" in err and "layerdrop pipeline OUT" in err


def test_a_quantizing_pipeline_counts_the_quantizer_copies_of_the_weights_and_one_session_activations(
        hf_folder, exported, capsys, tmp_path):
    """`--quantize int4`: the quantizer holds its copies of the float32 weights while no session runs, so the estimate
    is those copies and one session's activations (not three sessions' activations, which refused a 270M model with
    a 262k-word vocabulary on 24 GB): refused one byte under it, passed at it, for a Hugging Face folder and an ONNX
    folder alike."""
    from layerdrop.api.pipeline import guard_pipeline
    from layerdrop.errors import LayerdropError

    activations = int(memory.ACTIVATION_COPIES * TOKENS * VOCAB * 4)
    onnx_folder = exported("llama", True)
    cases = {hf_folder("qwen2"): 4 * _parameters("qwen2"), onnx_folder: _weight_bytes(onnx_folder)}
    for source, weights in cases.items():
        estimate = memory.session_peak(weights, memory.QUANTIZE_COPIES) + activations
        guard_pipeline(source, estimate, copies=memory.QUANTIZE_COPIES, tokens=TOKENS)
        with pytest.raises(LayerdropError, match="over the limit"):
            guard_pipeline(source, estimate - 1, copies=memory.QUANTIZE_COPIES, tokens=TOKENS)
    limit = memory.session_peak(4 * _parameters("qwen2"), memory.QUANTIZE_COPIES) + activations
    capsys.readouterr()
    argv = ["pipeline", str(hf_folder("qwen2")), "-o", str(tmp_path / "out"), *PIPELINE_RUN, "--quantize", "int4"]
    _refused_with_nothing_written(main([*argv, "--memory-limit", str(limit - 1)]), capsys.readouterr().err, tmp_path)
