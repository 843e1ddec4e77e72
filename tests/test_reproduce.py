"""benchmarks/reproduce.py: one command measures every section into JSON and renders the Markdown tables from it;
checked on a tiny random-weight model in its quick form."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "reproduce.py"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
pytestmark = pytest.mark.slow  # every section's quick form runs real commands: minutes on 2 cores


def reproduce(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, str(SCRIPT), "--model", "smollm2", *args], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.fixture(scope="module")
def measured(hf_folder, tmp_path_factory):
    """The quick form of every section on the tiny model: (results folder, work folder, the tiny HF folder)."""
    root = tmp_path_factory.mktemp("reproduce")
    out, work, folder = root / "results", root / "work", hf_folder("llama-h16")
    result = reproduce("--quick", "--model-folder", str(folder), "--planner-attn", "1", "--out", str(out),
                       "--work", str(work), "--readme", str(root / "absent.md"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, work, folder


def tables(markdown: str) -> list[dict[str, list[str]]]:
    """Every Markdown table as {first cell: the other cells}, its header row under "" and its rule row left out."""
    found, current = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = {"": cells}
            found.append(current)
        elif not set(cells[0]) <= {"-"}:
            current[cells[0]] = cells[1:]
    return found


def numbers(cell: str) -> list[float]:
    return [float(n) for n in NUMBER.findall(cell.replace(",", ""))]


def row(table: dict[str, list[str]], start: str) -> list[str]:
    matches = [cells for label, cells in table.items() if label.startswith(start)]
    assert len(matches) == 1, (start, list(table))
    return matches[0]


def test_every_section_writes_its_json_with_provenance_and_texts(measured):
    out, _, folder = measured
    for section in ("pipeline", "planner", "blocks", "speedup", "criteria", "deploy"):
        data = json.loads((out / "smollm2" / f"{section}.json").read_text())
        assert data["args"]["source"] == str(folder) and data["args"]["quick"] is True
        assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and re.fullmatch(r"[0-9a-f]{40}", data["head"])
        assert data["date"] and data["machine"]["cpu"]
        assert set(data["versions"]) >= {"layerdrop", "onnxruntime"} and data["commands"]
    pipeline = json.loads((out / "smollm2" / "pipeline.json").read_text())["results"]
    text = pipeline["eval"]["docs"]["base"]["text"]
    assert text["file"] == "docs.txt" and len(text["starts"]) == text["samples"] == 8 and text["sha256"]


def test_the_pipeline_table_shows_the_json_numbers(measured):
    out, _, _ = measured
    r = json.loads((out / "smollm2" / "pipeline.json").read_text())["results"]
    table = tables((out / "smollm2" / "README.md").read_text())[0]
    columns = ("drop", "harp", "plan")
    for kind, label in (("eval", "perplexity, held-out prose"), ("docs", "perplexity, technical writing"),
                        ("code", "perplexity, code")):
        cells = row(table, label)
        expected = [r["eval"][kind][k]["perplexity"] for k in ("base", *columns)]
        assert [numbers(c)[0] for c in cells] == [round(v, 2) for v in expected]
    for index, entry in enumerate(r["bench"]["drop"]["prefill"]):
        cells = row(table, f"prefill {entry['seq']} tokens")
        assert numbers(cells[0])[0] == round(entry["base"]["median_ms"], 1)
        for cell, name in zip(cells[1:], columns):
            timed = r["bench"][name]["prefill"][index]
            assert numbers(cell) == [round(timed["pruned"]["median_ms"], 1), round(timed["speedup"], 2)]
    cells = row(table, "KV cache bytes/token")
    assert numbers(cells[0]) == [r["bench"]["drop"]["kv_bytes_per_token"]["base"]]
    assert [numbers(c)[0] for c in cells[1:]] == [r["bench"][k]["kv_bytes_per_token"]["pruned"] for k in columns]
    cells = row(table, "model file bytes")
    assert [numbers(c)[0] for c in cells[1:]] == [r["bench"][k]["model_bytes"]["pruned"] for k in columns]
    cells = row(table, "accuracy")
    assert numbers(cells[0])[0] == round(100 * r["plan"]["baseline"]["accuracy"], 1)
    assert numbers(cells[3])[0] == round(100 * r["plan"]["pick"]["accuracy"], 1)


def tasks_average(row: dict) -> float:
    """A row's average over the papers' tasks in percent, from its items' outcomes in the JSON."""
    return 100 * sum(sum(v) / len(v) for v in row["tasks_correct"].values()) / len(row["tasks_correct"])


def test_the_plan_tables_show_every_row_with_the_papers_tasks_and_fidelity(measured):
    out, _, _ = measured
    plans = [json.loads((out / "smollm2" / f"{section}.json").read_text())["results"][key]
             for section, key in (("planner", "default"), ("blocks", "blocks"), ("speedup", "speedup"),
                                  ("criteria", "prose"))]
    found = [t for t in tables((out / "smollm2" / "README.md").read_text())  # in the page's order
             if t[""][0] == "method" and t[""][-1] != "average"]
    assert len(found) == 4
    for plan, table in zip(plans, found):
        assert plan["task_items"] == 4
        tasks = [i for i, name in enumerate(table[""][1:]) if name.startswith("papers' tasks")]
        kl = [i for i, name in enumerate(table[""][1:]) if name.startswith("KL from the baseline")]
        assert len(tasks) == len(kl) == 1
        rows = plan["methods"]  # ReplaceMe's fitted runs included
        assert len(table) == 2 + len(rows)  # the header, the baseline and every row
        assert numbers(table["baseline"][3]) == [round(plan["baseline"]["eval_ppl"], 2)]
        base = tasks_average(plan["baseline"])
        assert numbers(table["baseline"][tasks[0]]) == [round(base, 1)]
        for method in rows:
            label = f"**{method['method']}**" if method["method"] == plan["pick"]["method"] else method["method"]
            cells = table[label]
            assert numbers(cells[2]) == [round(method["search_ppl"], 2)]
            assert numbers(cells[3]) == [round(method["eval_ppl"], 2)]
            assert numbers(cells[1]) == ([] if method["speedup"] is None else [round(method["speedup"], 2)])
            average = tasks_average(method)
            assert numbers(cells[tasks[0]])[:2] == [round(average, 1), round(100 * average / base, 1)]
            assert numbers(cells[kl[0]]) == [round(method["kl"], 4), round(100 * method["top1_agreement"], 1)]


def test_the_block_plan_compares_shortgpt_with_replaceme_and_every_plan_shows_each_task(measured):
    out, _, _ = measured
    blocks = json.loads((out / "smollm2" / "blocks.json").read_text())["results"]["blocks"]
    assert blocks["budget"] == "blocks=1" and blocks["task_items"] == 4
    assert any(m["method"].startswith("ShortGPT") for m in blocks["methods"])
    assert any(m["method"].startswith("ReplaceMe") for m in blocks["methods"])
    page = (out / "smollm2" / "README.md").read_text()
    per_task = [t for t in tables(page) if t[""][0] == "method" and t[""][-1] == "average"]
    default = json.loads((out / "smollm2" / "planner.json").read_text())["results"]["default"]
    speedup = json.loads((out / "smollm2" / "speedup.json").read_text())["results"]["speedup"]
    prose = json.loads((out / "smollm2" / "criteria.json").read_text())["results"]["prose"]
    assert len(per_task) == 4  # in the page's order: planner, blocks, speedup, criteria
    for plan, table in zip((default, blocks, speedup, prose), per_task):
        names = list(plan["baseline"]["tasks_correct"])
        assert [cell.split(" (")[0] for cell in table[""][1:-1]] == names
        chance = [100 * plan["baseline"]["tasks_chance"][t] for t in names]
        assert numbers(" ".join(table["chance"])) == [round(v, 1) for v in [*chance, sum(chance) / len(chance)]]
        for method in [{"method": "baseline", **plan["baseline"]}, *plan["methods"]]:
            scores = [100 * sum(method["tasks_correct"][t]) / len(method["tasks_correct"][t]) for t in names]
            expected = [round(v, 1) for v in [*scores, sum(scores) / len(scores)]]
            assert numbers(" ".join(table[method["method"]])) == expected


def test_the_criteria_table_shows_the_row_each_criterion_picks_with_its_held_out_ratios(measured):
    out, _, _ = measured
    plan = json.loads((out / "smollm2" / "criteria.json").read_text())["results"]["prose"]
    assert plan["search_text"]["file"] == "prose.txt" and plan["picks"][plan["criterion"]] == plan["pick"]["method"]
    table = [t for t in tables((out / "smollm2" / "README.md").read_text())  # the planner's comes first
             if t[""][:3] == ["row", "chosen by", "held-out ppl / baseline (eval.txt)"]][-1]
    rows = {m["method"]: m for m in plan["methods"]}
    base = plan["baseline"]
    for method in set(plan["picks"].values()):
        cells = table[method]  # a pick that is also the best paper row: its pick line comes last
        chosen = {name.strip("*") for name in cells[0].split(", ") if not name.startswith("best paper")}
        assert chosen <= set(plan["picks"]) and all(plan["picks"][name] == method for name in chosen)
        assert numbers(cells[1]) == [round(rows[method]["eval_ppl"] / base["eval_ppl"], 3)]


def test_the_deploy_tables_show_both_pipelines_against_the_builder(measured):
    out, _, _ = measured
    r = json.loads((out / "smollm2" / "deploy.json").read_text())["results"]
    found = {table[""][0].split(",")[0]: table for table in tables((out / "smollm2" / "README.md").read_text())}
    for name in ("fp32", "int4"):
        table = found[name]
        entry = r[name]["bench"]["prefill"][0]
        cells = row(table, f"prefill {entry['seq']} tokens")
        assert numbers(cells[0]) == [round(entry["base"]["median_ms"], 1)]
        assert numbers(cells[2]) == [round(entry["pruned"]["median_ms"], 1)]
        assert numbers(row(table, "model file bytes")[2]) == [r[name]["bench"]["model_bytes"]["pruned"]]
    assert r["int4"]["bench"]["model_bytes"]["base"] < r["fp32"]["bench"]["model_bytes"]["base"]
    table, models = found["builder int4 in"], r["builder int4 in"]["eval"]
    assert numbers(row(table, "perplexity")[0])[0] == round(models[0]["perplexity"], 2)
    assert numbers(row(table, "perplexity")[1])[0] == round(models[1]["perplexity"], 2)
    kv = r["builder int4 in"]["bench"]["kv_bytes_per_token"]
    assert numbers(row(table, "KV cache bytes/token")[1])[0] == kv["pruned"] < kv["base"]


def test_a_section_measured_at_the_same_commit_and_arguments_is_not_measured_again(measured):
    out, work, folder = measured
    path = out / "smollm2" / "pipeline.json"
    before = path.read_bytes()
    result = reproduce("--quick", "--only", "pipeline", "--model-folder", str(folder), "--planner-attn", "1",
                       "--out", str(out), "--work", str(work), "--readme", str(out / "absent.md"))
    assert result.returncode == 0 and path.read_bytes() == before
    assert "$ layerdrop" not in result.stderr


def test_a_rerun_after_a_crash_runs_none_of_the_commands_already_done(measured):
    """A section whose JSON is missing (the run stopped before writing it) is measured again from the commands'
    outputs already in WORK: none of them is rewritten, and the figures are the same."""
    out, work, folder = measured
    path, markdown = out / "smollm2" / "pipeline.json", out / "smollm2" / "README.md"
    kept, rendered = path.read_bytes(), markdown.read_bytes()
    outputs = {p: p.stat().st_mtime_ns for p in (work / "pipeline").glob("*.json")}
    assert len(outputs) >= 8
    path.unlink()
    try:
        result = reproduce("--quick", "--only", "pipeline", "--model-folder", str(folder), "--planner-attn", "1",
                           "--out", str(out), "--work", str(work), "--readme", str(out / "absent.md"))
        assert result.returncode == 0, result.stderr[-3000:]
        assert {p: p.stat().st_mtime_ns for p in outputs} == outputs
        assert json.loads(path.read_text())["results"] == json.loads(kept)["results"]
    finally:  # the fixture's files as they were, for the other tests
        path.write_bytes(kept)
        markdown.write_bytes(rendered)


def test_a_plan_stopped_part_way_goes_on_from_its_checkpoints_and_the_table_says_so(measured):
    """A plan recorded as started at this commit that left no output (stopped for the night, say) is run again as
    a resumed step (`plan --resume`, whose checkpoints tests/test_plan_resume.py covers): the section keeps the
    same pick, removals and held-out figures, and its stamp says which step went on and that its time is partial."""
    out, work, folder = measured
    path, markdown = out / "smollm2" / "pipeline.json", out / "smollm2" / "README.md"
    kept, rendered = path.read_bytes(), markdown.read_bytes()
    steps = json.loads((work / "steps.json").read_text())
    (line,) = [k for k in steps if k.startswith("layerdrop plan ") and "/pipeline/plan " in k]
    plan_json = work / "pipeline" / "plan.json"
    plan_kept = plan_json.read_bytes()
    (work / "steps.json").write_text(json.dumps({**steps, line: {"commit": steps[line]["commit"]}}))
    plan_json.unlink()
    path.unlink()
    try:
        result = reproduce("--quick", "--only", "pipeline", "--model-folder", str(folder), "--planner-attn", "1",
                           "--out", str(out), "--work", str(work), "--readme", str(out / "absent.md"))
        assert result.returncode == 0, result.stderr[-3000:]
        data, before = json.loads(path.read_text()), json.loads(kept)
        assert data["resumed"] == ["plan"] and not before["resumed"]
        assert data["results"]["plan"]["pick"]["method"] == before["results"]["plan"]["pick"]["method"]
        assert data["results"]["plan"]["removed"] == before["results"]["plan"]["removed"]
        assert data["results"]["eval"] == before["results"]["eval"]
        assert "plan went on from an interrupted run" in markdown.read_text()
    finally:  # the fixture's files as they were, for the other tests
        path.write_bytes(kept)
        markdown.write_bytes(rendered)
        plan_json.write_bytes(plan_kept)
        (work / "steps.json").write_text(json.dumps(steps))


def test_render_only_replaces_the_text_between_the_markers_and_nothing_else(measured, tmp_path):
    out, _, _ = measured
    plan = json.loads((out / "smollm2" / "planner.json").read_text())["results"]["default"]
    head = "# A README\n\nSome text | with a pipe.\n\n<!-- results:smollm2 begin -->\n"
    tail = "<!-- results:smollm2 end -->\n\n| another | table |\n|---|---|\n| 1 | 2 |\n"
    readme = tmp_path / "README.md"
    readme.write_text(head + "| an old | table |\n" + tail)
    markdown = (out / "smollm2" / "README.md").read_bytes()
    json_files = {p: p.read_bytes() for p in (out / "smollm2").iterdir()}
    assert reproduce("--render-only", "--out", str(out), "--readme", str(readme)).returncode == 0
    text = readme.read_text()
    assert text.startswith(head) and text.endswith(tail) and "an old" not in text
    inside = tables(text[len(head):-len(tail)])
    assert len(inside) == 1  # the default plan's baseline, its papers' rows, its pick and the validation's pick
    table = inside[0]
    papers = [m for m in plan["methods"] if m.get("paper")]
    others = {plan["pick"]["method"], plan["picks"]["validation"]} - {m["method"] for m in papers}
    assert len(table) == 2 + len(papers) + len(others) and all(
        f"**{m}**" in table or m in table for m in others)
    texts = [plan["eval_text"]["file"], *(t["file"] for t in plan["also_eval_texts"])]
    for method in [{"method": "baseline", **plan["baseline"]}, *papers]:
        label = f"**{method['method']}**" if method["method"] == plan["pick"]["method"] else method["method"]
        held = [method["eval_ppl"], *(method["also_eval_ppl"][t] for t in texts[1:])]
        assert [numbers(c)[0] for c in table[label][:len(texts)]] == [round(v, 2) for v in held]
    assert (out / "smollm2" / "README.md").read_bytes() == markdown, "the same JSON renders the same Markdown"
    assert {p: p.read_bytes() for p in (out / "smollm2").iterdir()} == json_files, "render-only measures nothing"


def test_render_only_leaves_a_readme_without_markers_untouched_and_says_so_in_one_line(measured, tmp_path):
    out, _, _ = measured
    readme = tmp_path / "README.md"
    readme.write_text("# A README without markers\n")
    result = reproduce("--render-only", "--out", str(out), "--readme", str(readme))
    assert result.returncode == 0 and readme.read_text() == "# A README without markers\n"
    assert len([line for line in result.stderr.splitlines() if str(readme) in line]) == 1
