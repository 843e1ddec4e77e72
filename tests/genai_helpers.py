"""onnxruntime-genai (the `genai` extra): generate greedily from a folder, to check that what layerdrop wrote runs
there (and the model builder, from `layerdrop.export.builder`)."""

from __future__ import annotations

import json
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


def genai_greedy_batch(folder: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """`steps` greedy tokens after each of `prompts` from onnxruntime-genai in one batch, padded on the right with
    the folder's pad token (onnxruntime-genai's convention: it masks the pad tokens after a row's last real token);
    each row is cut at its first end-of-sequence token, after which onnxruntime-genai only pads."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    config = json.loads((folder / "genai_config.json").read_text())["model"]
    pad, eos = config.get("pad_token_id", 0), config.get("eos_token_id")  # 0: its default
    width = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + steps, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
    rows: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        if generator.is_done():
            break
        generator.generate_next_token()
        for row, token in zip(rows, generator.get_next_tokens()):
            row.append(int(token))
    return [row[:row.index(eos) + 1] if eos in row else row for row in rows]
