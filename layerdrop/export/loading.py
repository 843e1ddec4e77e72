"""Load a Hugging Face decoder model from a local folder or a GGUF file, offline."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from layerdrop.errors import LayerdropError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise LayerdropError(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file")
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayerdropError(f"{config_path} is not valid JSON ({exc}); fix or replace it") from None


def load_model(source: Path, *, trust_remote_code: bool = False) -> tuple[torch.nn.Module, Path | None]:
    """Load a causal LM in float32 for export.

    Args:
        source: a Hugging Face model folder, or a `.gguf` file.
        trust_remote_code: allow a folder whose config.json names custom code (`auto_map`).

    Returns:
        The model in eval mode, and the folder holding its tokenizer files (None for a GGUF file).

    Raises:
        LayerdropError: the path is missing, not a model, needs remote code, or the GGUF file is unusable.
    """
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not source.exists():
        raise LayerdropError(f"{source} does not exist; pass a Hugging Face model folder or a .gguf file")
    if source.is_file():
        return _load_gguf(source), None
    config = _read_config(source)
    if "auto_map" in config and not trust_remote_code:
        raise LayerdropError(
            f"{source}/config.json asks for custom code (auto_map); rerun with --trust-remote-code if you trust it"
        )
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001 - loaders raise many types (OSError, UnpicklingError, ValueError)
        first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        first_line = re.sub(r"\x1b\[[0-9;]*m", "", first_line)  # torch colours some of its messages
        raise LayerdropError(f"cannot load the model in {source}: {first_line}") from None
    return model.eval(), source


def _load_gguf(path: Path) -> torch.nn.Module:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LayerdropError(f"{path} is not a GGUF file (bad magic bytes); pass a .gguf model or a model folder")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001 - the gguf reader raises many types for a damaged file
        architecture = _gguf_architecture(path)
        what = f" (a {architecture} model, which transformers cannot load as a decoder LLM)" if architecture else ""
        raise LayerdropError(f"cannot load GGUF file {path}{what}: {_first_line(exc)}") from None
    gguf_tokenizer(path)  # a damaged tokenizer is refused before the minutes of tracing, not after
    return model.eval()


def gguf_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer transformers builds from a GGUF file's metadata (built once per file).

    Raises:
        LayerdropError: the file's tokenizer metadata is missing or damaged.
    """
    stat = path.stat()
    return _gguf_tokenizer(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _gguf_tokenizer(path: str, size: int, modified: int) -> transformers.PreTrainedTokenizerBase:
    try:
        return transformers.AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
    except Exception as exc:  # noqa: BLE001 - the tokenizer converters raise many types for damaged metadata
        raise LayerdropError(f"cannot load the tokenizer of GGUF file {path}: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:200]


def _gguf_architecture(path: Path) -> str | None:
    """`general.architecture` from a GGUF header, or None when the header cannot be read."""
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    except Exception:  # noqa: BLE001 - a damaged header: the loader's own message says enough
        return None


def gguf_to_folder(gguf_path: Path, folder: Path) -> Path:
    """Dequantize a GGUF model and save it as a plain Hugging Face folder (weights and tokenizer).

    transformers refuses `save_pretrained` on a GGUF-loaded model because of its quantization_config, so a plain
    config is rebuilt from its dict and the state dict is loaded into a fresh model of that config.

    Raises:
        LayerdropError: the file is not a usable GGUF model.
    """
    gguf_model = _load_gguf(gguf_path)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(**config_dict)
    with torch.device("meta"):  # no second copy of the weights: the plain model takes the loaded tensors over
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    tokenizer = gguf_tokenizer(gguf_path)

    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as tmp:
        plain.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for item in Path(tmp).iterdir():
            if item != staged:
                shutil.move(str(item), staged / item.name)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staged, folder)
    return folder
