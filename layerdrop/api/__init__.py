"""The Python API: one module per command, each a function that reads model folders, calls passes, the runtime
and the searches, and writes a folder, as the matching CLI command does.

    from layerdrop import api
    api.score("out/smollm2", "out/scored")
    api.drop("out/scored", "out/attn8", counts={"attn": 8})
"""

from layerdrop.api.bench import bench
from layerdrop.api.check import check
from layerdrop.api.common import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    guard_memory,
    open_model,
    rewrite_passes,
    windows_for,
    write_json,
)
from layerdrop.api.drop import drop
from layerdrop.api.evaluate import evaluate, generate_text, harness
from layerdrop.api.export import export
from layerdrop.api.fuse import fuse
from layerdrop.api.harp import harp
from layerdrop.api.inspect import inspect, plot_scores
from layerdrop.api.pipeline import pipeline
from layerdrop.api.plan import Texts as PlanTexts
from layerdrop.api.plan import plan
from layerdrop.api.quantize import quantize
from layerdrop.api.score import score
from layerdrop.runtime.session import RunOptions

__all__ = ["DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN", "RunOptions", "bench", "check", "drop", "evaluate", "export", "fuse",
           "generate_text", "guard_memory", "harness", "harp", "inspect", "open_model", "pipeline", "plan", "PlanTexts",
           "plot_scores", "quantize", "rewrite_passes", "score", "windows_for", "write_json"]
