"""onnxruntime-genai's model builder, run on a Hugging Face folder: the graph people ship (fused skip-norms,
GroupQueryAttention, fp32/fp16/int4), which `pipeline` and `bench` time beside layerdrop's own output."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from layerdrop.errors import LayerdropError


def builder_available() -> bool:
    """Whether onnxruntime-genai (and so its model builder) is installed."""
    return importlib.util.find_spec("onnxruntime_genai") is not None


def run_builder(hf_folder: Path, out: Path, *, precision: str = "fp32", provider: str = "cpu",
                extra_options: list[str] | None = None) -> Path:
    """`python -m onnxruntime_genai.models.builder` on a Hugging Face folder into `out` (its cache in a temporary
    folder beside `out`); `extra_options` like ["accuracy_level=4"].

    Raises:
        LayerdropError: onnxruntime-genai is not installed, or the builder failed (its last error line is in the
            message).
    """
    if not builder_available():
        raise LayerdropError("onnxruntime-genai is not installed; pip install -e '.[genai]'")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".builder-cache.") as cache:
        done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder),
                               "-o", str(out), "-p", precision, "-e", provider, "-c", cache,
                               *(["--extra_options", *extra_options] if extra_options else [])],
                              capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise LayerdropError(f"onnxruntime-genai's model builder failed on {hf_folder}: {last}")
    return out
