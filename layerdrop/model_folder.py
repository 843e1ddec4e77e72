"""A model on disk is a folder: model.onnx, its external data, tokenizer files, and genai_config.json if any.

Reading checks the external-data references before any weight is read; writing stages a complete folder under
a temporary name next to the destination and renames it into place, so no partial output is ever visible.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from layerdrop.errors import LayerdropError, OutputError

GENAI_CONFIG = "genai_config.json"
MODEL_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"


@dataclass(frozen=True)
class ModelFolder:
    """A resolved model folder: `path` is the folder, `onnx_path` the graph file inside it."""

    path: Path
    onnx_path: Path


def config_json(path: Path) -> dict:
    """A JSON file of the folder ({} when absent). Raises LayerdropError when it is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LayerdropError(f"{path} is not valid JSON; fix or remove it") from None


def config(folder: Path) -> dict:
    """The Hugging Face config.json saved beside the graph; for an onnxruntime-genai folder without one, the
    same keys (eos/pad/bos token ids, max_position_embeddings) read from genai_config.json ({} when neither)."""
    found = config_json(Path(folder) / "config.json")
    if found:
        return found
    genai = config_json(Path(folder) / GENAI_CONFIG).get("model", {})
    keys = {"eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id", "bos_token_id": "bos_token_id",
            "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}
    return {ours: genai[theirs] for theirs, ours in keys.items() if theirs in genai}


def resolve(path: Path | str) -> ModelFolder:
    """Accept a model folder or the .onnx file inside it.

    Raises:
        LayerdropError: the path does not exist or holds no model.onnx.
    """
    path = Path(path)
    if not path.exists():
        raise LayerdropError(f"{path} does not exist; pass a model folder (with model.onnx) or an .onnx file")
    if path.is_dir():
        onnx_path = path / MODEL_NAME
        if not onnx_path.is_file():
            raise LayerdropError(f"{path} has no {MODEL_NAME}; pass a folder written by `layerdrop export`")
        return ModelFolder(path, onnx_path)
    return ModelFolder(path.parent, path)


def _check_external_data(model: ir.Model, folder: Path) -> None:
    """Refuse external data that lies outside the folder or is shorter than the offsets it declares (before any
    weight is read)."""
    root = folder.resolve()
    sizes: dict[Path, int] = {}
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        location = tensor.location or ""
        candidate = Path(location)
        target = (folder / candidate).resolve()
        if not location or candidate.is_absolute() or ".." in candidate.parts or root not in target.parents:
            raise LayerdropError(
                f"tensor {tensor.name!r} points to external data {location!r} outside the model folder; refused"
            )
        if target not in sizes:
            if not target.is_file():
                raise LayerdropError(f"external data file {location!r} of {folder} is missing; re-export the model")
            sizes[target] = target.stat().st_size
        end = int(tensor.offset or 0) + int(tensor.length or 0)
        if end > sizes[target]:
            raise LayerdropError(
                f"external data file {location!r} is shorter than tensor {tensor.name!r} needs "
                f"({sizes[target]} < {end} bytes); the file is truncated, re-export the model"
            )


def load(path: Path | str) -> tuple[ModelFolder, ir.Model]:
    """Load a model folder's graph with onnx-ir, as it is on disk; weights stay there until they are needed.

    Raises:
        LayerdropError: missing or unreadable model, external data that is missing, truncated or outside the folder.
    """
    folder = resolve(path)
    try:
        proto = onnx.load(folder.onnx_path, load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and others for damaged files
        raise LayerdropError(f"{folder.onnx_path} is not a readable ONNX model ({type(exc).__name__})") from None
    if not proto.graph.node:
        raise LayerdropError(f"{folder.onnx_path} is not an ONNX model with a graph (empty or truncated file)")
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:  # noqa: BLE001 - malformed protos fail deep inside the deserializer
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise LayerdropError(f"{folder.onnx_path} is a malformed ONNX model: {reason}") from None
    _check_external_data(model, folder.path)
    _set_base_dir(model, folder.path)
    _static_cache_dims(model, folder.path)
    return folder, model


def genai_config(folder: Path) -> dict:
    """The folder's onnxruntime-genai genai_config.json ({} when it has none)."""
    return config_json(Path(folder) / GENAI_CONFIG)


def _static_cache_dims(model: ir.Model, folder: Path) -> None:
    """Give cache inputs/outputs a static head size from genai_config.json where the graph leaves it symbolic
    (the builder writes [batch, kv_heads, past, "kv_cache_dim"]); runtimes need it to build an empty cache."""
    head_size = config_json(Path(folder) / GENAI_CONFIG).get("model", {}).get("decoder", {}).get("head_size")
    if not isinstance(head_size, int):
        return
    for value in [*model.graph.inputs, *model.graph.outputs]:
        name = value.name or ""
        if (name.startswith("past_key_values.") or name.startswith("present.")) and value.shape is not None \
                and len(value.shape) == 4 and not isinstance(value.shape[3], int):
            dims = list(value.shape)
            dims[3] = head_size
            value.shape = ir.Shape(dims)


def _set_base_dir(model: ir.Model, base_dir: Path) -> None:
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(base_dir)


def copy_model(model: ir.Model) -> ir.Model:
    """A deep copy of `model`; external weights stay references to the same files and are not read."""
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    for name, value in copy.graph.initializers.items():
        original = model.graph.initializers.get(name)
        if isinstance(value.const_value, ir.ExternalTensor) and original is not None:
            if isinstance(original.const_value, ir.ExternalTensor):
                value.const_value.base_dir = original.const_value.base_dir
    return copy


def reserve_output(out_dir: Path, *, inputs: list[Path | str], force: bool) -> None:
    """Refuse an output folder equal to an input, or non-empty without `force`; check that its parent is writable.

    Raises:
        LayerdropError: the output would overwrite an input or existing files, or cannot be created.
    """
    if Path(out_dir).is_symlink() and not Path(out_dir).exists():
        raise LayerdropError(f"output {out_dir} is a link to {os.readlink(out_dir)}, which does not exist; remove the "
                             "link or choose another -o")
    out = Path(out_dir).resolve()
    for item in inputs:
        item_path = Path(item).resolve()
        if out == item_path or (item_path.is_file() and out == item_path.parent):
            raise LayerdropError(f"output {out_dir} is the input; choose another -o folder")
    if out.exists() and not out.is_dir():
        raise LayerdropError(f"output {out_dir} exists and is not a folder; choose another -o")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise LayerdropError(f"output folder {out_dir} is not empty; pass --force to replace it")
    above = next(parent for parent in out.parents if parent.exists())
    if not above.is_dir():
        raise LayerdropError(f"output {out_dir} would be inside {above}, which is a file; choose another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LayerdropError(f"cannot create {out.parent}: {exc.strerror}; choose another -o") from None
    if not os.access(out.parent, os.W_OK):
        raise LayerdropError(f"cannot write into {out.parent}; choose another -o")


def publish_folder(staged: Path, out_dir: Path, *, force: bool) -> None:
    """Move a complete staged folder to `out_dir` by rename, replacing an old one only when `force` is set.

    A link at `out_dir` is itself replaced; the folder it points to is left as it is.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        if any(out_dir.iterdir()) and not force:
            raise LayerdropError(f"output folder {out_dir} is not empty; pass --force to replace it")
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(staged, out_dir)
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, out_dir)


def save(
    model: ir.Model,
    out_dir: Path | str,
    *,
    source: ModelFolder | None,
    force: bool = False,
    extra_files: dict[str, str] | None = None,
    leave_out: frozenset[str] = frozenset(),
) -> Path:
    """Write `model` as a complete model folder, atomically.

    The folder gets model.onnx, model.onnx.data (only the initializers the graph still holds), every other
    file of the source folder (tokenizer, configs), and `extra_files` (name -> text) which replace those (a
    genai_config.json that follows the rewrite, say); files named in `leave_out` are not copied.

    Raises:
        LayerdropError: refused output; OutputError: the disk filled or the folder cannot be written.
    """
    out_dir = Path(out_dir)
    reserve_output(out_dir, inputs=[source.path] if source else [], force=force)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
            staged = Path(tmp) / "model"
            staged.mkdir()
            if source is not None:
                data_files = {MODEL_NAME, DATA_NAME, source.onnx_path.name, *leave_out}
                for item in sorted(source.path.iterdir()):
                    if item.is_file() and item.name not in data_files and not item.name.endswith(".data"):
                        shutil.copy2(item, staged / item.name)
            for name, text in (extra_files or {}).items():
                (staged / name).write_text(text, encoding="utf-8")
            ir.save(model, staged / MODEL_NAME, external_data=DATA_NAME)
            publish_folder(staged, out_dir, force=force)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"no space left while writing {out_dir}; nothing was written, free space") from None
        raise OutputError(f"cannot write {out_dir}: {exc.strerror or exc}; nothing was written") from None
    return out_dir


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write a file under a temporary name next to it, then rename it into place (no partial file is ever seen).

    Raises:
        OutputError: the disk filled or the file cannot be written.
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        if isinstance(data, str):
            partial.write_text(data, encoding="utf-8")
        else:
            partial.write_bytes(data)
        partial.replace(path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"no space left while writing {path}; nothing was written, free space") from None
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; nothing was written") from None
