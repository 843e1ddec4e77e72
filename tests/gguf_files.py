"""Small real GGUF files written with the gguf package's own writer, for tests of headers and fetching."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TENSORS = {"token_embd.weight": (48, 16), "blk.0.attn_q.weight": (16, 16), "output_norm.weight": (16,)}


def write_gguf(path: Path, architecture: str, name: str) -> Path:
    """A GGUF file with that `general.architecture` and `general.name`, a string array, a number and TENSORS."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    writer.add_array("tokenizer.ggml.tokens", [f"token{i}" for i in range(300)])
    writer.add_uint32(f"{architecture}.block_count", 1)
    rng = np.random.default_rng(0)
    for tensor, shape in TENSORS.items():
        writer.add_tensor(tensor, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
