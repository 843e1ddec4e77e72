"""`layerdrop quantize`: int4 weights (MatMulNBits) through ONNX Runtime's quantizer, for any model folder."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.common import guard_memory, quantize_pass, save_model
from layerdrop.passes.cleanup import run_passes


def quantize(model_path: Path, out_dir: Path, *, kind: str = "int4", block_size: int = 32,
             accuracy_level: int | None = None, force: bool = False, memory_limit: int | None = None) -> dict:
    """Write `model_path` with int4 weights to `out_dir` (after any rewrite: remove first, then quantize). An
    estimated peak memory (the quantizer's copies of the weights) over `memory_limit` is refused first.

    Returns:
        {"matmul_nbits": count, "bytes": {"before", "after"}}

    Raises:
        LayerdropError: a bad model folder, an unknown kind, a refused output, or memory over the limit.
    """
    from layerdrop.runtime.bench import model_bytes

    guard_memory("quantize", [model_path], memory_limit, copies=0, quantizes=True)

    folder, model = model_folder.load(model_path)
    model_folder.reserve_output(Path(out_dir), inputs=[folder.path], force=force)
    model = run_passes(model, [quantize_pass(kind, block_size, accuracy_level)])
    save_model(model, out_dir, folder, force=force)
    count = sum(1 for node in model.graph if node.op_type == "MatMulNBits")
    return {"matmul_nbits": count, "bytes": {"before": model_bytes(folder.path), "after": model_bytes(Path(out_dir))}}
