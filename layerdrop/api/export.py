"""`layerdrop export`: a Hugging Face model, a GGUF file or a known model by name, traced into an ONNX folder."""

from __future__ import annotations

import os
from pathlib import Path

from layerdrop import memory
from layerdrop.errors import LayerdropError

BUILDER_INT4 = ("onnxruntime-genai's model builder int4 graph of the Hugging Face folder (python -m "
                "onnxruntime_genai.models.builder -i {folder} -o OUT -p int4 -e cpu), which layerdrop's commands read")


def export(source: Path | None, out_dir: Path, *, kv_cache: bool = True, dtype: str = "float32", force: bool = False,
           trust_remote_code: bool = False, memory_limit: int | None = None) -> Path:
    """Export `source` (None: the default model) to the model folder `out_dir` (see `export.onnx_export`).

    Before anything heavy starts, the export's peak memory is estimated from the parameters the weights' headers
    state (`memory.export_peak`) and the free disk is compared with what the export writes; either over its limit
    is refused, with nothing written. `memory_limit` in bytes (None: $LAYERDROP_MEMORY_LIMIT, else 16 GB).

    Raises:
        LayerdropError: bad source, refused output folder, an estimate over the memory limit or the free disk, or
            a model the exporter cannot trace.
    """
    from layerdrop.model_folder import reserve_output

    out_dir = Path(out_dir)
    reserve_output(out_dir, inputs=[source] if source else [], force=force)
    weights, converting = weights_of(source)
    parameters = parameters_of(weights) if weights is not None else None
    if parameters:
        guard_export(parameters, dtype, out_dir, memory.memory_limit(memory_limit),
                     convert_into=weights.parent if converting else None, folder=weights if weights.is_dir() else None)

    from layerdrop.export.onnx_export import export_folder  # torch is imported only when a command exports

    return export_folder(source, out_dir, kv_cache=kv_cache, dtype=dtype, force=force,
                         trust_remote_code=trust_remote_code)


def guard_export(parameters: int, dtype: str, out_dir: Path, limit: int, *, convert_into: Path | None = None,
                 folder: Path | None = None) -> None:
    """Refuse an export of `parameters` in `dtype` whose estimated peak memory is over `limit`, or whose files
    (plus a float32 conversion into `convert_into`, when it is first converted there) do not fit on the disk.
    `folder`: the Hugging Face folder the refusal names for the builder's int4 graph, when there is one.

    Raises:
        LayerdropError: over the memory limit (naming what fits) or over the free disk.
    """
    estimate = memory.export_peak(parameters, dtype)
    smaller = memory.export_peak(parameters, "float16")
    if dtype == "float32" and smaller <= limit:
        fits = f"--dtype float16 would need about {memory.gigabytes(smaller)}"
    else:
        fits = f"what fits is {BUILDER_INT4.format(folder=folder or 'HF_FOLDER')}"
    memory.check_memory(estimate, limit, f"exporting {parameters / 1e9:.2f}B parameters in {dtype}", fits)
    needed = parameters * memory.DTYPE_BYTES[dtype]
    if convert_into is not None:
        converted = 4 * parameters
        if _same_disk(convert_into, out_dir):
            needed += converted
        else:
            memory.check_disk(converted, convert_into, "converting the model to float32")
    memory.check_disk(needed, out_dir.parent, f"exporting {parameters / 1e9:.2f}B parameters in {dtype}")


def weights_of(source: Path | None) -> tuple[Path | None, bool]:
    """The weights an estimate reads for `source`, and whether a known model's GGUF is still to be converted."""
    from layerdrop.export.default_model import DEFAULT_MODEL, known_model, known_model_weights

    if source is not None and Path(source).exists():
        return Path(source), False
    name = DEFAULT_MODEL if source is None else str(source)
    if known_model(name) is None:
        return None, False
    weights = known_model_weights(name)
    return weights, weights.is_file()


def parameters_of(weights: Path) -> int | None:
    """The parameters of `weights`; None where the files state none or are damaged (the loader then says why)."""
    try:
        return memory.parameter_count(weights)
    except LayerdropError:
        return None


def _same_disk(first: Path, second: Path) -> bool:
    def device(path: Path) -> int:
        path = Path(path).resolve()
        while not path.exists():
            path = path.parent
        return os.stat(path).st_dev

    return device(first) == device(second)
