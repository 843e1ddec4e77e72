"""The real models of the slow tests: each exported once per version of the export code, cached between runs."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch
import transformers

import layerdrop
from layerdrop.export.default_model import known_model_folder
from layerdrop.export.onnx_export import export_folder
from layerdrop.paths import cache_dir


def _export_key() -> str:
    sources = sorted((Path(layerdrop.__file__).parent / "export").glob("*.py"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources))
    digest.update(f"{torch.__version__} {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


def cached_export(name: str) -> Path:
    """The KV-cache export of the known model `name`, made again only when the export code changed."""
    out = cache_dir() / "test-exports" / f"{name}-kv-{_export_key()}"
    if not (out / "model.onnx").is_file():
        for stale in out.parent.glob(f"{name}-kv-*"):  # exports made by older export code
            shutil.rmtree(stale, ignore_errors=True)
        export_folder(known_model_folder(name), out, kv_cache=True, force=True)
    return out


def float64_model(name: str) -> torch.nn.Module:
    """The known model in float64: the reference that float32 rounding is measured against."""
    return transformers.AutoModelForCausalLM.from_pretrained(known_model_folder(name), dtype=torch.float64).eval()
