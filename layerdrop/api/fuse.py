"""`layerdrop fuse`: ONNX Runtime's transformer fusions (onnxscript's ORT rules) on any model folder."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import fusion_note, fusion_passes, fusions, guard_memory, save_model
from layerdrop.passes.cleanup import run_passes


def fuse(model_path: Path, out_dir: Path, *, force: bool = False, memory_limit: int | None = None) -> dict:
    """Write `model_path` fused for ONNX Runtime to `out_dir` (fuse last: analysis and drops belong before it).
    The fusions stream the weights rather than hold them, so the memory guard (`guard_memory`, `memory_limit`)
    counts the interpreter and graph alone.

    Returns:
        {"fusions": {name: count}, "nodes": {"before", "after"}}

    Raises:
        LayerdropError: a bad model folder, a refused output, or memory over the limit.
    """
    guard_memory("fuse", [model_path], memory_limit, copies=0)
    folder, model = model_folder.load(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    before = len(model.graph)
    model = run_passes(model, fusion_passes())
    save_model(model, out_dir, folder, force=force)
    return {"fusions": fusions(model), "fusion_note": fusion_note(model),
            "nodes": {"before": before, "after": len(model.graph)}}
