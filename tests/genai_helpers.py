"""onnxruntime-genai (the `genai` extra): build a model folder with its model builder, and generate greedily from
a folder, to check that what layerdrop wrote runs there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from layerdrop.errors import LayerdropError


def run_builder(hf_folder: Path, out: Path, *, precision: str = "fp32", provider: str = "cpu",
                extra_options: list[str] | None = None) -> Path:
    """`python -m onnxruntime_genai.models.builder` on a Hugging Face folder; its cache goes beside `out`;
    `extra_options` like ["int4_accuracy_level=0"].

    Raises:
        LayerdropError: the builder failed (its last error line is in the message).
    """
    done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o",
                           str(out), "-p", precision, "-e", provider, "-c", str(Path(out).parent / "builder-cache"),
                           *(["--extra_options", *extra_options] if extra_options else [])],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise LayerdropError(f"onnxruntime-genai's model builder failed on {hf_folder}: {last}")
    return Path(out)


def genai_greedy(folder: Path, prompt: list[int], steps: int) -> list[int]:
    """Up to `steps` greedy tokens after `prompt` from onnxruntime-genai on a model folder (fewer if it ends).

    Raises:
        LayerdropError: onnxruntime-genai is not installed.
    """
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise LayerdropError("onnxruntime-genai is not installed; pip install -e '.[genai]'") from None
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens: list[int] = []
    while not generator.is_done() and len(tokens) < steps:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
