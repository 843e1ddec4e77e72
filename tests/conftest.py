"""Shared fixtures: tiny random models of five families exported once per session, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from layerdrop.windows import bundled_text
from tests.torch_reference import FAMILIES, VOCAB, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with VOCAB entries, trained on the bundled calibration text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(bundled_text("calib"))], trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory, tiny_tokenizer_file):
    """factory(family) -> a saved Hugging Face folder of the tiny model (with tokenizer.json)."""
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"hf-{family}")
            tiny_model(family).save_pretrained(folder)
            (folder / "tokenizer.json").write_bytes(tiny_tokenizer_file.read_bytes())
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def exported(tmp_path_factory, hf_folder):
    """factory(family, kv_cache) -> an exported ONNX model folder of the tiny model (cached per session)."""
    from layerdrop.export.onnx_export import export_folder

    made: dict[tuple[str, bool], Path] = {}

    def make(family: str, kv_cache: bool = True) -> Path:
        key = (family, kv_cache)
        if key not in made:
            out = tmp_path_factory.mktemp(f"onnx-{family}-{'kv' if kv_cache else 'plain'}") / "model"
            made[key] = export_folder(hf_folder(family), out, kv_cache=kv_cache)
        return made[key]

    return make


@pytest.fixture(scope="session")
def bos_tokenizer_file(tmp_path_factory, tiny_tokenizer_file) -> Path:
    """The tiny test tokenizer whose post-processor puts a BOS before every text (its last vocabulary entry: the
    tiny models have no room for one more token)."""
    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_file))
    bos = VOCAB - 1
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                             special_tokens=[("<bos>", bos)])
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture
def rng() -> np.random.RandomState:
    return np.random.RandomState(1234)


ALL_FAMILIES = sorted(FAMILIES)
