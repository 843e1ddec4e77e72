"""`layerdrop check`: a CI gate on file bytes, KV bytes per token and attention layers."""

from __future__ import annotations

from pathlib import Path

from layerdrop import model_folder
from layerdrop.api.inspect import inspect
from layerdrop.errors import LayerdropError
from layerdrop.runtime.bench import model_bytes


def check(model_path: Path, *, max_bytes: int | None = None, max_kv_bytes_per_token: int | None = None,
          max_attention_layers: int | None = None) -> dict:
    """Measure a model folder against the budgets given.

    Returns:
        {"measured": {...}, "limits": {...}, "within_budget": bool, "over": ["bytes 5 > 4", ...]}

    Raises:
        LayerdropError: no budget given, or a bad model folder.
    """
    limits = {"bytes": max_bytes, "kv_bytes_per_token": max_kv_bytes_per_token,
              "attention_layers": max_attention_layers}
    if all(v is None for v in limits.values()):
        raise LayerdropError("give at least one budget: --max-bytes, --max-kv-bytes-per-token, --max-attention-layers")
    info = inspect(model_path)
    measured = {"bytes": model_bytes(model_folder.resolve(model_path).path),
                "kv_bytes_per_token": info["kv_bytes_per_token"] or 0,
                "attention_layers": sum(r["kind"] == "attn" for r in info["regions"])}
    over = [f"{k} {measured[k]:,} > {v:,}" for k, v in limits.items() if v is not None and measured[k] > v]
    return {"measured": measured, "limits": limits, "within_budget": not over, "over": over}
