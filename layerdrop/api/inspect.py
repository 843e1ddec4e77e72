"""`layerdrop inspect`: regions, scores, KV bytes per token and what was removed; and the scores as a plot."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import open_model
from layerdrop.formats import FAMILY_KEY, is_state_past, state_layer
from layerdrop.passes.attach_scores import read_scores
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import (
    calibration_record,
    kv_bytes_per_token,
    kv_layer_map,
    removed_modules,
    state_bytes_per_sequence,
)


def inspect(model_path: Path) -> dict:
    """Describe a model folder: regions with their scores, KV bytes per token, the layers whose fitted maps carry a
    previous-token state (`plan --fit-previous`) and its bytes per sequence (fixed: it does not grow with the tokens),
    what was removed."""
    folder, model = open_model(model_path)
    regions = annotated_regions(model)
    scores = {(r["kind"], r["layer"]): r for r in read_scores(model, regions)}
    rows = []
    for region in regions:
        row = {"layer": region.layer, "kind": region.kind, "branch_nodes": len(region.branch),
               "kv_inputs": region.kv_inputs}
        scored = scores.get((region.kind, region.layer), {})
        row.update({k: v for k, v in scored.items() if k in ("score", "norm_ratio")})
        rows.append(row)
    blocks = [r for r in scores.values() if r["kind"] == "block"]
    builder = model_folder.genai_config(folder.path).get("model", {}).get("type")
    return {
        "family": model.metadata_props.get(FAMILY_KEY) or (f"{builder} (onnxruntime-genai builder)"
                                                           if builder else None),
        "nodes": len(model.graph),
        "regions": rows,
        "blocks": sorted(blocks, key=lambda r: r["layer"]),
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "kv_layers": kv_layer_map(model),
        "state_layers": sorted({state_layer(v.name) for v in model.graph.inputs if is_state_past(v.name)}),
        "state_bytes_per_sequence": state_bytes_per_sequence(model),
        "removed": removed_modules(model),
        "calibration": calibration_record(model),
    }


def plot_scores(rows: list[dict], path: Path) -> None:
    """Draw per-layer attention, MLP and block scores to a PNG (written atomically)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for kind, marker in (("attn", "o"), ("mlp", "s"), ("block", "^")):
        points = sorted((r["layer"], r["score"]) for r in rows if r["kind"] == kind)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=marker, label=kind)
    ax.set_xlabel("layer")
    ax.set_ylabel("S = 1 - cos(X, Y)  (low: candidate to drop)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("layerdrop importance scores")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png")
    plt.close(fig)
    model_folder.write_atomically(Path(path), image.getvalue())
