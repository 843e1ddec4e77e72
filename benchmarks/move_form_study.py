"""Which replacement of the same attention layers keeps the papers' tasks: dropped, bypassed (given alphas), fitted
maps (previous token) calibrated on the bundled mix, on modern stories (CoQA's), or on both, and a blend of the
map and the bypass.

    python benchmarks/move_form_study.py SCORED OUT LAYERS ALPHAS [--blend 0.5]
    python benchmarks/validation_evidence.py SCORED OUT/* --items 150 --windows 16 --json OUT/evidence.json

LAYERS: comma-separated attention layers; ALPHAS: the bypass's alpha per layer, in LAYERS' order (a plan's
"score-selected bypass" row, say). The maps are fitted bottom-up on 48 windows of 256 tokens (ridges chosen on 8
search windows of the mix), as `plan` fits them. The stories are CoQA's validation stories from the task-data wheel
(`layerdrop.task_data`; none of the papers' tasks), written to OUT/stories.jsonl. The blend is lambda * map +
(1 - lambda) * alpha * V·O, a map of the same size. Each variant is written to OUT/<name>.
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from layerdrop import api, task_data
from layerdrop.api.common import save_model, windows_for
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import attention_regions
from layerdrop.passes.fit_attention import FittedMap
from layerdrop.passes.harp_bypass import folded_vo, head_layout
from layerdrop.runtime.session import RunOptions
from layerdrop.search.fit import fit_attention


def blended(maps: dict[int, FittedMap], model, alphas: dict[int, float], weight: float) -> dict[int, FittedMap]:
    """weight * map + (1 - weight) * alpha * V·O for each layer's map."""
    layout = head_layout(model)
    regions = attention_regions(model, list(maps), "blend")
    found = {}
    for layer, fitted in maps.items():
        _, _, matrix, bias = folded_vo(regions[layer], *layout)
        width = matrix.shape[0]
        vo = np.zeros(fitted.weight.shape, dtype=np.float64)
        vo[:width] = matrix
        vo_bias = np.zeros(width) if bias is None else bias.astype(np.float64)
        mix = weight * fitted.weight.astype(np.float64) + (1 - weight) * alphas[layer] * vo
        shift = weight * fitted.bias.astype(np.float64) + (1 - weight) * alphas[layer] * vo_bias
        found[layer] = FittedMap(mix.astype(fitted.weight.dtype), shift.astype(fitted.bias.dtype), fitted.previous)
    return found


def stories(out: Path) -> Path:
    """CoQA's validation stories, once each, as JSON Lines."""
    seen: dict[str, None] = {}
    for doc in task_data.olmes_docs(task_data.wheel_path(), "coqa/bpb_0shot"):
        seen.setdefault(doc["doc"]["story"].strip(), None)
    path = out / "stories.jsonl"
    path.write_text("".join(json.dumps({"text": story}) + "\n" for story in seen))
    print(len(seen), "stories,", sum(map(len, seen)), "characters", flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scored", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("layers")
    parser.add_argument("alphas")
    parser.add_argument("--blend", type=float, default=0.5)
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    alphas = dict(zip(layers, (float(x) for x in args.alphas.split(","))))
    args.out.mkdir(parents=True, exist_ok=True)
    folder, _ = api.open_model(args.scored)
    search = windows_for(folder.path, None, role="search", samples=8, seq_len=256)
    story_file = stories(args.out)
    both = args.out / "both"
    both.mkdir(exist_ok=True)
    shutil.copy(Path(api.__file__).parents[1] / "data" / "calib.txt", both / "calib.txt")
    shutil.copy(story_file, both / "stories.jsonl")
    calibrations = {"mix": None, "stories": story_file, "both": both}
    options = RunOptions(threads=2)

    def write(name: str, **moves) -> None:
        _, model = api.open_model(args.scored)
        model = run_passes(model, api.rewrite_passes([], moves.get("alphas", {}), "study", fits=moves.get("fits")))
        save_model(model, args.out / "models" / name, folder, force=True)
        print("wrote", args.out / "models" / name, flush=True)

    write("drop", alphas={layer: 0.0 for layer in layers})
    write("bypass", alphas=alphas)
    for name, text in calibrations.items():
        _, model = api.open_model(args.scored)
        calib = windows_for(folder.path, text, role="calib", samples=48, seq_len=256)
        fit = fit_attention(model, folder.path, calib, layers, validation=search, previous=True, options=options)
        print(name, "ridges", fit.ridges, flush=True)
        write(f"fit-{name}", fits=fit.maps)
        if name == "mix":
            write(f"blend-{args.blend:g}", fits=blended(fit.maps, model, alphas, args.blend))


if __name__ == "__main__":
    main()
