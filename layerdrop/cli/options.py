"""Parsers for command-line values: module lists, layer=alpha lists, byte sizes, providers. Each raises
LayerdropError, which the parser turns into its one-line usage error."""

from __future__ import annotations

import math
import re

from layerdrop.errors import LayerdropError
from layerdrop.memory import parse_size

MODULE_KINDS = ("attn", "mlp", "block")

def parse_layers(text: str) -> list[int]:
    """'3,6,8-10' -> [3, 6, 8, 9, 10]; duplicates and negative indices are refused."""
    layers: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise LayerdropError(f"bad layer list {text!r}: use numbers and ranges like 3,6,8-10")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise LayerdropError(f"bad layer range {part!r}: the end is before the start")
        layers.extend(range(first, last + 1))
    if len(set(layers)) != len(layers):
        raise LayerdropError(f"layer list {text!r} names a layer twice")
    return layers


def parse_modules(specs: list[str]) -> list[tuple[str, int]]:
    """['attn:3,6', 'mlp:12'] -> [('attn', 3), ('attn', 6), ('mlp', 12)]."""
    modules: list[tuple[str, int]] = []
    for spec in specs:
        kind, sep, layers = spec.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in MODULE_KINDS:
            raise LayerdropError(f"bad --drop {spec!r}: use KIND:LAYERS with KIND one of attn, mlp, block")
        modules += [(kind, layer) for layer in parse_layers(layers)]
    expanded = [(k, layer) for kind, layer in modules for k in (("attn", "mlp") if kind == "block" else (kind,))]
    if len(set(expanded)) != len(expanded):
        raise LayerdropError("the --drop list names a module twice (a block includes its attn and mlp)")
    return modules


def parse_alpha(text: str) -> float:
    """A rescaling factor in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise LayerdropError(f"alpha {text!r} is not a number; use a value in [0, 1]") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise LayerdropError(f"alpha {text!r} is outside [0, 1]")
    return value


def parse_alphas(text: str) -> dict[int, float]:
    """'29=0.8,28=0.2' -> {29: 0.8, 28: 0.2}."""
    alphas: dict[int, float] = {}
    for part in text.split(","):
        layer, sep, alpha = part.partition("=")
        if not sep or not layer.strip().isdigit():
            raise LayerdropError(f"bad --alpha {text!r}: use LAYER=ALPHA pairs like 29=0.8,28=0.2")
        index = int(layer)
        if index in alphas:
            raise LayerdropError(f"--alpha names layer {index} twice")
        alphas[index] = parse_alpha(alpha.strip())
    return alphas


def parse_bytes(text: str) -> int:
    """'500MB' -> 500_000_000, '1.5GiB' -> 1_610_612_736, '123' -> 123."""
    return parse_size(text)


def parse_items(text: str) -> int:
    """0 (none) or a number of multiple-choice items, at least 4 (an item's wrong choices come from 3 others)."""
    try:
        value = int(text)
    except ValueError:
        raise LayerdropError(f"--accuracy-items {text!r} is not a whole number") from None
    if value != 0 and value < 4:
        raise LayerdropError(f"--accuracy-items {value}: give 0 (no accuracy column) or at least 4")
    return value


def _zero_or_more(flag: str, meaning: str):
    """A parser of a whole number, 0 or more, for `flag`; anything else gets one line: give `meaning`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise LayerdropError(f"{flag} {text!r}: give {meaning}")
        return value
    return parse


parse_runs = _zero_or_more("--speedup-runs", "0 (no speedup column) or a number of runs")  # timed runs per row
parse_self_samples = _zero_or_more("--self-samples", "0 (none) or a number of windows")  # the model's own windows


def parse_count(text: str) -> int:
    """A positive module count."""
    try:
        value = int(text)
    except ValueError:
        raise LayerdropError(f"count {text!r} is not a whole number") from None
    if value < 1:
        raise LayerdropError(f"count {value} must be at least 1")
    return value


def parse_generation(text: str) -> tuple[int, int, int]:
    """'8,2048,64' -> (batch, context tokens, new tokens) for --generation-memory."""
    parts = text.split(",")
    if len(parts) != 3:
        raise LayerdropError(f"bad --generation-memory {text!r}: give BATCH,CONTEXT,NEW_TOKENS, e.g. 8,2048,64")
    batch, context, new = (parse_count(part.strip()) for part in parts)
    return batch, context, new


PROVIDERS = {"cpu": "cpu", "cuda": "cuda", "auto": "auto", "cpuexecutionprovider": "cpu",
             "cudaexecutionprovider": "cuda"}


def parse_provider(text: str) -> str:
    """'cpu', 'cuda' or 'auto', or ONNX Runtime's provider names (CPUExecutionProvider, CUDAExecutionProvider)."""
    provider = PROVIDERS.get(text.strip().lower())
    if provider is None:
        raise LayerdropError(f"unknown provider {text!r}; use cpu, cuda, auto, CPUExecutionProvider or "
                             "CUDAExecutionProvider")
    return provider
