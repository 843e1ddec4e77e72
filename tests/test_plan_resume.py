"""`layerdrop plan --resume`: a plan killed part way and resumed gives the table and pick of one run uninterrupted,
reading back every measurement the killed run finished instead of measuring it again; a changed input recomputes
what depends on it; a left work folder is refused without --resume or --force; Ctrl-C says how to resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerdrop import api
from layerdrop.api.plan import plan
from layerdrop.api.plan.resume import plan_work_area
from layerdrop.checkpoints import CheckpointStore
from layerdrop.cli import main

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--budget", "attn=2", "--moves", "drop,bypass", "--search-text", "calib", "--samples", "4",
        "--search-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--extra", "1", "--accuracy-items", "0",
        "--validation-items", "0",
        "--speedup-runs", "2", "--threads", "1", "--no-progress"]
# The killed run sleeps after each measured row, so that SIGKILL lands between rows whatever the machine's load.
SLOW_ROWS = """
import sys, time
from layerdrop.api.plan import measure
from layerdrop.cli import main
row = measure.Measure.row
def slow(self, *args, **kwargs):
    found = row(self, *args, **kwargs)
    time.sleep(1.5)
    return found
measure.Measure.row = slow
sys.exit(main(sys.argv[1:]))
"""


def _options(calib: str) -> dict:
    """The keyword arguments of `api.plan` that ARGS and `--calib calib` give on the command line."""
    texts = api.PlanTexts(search_text="calib", calib=calib, samples=4, search_samples=2, eval_samples=2, seq_len=32,
                          accuracy_items=0, validation_items=0)
    return dict(budget="attn=2", moves="drop,bypass", texts=texts, extra=1, speedup_runs=2,
                options=api.RunOptions(threads=1), progress=False)


@pytest.fixture(scope="module")
def scored(exported, tmp_path_factory):
    """The tiny Llama with its scores in the graph, so a calibration text shapes only the iterative drop."""
    out = tmp_path_factory.mktemp("scored") / "model"
    api.score(exported("llama", True), out, samples=4, seq_len=32)
    return out


@pytest.fixture(scope="module")
def killed(scored, tmp_path_factory):
    """The work folder a plan left when SIGKILL stopped it after its first rows, and the entries it holds."""
    out = tmp_path_factory.mktemp("killed") / "model"
    work = plan_work_area(out)
    command = [sys.executable, "-c", SLOW_ROWS, "plan", str(scored), "-o", str(out), "--calib", "prose", *ARGS]
    victim = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while sum(name.startswith("row-") for name in CheckpointStore(work).names()) < 2:
        assert victim.poll() is None, "the plan ended before it was killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not out.exists()
    return work, CheckpointStore(work).names()


def _resumed(killed, scored, out: Path, calib: str):
    """`plan --resume` on a copy of the killed run's work folder, writing `out`."""
    work, _ = killed
    shutil.copytree(work, plan_work_area(out))
    return plan(scored, out, **_options(calib), resume=True)


def _uninterrupted(scored, out: Path, calib: str) -> dict:
    report = out.parent / "plan.json"
    assert main(["plan", str(scored), "-o", str(out), "--calib", calib, *ARGS, "--json", str(report)]) == 0
    return json.loads(report.read_text())


def _table(report: dict) -> dict:
    """A plan's rows and pick as plan.json holds them, without the timing columns, which two runs measure apart."""
    report = json.loads(json.dumps(report))
    untimed = ("speedup", "speedup_runs")
    return {"pick": {k: v for k, v in report["pick"].items() if k not in untimed},
            "methods": [{k: v for k, v in row.items() if k not in untimed} for row in report["methods"]],
            "baseline": report["baseline"]}


@pytest.fixture(scope="module")
def uninterrupted(scored, tmp_path_factory):
    """plan.json of the killed plan run whole."""
    return _uninterrupted(scored, tmp_path_factory.mktemp("whole") / "model", "prose")


def test_a_killed_plan_resumed_gives_the_uninterrupted_table_and_pick_without_remeasuring(killed, scored, tmp_path,
                                                                                          uninterrupted):
    work, finished = killed
    saved_rows = [CheckpointStore(work).load(*name.rsplit("-", 1))[0] for name in finished if name.startswith("row-")]
    result = _resumed(killed, scored, tmp_path / "resumed" / "model", "prose")
    reference = uninterrupted

    assert _table(result.to_dict()) == _table(reference)
    assert result.pick.method == reference["pick"]["method"]
    assert set(finished) <= set(result.checkpoints["loaded"])  # every finished measurement was read back ...
    assert not set(finished) & set(result.checkpoints["computed"])  # ... and none measured again
    assert result.checkpoints["computed"]  # the rows the kill stopped were measured on resume
    methods = result.to_dict()["methods"]
    for row in saved_rows:  # the killed run's own timings, not new ones
        assert row.speedup is not None and row.to_dict() in methods
    assert not plan_work_area(tmp_path / "resumed" / "model").exists()


def test_a_damaged_checkpoint_is_measured_again(killed, scored, tmp_path, uninterrupted):
    work, finished = killed
    out = tmp_path / "model"
    shutil.copytree(work, plan_work_area(out))
    damaged = next(name for name in finished if name.startswith("row-"))
    entry = plan_work_area(out) / f"{damaged}.pkl"
    entry.write_bytes(entry.read_bytes()[:20])
    result = plan(scored, out, **_options("prose"), resume=True)

    assert _table(result.to_dict()) == _table(uninterrupted)
    assert damaged in result.checkpoints["computed"] and damaged not in result.checkpoints["loaded"]


def test_a_changed_calibration_text_recomputes_only_what_depends_on_it(killed, scored, tmp_path):
    _, finished = killed
    result = _resumed(killed, scored, tmp_path / "resumed" / "model", "docs")
    reference = _uninterrupted(scored, tmp_path / "whole" / "model", "docs")

    assert _table(result.to_dict()) == _table(reference)
    kinds = {name.rsplit("-", 1)[0]: name for name in finished}
    # the papers' rows hold the iterative drop, made on the calibration windows; the search over drops and bypasses
    # and the sizing read only the scores in the graph and the search windows
    assert kinds["papers"] not in result.checkpoints["loaded"]
    assert any(name.startswith("papers-") for name in result.checkpoints["computed"])
    assert {kinds["bypasses"], kinds["sizing"]} <= set(result.checkpoints["loaded"])


def test_a_left_work_folder_is_refused_without_resume_or_force(killed, scored, tmp_path, capsys):
    work, finished = killed
    out = tmp_path / "model"
    shutil.copytree(work, plan_work_area(out))
    assert main(["plan", str(scored), "-o", str(out), "--calib", "prose", *ARGS]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert CheckpointStore(plan_work_area(out)).names() == finished and not out.exists()


def test_bad_input_leaves_no_work_folder(scored, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["plan", str(scored), "-o", str(out), "--calib", "prose", *ARGS, "--moves", "nonsense"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not plan_work_area(out).exists() and not out.exists()


def test_ctrl_c_keeps_the_work_folder_and_says_how_to_resume_in_one_line(scored, tmp_path, capsys, monkeypatch):
    from layerdrop.api.plan import measure

    def interrupted(self, candidate, *args, **kwargs):
        if candidate.name != "baseline":
            raise KeyboardInterrupt
        return row(self, candidate, *args, **kwargs)

    row = measure.Measure.row
    monkeypatch.setattr(measure.Measure, "row", interrupted)
    out = tmp_path / "model"
    assert main(["plan", str(scored), "-o", str(out), "--calib", "prose", *ARGS]) == 130
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "--resume" in message[0]
    assert any(name.startswith("baseline-") for name in CheckpointStore(plan_work_area(out)).names())


def test_a_speedup_budgets_sizing_resumes_with_its_own_timed_runs(scored, tmp_path, monkeypatch):
    """The rows of a speedup budget are sized by measured prefill; a resumed plan sizes from the runs the
    interrupted one timed (its timings of those structures start with them) instead of timing them afresh."""
    from layerdrop.api.plan import measure

    def interrupted(self, candidate, *args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "model"
    options = {**_options("prose"), "budget": "speedup=1.1@32", "moves": "drop"}
    with monkeypatch.context() as patched:
        patched.setattr(measure.Measure, "row", interrupted)
        with pytest.raises(KeyboardInterrupt):
            plan(scored, out, **options)
    store = CheckpointStore(plan_work_area(out))
    (sizing,) = [name for name in store.names() if name.startswith("sizing-")]
    _, _, (_, keys, timings) = store.load(*sizing.rsplit("-", 1))
    result = plan(scored, out, **options, resume=True)

    assert sizing in result.checkpoints["loaded"] and keys
    for structure in keys.values():
        base_ms, ms = timings[structure]
        assert result.timings[structure]["base_ms"][:len(base_ms)] == base_ms
        assert result.timings[structure]["ms"][:len(ms)] == ms
