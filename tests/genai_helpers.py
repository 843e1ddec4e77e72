"""onnxruntime-genai (the `genai` extra): generate greedily from a folder, to check that what layerdrop wrote runs
there (and the model builder, from `layerdrop.export.builder`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from layerdrop.errors import LayerdropError
from layerdrop.export.builder import run_builder  # noqa: F401 - the tests' and benchmarks' door to it


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
