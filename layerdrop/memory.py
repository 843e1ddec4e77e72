"""Peak memory and disk of a heavy command, estimated before it starts, and the guard that refuses it in one line.

Everything here is arithmetic on what a model's files state in their headers (safetensors tensor shapes, GGUF
tensor infos, the shapes and types of ONNX initializers): no weight is loaded, so a guard costs milliseconds. The
limit is `--memory-limit`, else `$LAYERDROP_MEMORY_LIMIT`, else 16 GB (a 24 GB machine keeps room for the system).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from layerdrop.errors import LayerdropError

if TYPE_CHECKING:
    import onnx_ir

DEFAULT_LIMIT = 16 * 1000**3
LIMIT_ENV = "LAYERDROP_MEMORY_LIMIT"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The exporter always loads the model in float32, then holds the exported graph's working copies of the weights
# in the exported dtype: Qwen2.5-Coder-1.5B's float32 export with KV cache (7.1 GB of weights, converted from its
# GGUF in the same process) peaks at 9.3 GB RSS, 1.31x the weights; the factor keeps a small margin over that.
EXPORT_COPIES = 0.32
# An ONNX Runtime CPU session holds its external data once plus the allocator's arena: on Qwen2.5-Coder-1.5B's
# float32 export (7.1 GB of data) `score` peaks at 5.9 GB RSS and `eval --vs` (one session at a time) at 7.4 GB.
SESSION_FACTOR = 1.0
SESSION_MARGIN = 512 * 1000**2
# ONNX Runtime's int4 quantizer reads every weight into memory and works on a protobuf copy of the model: `quantize`
# on SmolLM2-135M's float32 export (0.54 GB of weights) peaks at 1.70 GB RSS, 2.8x the weights past the interpreter.
QUANTIZE_COPIES = 3
# A CPU session's arena keeps its largest run's activations, which the logits dominate (vocabularies are 30-100x the
# hidden size). On SmolLM2-135M's float32 export (0.54 GB of weights, vocabulary 49,152), past its weights and 0.2 GB
# of interpreter: `bench` against itself (two sessions) peaks at 1.58 GB RSS at 256 tokens and 2.85 GB at 1024, 3.0
# and 4.3 float32 copies of a run's logits per session; `eval` at 256 tokens at 0.96 GB, 4.4 copies.
ACTIVATION_COPIES = 4.5

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[f"{_p}b"] = _UNITS[_p] = 1000**_i
    _UNITS[f"{_p}ib"] = _UNITS[f"{_p}i"] = 1024**_i


def parse_size(text: str) -> int:
    """'500MB' -> 500_000_000, '1.5GiB' -> 1_610_612_736, '123' -> 123.

    Raises:
        LayerdropError: not a number with an optional unit.
    """
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise LayerdropError(f"bad size {text!r}: use a number with an optional unit like 500MB or 1.5GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def memory_limit(stated: int | None = None) -> int:
    """The memory limit in bytes: `stated` (from --memory-limit), else $LAYERDROP_MEMORY_LIMIT, else 16 GB."""
    if stated is not None:
        return stated
    from_env = os.environ.get(LIMIT_ENV)
    return parse_size(from_env) if from_env else DEFAULT_LIMIT


def gigabytes(size: int) -> str:
    """A byte count as people read it: '9.1 GB'."""
    return f"{size / 1000**3:.1f} GB"


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header states: its string and number metadata, and its parameters (tensor elements)."""

    metadata: dict
    parameters: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_header(path: Path) -> GGUFHeader:
    """Read a GGUF header (metadata and tensor infos) without reading the tensors; arrays are skipped.

    Raises:
        LayerdropError: the file is not a GGUF file or its header is cut short.
    """
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise LayerdropError(f"{path} is not a GGUF file (bad magic bytes)")
            _version, tensors, entries = struct.unpack("<IQQ", _exactly(f, 20))
            metadata = {}
            for _ in range(entries):
                key = _string(f)
                kind = struct.unpack("<I", _exactly(f, 4))[0]
                value = _value(f, kind)
                if value is not None:
                    metadata[key] = value
            parameters = 0
            for _ in range(tensors):
                _string(f)
                dims = struct.unpack("<I", _exactly(f, 4))[0]
                parameters += math.prod(struct.unpack(f"<{dims}Q", _exactly(f, 8 * dims)))
                _exactly(f, 12)  # the tensor's type and offset
    except (struct.error, KeyError, UnicodeDecodeError, OverflowError, MemoryError):
        raise LayerdropError(f"{path} has a damaged GGUF header") from None
    return GGUFHeader(metadata, parameters)


def _exactly(f, size: int) -> bytes:
    if size > os.fstat(f.fileno()).st_size - f.tell():  # a damaged length: never allocate what the file lacks
        raise struct.error("past the end of the file")
    data = f.read(size)
    if len(data) != size:
        raise struct.error("short read")
    return data


def _string(f) -> str:
    return _exactly(f, struct.unpack("<Q", _exactly(f, 8))[0]).decode("utf-8")


def _value(f, kind: int):
    """A scalar or string value; an array is read past and returns None (tokenizer vocabularies are large)."""
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = struct.unpack("<IQ", _exactly(f, 12))
        if item == _STRING:
            for _ in range(count):
                f.seek(struct.unpack("<Q", _exactly(f, 8))[0], os.SEEK_CUR)
        elif item == _ARRAY:
            for _ in range(count):
                _value(f, _ARRAY)
        else:
            f.seek(struct.calcsize(_SCALARS[item]) * count, os.SEEK_CUR)
        return None
    return struct.unpack(_SCALARS[kind], _exactly(f, struct.calcsize(_SCALARS[kind])))[0]


def parameter_count(source: Path) -> int | None:
    """Parameters of a Hugging Face folder (its safetensors headers) or a .gguf file (its tensor infos).

    None when the files state no shapes (a folder of pickled .bin weights, say) or a safetensors header is
    damaged: no estimate is made then.
    """
    source = Path(source)
    if source.is_file():
        return gguf_header(source).parameters if source.suffix.lower() == ".gguf" else None
    files = sorted(source.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            total += sum(math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__")
        except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, MemoryError, OverflowError):
            return None  # a damaged file: the loader says what is wrong with it
    return total


def export_peak(parameters: int, dtype: str) -> int:
    """Peak memory of exporting a model of `parameters` to ONNX in `dtype`: its float32 load plus the exporter's
    working copies of the weights in the exported dtype."""
    return int(parameters * (4 + EXPORT_COPIES * DTYPE_BYTES[dtype]))


def session_peak(data_bytes: int, sessions: int = 1) -> int:
    """Peak memory of `sessions` ONNX Runtime CPU sessions held at once on a model of `data_bytes` of weights."""
    return int(sessions * SESSION_FACTOR * data_bytes + SESSION_MARGIN)


def activation_peak(tokens: int, vocabulary: int) -> int:
    """Activations a CPU session keeps after a run of `tokens` tokens (batch x sequence) with this vocabulary."""
    return int(ACTIVATION_COPIES * tokens * vocabulary * 4)


def onnx_weight_bytes(model: onnx_ir.Model) -> dict[str, int]:
    """Bytes of an ONNX graph's initializers (an onnx-ir model's) by element type ({"FLOAT": n, "UINT8": m, ...}),
    from their shapes and types: an external tensor is not read."""
    sizes: dict[str, int] = {}
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            name = value.const_value.dtype.name
            sizes[name] = sizes.get(name, 0) + value.const_value.nbytes
    return sizes


def check_memory(estimate: int, limit: int, what: str, fits: str) -> None:
    """Refuse `what` when its estimated peak exceeds the limit, naming the estimate and `fits`, what would fit.

    Raises:
        LayerdropError: the estimate is over the limit.
    """
    if estimate > limit:
        raise LayerdropError(f"{what} would need about {gigabytes(estimate)} of memory, over the limit of "
                             f"{gigabytes(limit)} (--memory-limit or ${LIMIT_ENV}); {fits}")


def check_disk(needed: int, folder: Path, what: str) -> None:
    """Refuse `what` when the file system holding `folder` (or its nearest existing parent) has less free space.

    Raises:
        LayerdropError: not enough free disk.
    """
    existing = Path(folder).resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise LayerdropError(f"{what} needs about {gigabytes(needed)} of free disk in {existing}, which has "
                             f"{gigabytes(free)}; free some space or write elsewhere")
