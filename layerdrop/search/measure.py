"""Measurements that take a graph cut (passes) and run it (runtime): module scores, the hidden states entering
chosen layers, and the calibration means of the mean shift."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerdrop.model_folder import load
from layerdrop.passes.calibration_taps import calibration_model
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import FindResidualsPass, annotated_regions
from layerdrop.passes.graph_cuts import bypass_taps, with_outputs
from layerdrop.passes.unfuse_skip_norm import UnfuseSkipNormPass
from layerdrop.runtime.bench import node_times
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.scoring import ModuleScore, run_scores
from layerdrop.runtime.session import RunOptions
from layerdrop.windows import Windows


def compute_scores(model: ir.Model, folder: Path, windows: Windows, *, options: RunOptions = RunOptions(),
                   progress: bool = True) -> list[ModuleScore]:
    """Score every attention, MLP and block module of `model` (annotated, not modified) on `windows` in ONNX
    Runtime; its external weights are read from `folder`.

    Returns:
        One ModuleScore per module, sorted by layer, then attn, mlp, block.
    """
    calib, rows = calibration_model(model)
    session = options.session(calib, folder=folder)
    return run_scores(session, rows, windows, batch_size=options.batch_size, progress=progress)


def attention_entries(model: ir.Model) -> dict[int, str]:
    """The name of the hidden state entering each attention layer (its region's skip input)."""
    return {r.layer: r.skip.name for r in annotated_regions(model) if r.kind == "attn"}


def hidden_states_at(model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int],
                     options: RunOptions = RunOptions()) -> dict[int, np.ndarray]:
    """The hidden state entering each layer's attention, for every window: {layer: [n, seq, d]}."""
    entries = attention_entries(model)
    names = [entries[layer] for layer in layers]
    session = options.session(with_outputs(model, names), folder=folder)
    unique = list(dict.fromkeys(names))
    parts: dict[str, list[np.ndarray]] = {name: [] for name in unique}
    for row in windows:
        for name, array in zip(unique, session.run(unique, prefill_feed(session, row[None]))):
            parts[name].append(array)
    return {layer: np.concatenate(parts[name]) for layer, name in zip(layers, names)}


def branch_means(model: ir.Model, folder: Path, windows: Windows, layers: list[int],
                 options: RunOptions = RunOptions()) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For each attention layer, the calibration means (float64, [d]) of its branch output, m_B, and of its
    unscaled V·O bypass P (alpha 1), m_P, both on the unmodified model's hidden states (the mean shift's
    constants, see `HarpBypassPass`), over the windows' text tokens (a BOS is left out).

    Two graphs: the model itself, returning each layer's input and branch output; and `bypass_taps`, where each
    bypass reads that layer's input from the first run instead of the rewritten stream.
    """
    layers = sorted(layers)
    regions = {r.layer: r for r in annotated_regions(model) if r.kind == "attn"}
    taps = [name for layer in layers for name in (regions[layer].skip.name, regions[layer].branch_output.name)]
    first = options.session(with_outputs(model, taps), folder=folder)
    bypassed, names = bypass_taps(model, layers)
    second = options.session(bypassed, folder=folder)
    sums = {layer: [0.0, 0.0] for layer in layers}
    for row, real in zip(windows.ids, windows.real):
        arrays = dict(zip(taps, first.run(taps, prefill_feed(first, row[None]))))
        states = {names[layer][0]: arrays[regions[layer].skip.name] for layer in layers}
        outputs = [names[layer][1] for layer in layers]
        projected = dict(zip(outputs, second.run(outputs, prefill_feed(second, row[None], extra=states))))
        for layer in layers:
            sums[layer][0] += arrays[regions[layer].branch_output.name][0, real].astype(np.float64).sum(0)
            sums[layer][1] += projected[names[layer][1]][0, real].astype(np.float64).sum(0)
    tokens = int(windows.real.sum())
    return {layer: (pair[0] / tokens, pair[1] / tokens) for layer, pair in sums.items()}


def branch_ideal(folder: Path, attention_layers: list[int], seq: int, options: RunOptions = RunOptions(),
                 runs: int = 3) -> dict:
    """The profile-based ideal speedup of removing the attention branches of `attention_layers` from the graph in
    `folder` (see `module_ideal`)."""
    return module_ideal(folder, {("attn", layer) for layer in attention_layers}, seq, options, runs)


def module_ideal(folder: Path, modules: set[tuple[str, int]], seq: int, options: RunOptions = RunOptions(),
                 runs: int = 3) -> dict:
    """The profile-based ideal speedup of removing the branches `modules` ((kind, layer), kind attn or mlp) from
    the graph in `folder`: its node time over its node time minus those branches' (ONNX Runtime profile at `seq`
    tokens, `runs` profiled prefills).

    Unlike a comparison of node names, this holds for fused graphs, whose fused nodes are renumbered on every
    rewrite: the branches are found in the graph itself (skip-norms split for the analysis only; their time, a
    norm shared with the next branch, is not counted). For HARP's bypass and a fit it is an upper bound (the V·O
    or fitted MatMul stays).
    """
    _, model = load(folder)
    run_passes(model, [UnfuseSkipNormPass(), FindResidualsPass()])
    times = node_times(folder, seq, runs=runs, options=options)
    removed = sum(times.get(node.name, 0.0) for region in annotated_regions(model)
                  if (region.kind, region.layer) in modules for node in region.branch)
    total = sum(times.values())
    return {"ideal": total / max(total - removed, 1e-9), "removed_share": removed / total if total else 0.0}
