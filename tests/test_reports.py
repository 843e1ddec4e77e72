"""What the pipeline and the planner report: the layers the output lacks, the texts the figures come from, a
snippet that runs the output, the command that reproduces it, and table columns that name their texts."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shlex
import shutil
from pathlib import Path

import onnx
import pytest

from layerdrop.api.reports import describe_items, plan_table, reproduce_command, run_snippet, text_labels
from layerdrop.cli import main
from layerdrop.cli.parser import build_parser
from layerdrop.formats import DROPPED_KEY, is_past

TINY = ["--samples", "4", "--seq-len", "32", "--eval-samples", "2", "--seq", "16", "--runs", "1", "--no-progress",
        "--no-builder"]


def _past_inputs(folder) -> int:
    return sum(1 for v in onnx.load(folder / "model.onnx", load_external_data=False).graph.input if is_past(v.name))


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, exported):
    """(OUTDIR, argv, what it printed) of `layerdrop pipeline` on the tiny Llama export (with the
    tokenizer_config.json a real model's folder has), dropping two attention layers."""
    root = tmp_path_factory.mktemp("report")
    source = Path(shutil.copytree(exported("llama", True), root / "export"))
    (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    argv = ["pipeline", str(source), "-o", str(root / "run"), "--attn", "2", *TINY]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return root / "run", argv, printed.getvalue()


def test_the_pipeline_report_names_exactly_the_layers_the_output_model_lacks(pipeline_run):
    out, _, printed = pipeline_run
    metadata = {p.key: p.value for p in onnx.load(out / "pruned" / "model.onnx", load_external_data=False)
                .metadata_props}
    removed = json.loads(metadata[DROPPED_KEY])
    attention = sorted(e["layer"] for e in removed if e["kind"] == "attn")
    assert len(attention) == 2 and _past_inputs(out.parent / "export") - _past_inputs(out / "pruned") == 4
    report = json.loads((out / "report.json").read_text())
    assert report["removed_by_kind"] == {"attn": attention}
    line = f"- attention layers {', '.join(str(layer) for layer in attention)}: dropped"
    markdown = (out / "report.md").read_text()
    assert [x for x in markdown.splitlines() if x.startswith("- ") and " layer" in x] == [line]
    assert markdown.strip() in printed


def test_the_pipeline_report_names_its_texts_by_file_and_sha256(pipeline_run):
    out, _, _ = pipeline_run
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    for role in ("calibration", "eval"):
        text = report["texts"][role]
        assert text["sha256"][:12] in markdown and text["file"] in markdown and text["samples"] > 0
    assert report["texts"]["eval"] == report["quality"][0]["text"] == report["quality"][1]["text"]


def test_the_reproduce_command_parses_to_the_options_of_the_run(pipeline_run):
    out, argv, _ = pipeline_run
    report = json.loads((out / "report.json").read_text())
    words = shlex.split(report["reproduce"])
    assert words[:2] == ["layerdrop", "pipeline"]
    parser = build_parser()
    chosen, reproduced = vars(parser.parse_args(argv)), vars(parser.parse_args(words[2:] and words[1:]))
    assert {k: v for k, v in reproduced.items() if k != "no_progress"} == \
        {k: v for k, v in chosen.items() if k != "no_progress"}


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="needs onnxruntime-genai")
def test_the_run_snippet_generates_with_onnxruntime_genai_from_the_output(pipeline_run, capsys):
    out, _, _ = pipeline_run
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["runtime"] == "onnxruntime-genai" and (out / "pruned" / "genai_config.json").is_file()
    capsys.readouterr()
    exec(report["run"]["python"], {})  # noqa: S102 - the snippet the report tells a user to run
    assert capsys.readouterr().out.strip()


def test_a_folder_without_genai_config_gets_an_onnxruntime_session_snippet(exported, tmp_path):
    folder = Path(shutil.copytree(exported("llama", True), tmp_path / "plain",
                                  ignore=shutil.ignore_patterns("genai_config.json")))
    runtime, snippet = run_snippet(folder)
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102
    assert runtime == "onnxruntime" and "input_ids" in [i.name for i in namespace["session"].get_inputs()]


def test_two_different_texts_with_one_name_get_distinct_column_headers():
    texts = [{"file": "eval.txt", "sha256": "a" * 64}, {"file": "eval.txt", "sha256": "b" * 64},
             {"file": "docs.txt", "sha256": "c" * 64}, {"file": "eval.txt", "sha256": "a" * 64}]
    labels = text_labels(texts)
    assert labels[0] != labels[1] and labels[0] == labels[3] and labels[2] == "docs.txt"


def test_the_plan_table_heads_two_held_out_files_called_eval_txt_differently():
    row = {"method": "drop", "alphas": {"3": 0}, "kv_kept": 0.5, "search_ppl": 10.0, "eval_ppl": 11.0,
           "also_eval_ppl": {"eval.txt": 12.0}}
    result = {"budget": "attn=1", "baseline": {**row, "method": "baseline"}, "methods": [row], "pick": row,
              "search_text": {"file": "calib.txt", "sha256": "c" * 64},
              "eval_text": {"file": "eval.txt", "sha256": "a" * 64},
              "also_eval_texts": [{"file": "eval.txt", "sha256": "b" * 64}]}
    header = plan_table(result).splitlines()[0]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    held_out = [c for c in columns if c.startswith("held-out ppl")]
    assert len(held_out) == 2 and len(set(held_out)) == 2


def test_reproduce_command_quotes_paths_for_the_shell():
    command = reproduce_command("plan", ["my model"], {"-o": "out dir", "--also-eval": ["a b.txt", "docs"],
                                                       "--seq": (256, 1024), "--force": True, "--calib": None})
    assert shlex.split(command) == ["layerdrop", "plan", "my model", "-o", "out dir", "--also-eval", "a b.txt",
                                    "--also-eval", "docs", "--seq", "256,1024", "--force"]


def test_the_reproduce_command_names_bundled_texts_so_it_runs_wherever_the_package_is_installed():
    argv = ["plan", "model", "-o", "out", "--budget", "attn=2", "--calib", "calib", "--also-eval", "docs",
            "--also-eval", "./docs"]
    args = build_parser().parse_args(argv)
    command = reproduce_command("plan", [args.model], {"-o": args.output, "--budget": args.budget,
                                                       "--calib": args.calib, "--also-eval": args.also_eval})
    words = shlex.split(command)
    assert words[words.index("--calib") + 1] == "calib" and "docs" in words and "./docs" in words
    reproduced = build_parser().parse_args(words[1:])
    assert (reproduced.calib, reproduced.also_eval) == (args.calib, args.also_eval)


def test_task_items_are_described_by_their_count_and_the_text_they_were_built_from():
    line = describe_items(200, {"file": "eval.txt", "sha256": "3f2a1c9b0d4e" + "0" * 52})
    assert "200" in line and "eval.txt" in line and "3f2a1c9b0d4e" in line
