"""`layerdrop export`: a Hugging Face model, a GGUF file or a known model by name, traced into an ONNX folder."""

from __future__ import annotations

from pathlib import Path


def export(source: Path | None, out_dir: Path, *, kv_cache: bool = True, dtype: str = "float32", force: bool = False,
           trust_remote_code: bool = False) -> Path:
    """Export `source` (None: the default model) to the model folder `out_dir` (see `export.onnx_export`).

    Raises:
        LayerdropError: bad source, refused output folder, or a model the exporter cannot trace.
    """
    from layerdrop.export.onnx_export import export_folder  # torch is imported only when a command exports

    return export_folder(source, Path(out_dir), kv_cache=kv_cache, dtype=dtype, force=force,
                         trust_remote_code=trust_remote_code)
