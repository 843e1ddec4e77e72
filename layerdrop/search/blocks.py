"""Block moves: ShortGPT's block drop picks blocks by score; ReplaceMe (Shopkhoev et al., NeurIPS 2025) removes the
run of n consecutive blocks whose input and output hidden states are closest and fits a linear transform in its
place.

ReplaceMe's selection: for each start i, the mean over calibration tokens of 1 - cos(h_i, h_{i+n}), where h_i is
the output of block i (the input of block i+1); the run i+1 .. i+n with the lowest distance goes. Its fit: T
minimizing |M_i T - (h_{i+n} - h_i + M_i)|^2, with M_i block i's MLP output (after a post-feedforward norm, if the
family has one), so that block i with T computes h_{i+n}. Where layerdrop differs from their code: the solve is a
closed-form ridge (float64 normal equations, lambda = ridge * mean(diag(G)), the ridge chosen on validation
windows the fit did not see) rather than their default cosine-loss optimizer or their unregularized least squares;
a BOS is left out of the statistics; and the run may start at block 0 (their code starts at 1 as well).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError, TooFewTokens
from layerdrop.model_folder import copy_model
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.fold_alpha import fold_chain_rules
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, suffix_to_logits, with_outputs
from layerdrop.passes.moves import tidy_passes
from layerdrop.passes.replace_blocks import ReplaceBlocksPass
from layerdrop.passes.token_logprobs import TokenLogprobsPass
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.feeds import prefill_feed
from layerdrop.runtime.session import RunOptions
from layerdrop.search.fit import RIDGES
from layerdrop.search.measure import attention_entries, hidden_states_at
from layerdrop.windows import Windows


def block_outputs(model: ir.Model) -> dict[int, str]:
    """The name of each block's output (its last region's residual sum)."""
    outputs: dict[int, str] = {}
    for region in annotated_regions(model):
        outputs[region.layer] = region.output.name
    return outputs


def replaceme_starts(model: ir.Model, folder: Path, windows: Windows, counts: list[int],
                     options: RunOptions = RunOptions()) -> dict[int, tuple[int, dict]]:
    """ReplaceMe's selection for each of `counts`, from one run of the windows: count -> (the start i whose run
    i+1 .. i+count has the lowest mean 1 - cos(h_i, h_{i+count}), the distance of every candidate start).

    Raises:
        LayerdropError: the model has no run of one of the `counts` blocks after a kept one.
    """
    outputs = block_outputs(model)
    layers = sorted(outputs)
    starts = {count: [i for i in layers if i + count in outputs] for count in counts}
    for count, found in starts.items():
        if not found or count < 1:
            raise LayerdropError(f"no run of {count} blocks to replace: the model has {len(layers)} blocks")
    names = [outputs[i] for i in layers]
    session = options.session(with_outputs(model, names), folder=folder)
    totals = {count: dict.fromkeys(found, 0.0) for count, found in starts.items()}
    tokens = 0
    for row, real in zip(windows.ids, windows.real):
        states = {i: s[0, real].astype(np.float64) for i, s in
                  zip(layers, session.run(names, prefill_feed(session, row[None])))}
        norms = {i: np.linalg.norm(s, axis=-1) for i, s in states.items()}
        for count, found in starts.items():
            for i in found:
                a, b = states[i], states[i + count]
                cos = (a * b).sum(-1) / np.maximum(norms[i] * norms[i + count], 1e-300)
                totals[count][i] += float((1 - cos).sum())
        tokens += int(real.sum())
    chosen = {}
    for count, total in totals.items():
        distances = {i: value / tokens for i, value in total.items()}
        chosen[count] = min(distances, key=lambda i: (distances[i], i)), distances
    return chosen


def run_statistics(model: ir.Model, folder: Path, windows: Windows, runs: list[tuple[int, int]],
                   options: RunOptions = RunOptions()) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]]:
    """For each run (start, count): (G = M^T M, C = M^T (h_{start+count} - h_start + M), tokens) over the windows'
    text tokens, float64, M being block start's MLP output; one run of the windows for all of them.

    Raises:
        LayerdropError: a run does not follow an MLP or goes past the last block.
    """
    regions = annotated_regions(model)
    outputs = block_outputs(model)
    wanted = {}
    for start, count in runs:
        mlp = next((r for r in regions if r.kind == "mlp" and r.layer == start), None)
        if mlp is None or start + count not in outputs:
            raise LayerdropError(f"cannot replace blocks {start + 1}..{start + count}: no such run after an MLP")
        wanted[start, count] = (mlp.branch_output.name, outputs[start], outputs[start + count])
    names = sorted({name for triple in wanted.values() for name in triple})
    session = options.session(with_outputs(model, names), folder=folder)
    found = dict.fromkeys(wanted, (0.0, 0.0, 0))
    for row, real in zip(windows.ids, windows.real):
        states = dict(zip(names, session.run(names, prefill_feed(session, row[None]))))
        for run, triple in wanted.items():
            branch, before, after = (states[name][0, real].astype(np.float64) for name in triple)
            gram, cross, tokens = found[run]
            found[run] = (gram + branch.T @ branch, cross + branch.T @ (after - before + branch),
                          tokens + int(real.sum()))
    return found


def solve_transform(gram: np.ndarray, cross: np.ndarray, ridge: float) -> np.ndarray:
    """T minimizing |M T - target|^2 + lambda |T|^2, lambda = ridge * mean(diag(G))."""
    return np.linalg.solve(gram + ridge * float(np.mean(np.diag(gram))) * np.eye(len(gram)), cross)


def with_replaced_run(model: ir.Model, start: int, count: int, transform: np.ndarray) -> ir.Model:
    """A copy of `model` with blocks start+1 .. start+count replaced by `transform` (caches gone, T folded where it
    is exact), annotated again."""
    from onnxscript.rewriter import RewritePass

    copy = copy_model(model)
    run_passes(copy, [ReplaceBlocksPass(start, count, transform), RewritePass(fold_chain_rules()), *tidy_passes()])
    return copy


@dataclass
class BlockFit:
    """A fitted run: blocks start+1 .. start+count go, `transform` goes into block `start`."""

    start: int
    count: int
    transform: np.ndarray
    ridge: float
    distances: dict = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)


def replaceme(model: ir.Model, folder: Path, windows: Windows, count: int, *, validation: np.ndarray | None = None,
              ridges: tuple[float, ...] = RIDGES, options: RunOptions = RunOptions()) -> BlockFit:
    """ReplaceMe on `model`: its selection and its fit, the ridge chosen on `validation`.

    Raises:
        LayerdropError: no such run, or fewer calibration tokens than the hidden size.
    """
    return replaceme_runs(model, folder, windows, [count], validation=validation, ridges=ridges,
                          options=options)[count]


def replaceme_runs(model: ir.Model, folder: Path, windows: Windows, counts: list[int], *,
                   validation: np.ndarray | None = None, ridges: tuple[float, ...] = RIDGES,
                   options: RunOptions = RunOptions()) -> dict[int, BlockFit]:
    """`replaceme` for several run lengths (count -> its fitted run), each with its own selection: the windows run
    once for all the selections and once for all the fits' statistics. Every ridge's validation perplexity runs from
    the hidden state entering its run's first kept block (the unmodified model's, computed once for every run), since
    the blocks below compute what the unmodified model's do.

    Raises:
        LayerdropError: no such run, or fewer calibration tokens than the hidden size.
    """
    counts = sorted(set(counts))
    starts = replaceme_starts(model, folder, windows, counts, options)
    statistics = run_statistics(model, folder, windows, [(starts[n][0], n) for n in counts], options)
    entering = {}
    if validation is not None:
        entering = hidden_states_at(model, folder, validation, sorted({starts[n][0] for n in counts}), options)
    return {n: _fitted(model, folder, starts[n][0], n, statistics[starts[n][0], n], starts[n][1], validation,
                       entering.get(starts[n][0]), ridges, options) for n in counts}


def _fitted(model: ir.Model, folder: Path, start: int, count: int, statistics: tuple, distances: dict,
            validation: np.ndarray | None, entering: np.ndarray | None, ridges: tuple[float, ...],
            options: RunOptions) -> BlockFit:
    """The run's transform for each ridge, the one with the lowest perplexity on `validation` kept (the middle
    ridge without); each perplexity from the graph after block `start`'s entry, fed `entering` (the hidden state
    there for every validation window).

    Raises:
        TooFewTokens: fewer calibration tokens than the hidden size.
    """
    gram, cross, tokens = statistics
    if tokens < len(gram):
        raise TooFewTokens(f"a fit needs at least {len(gram)} calibration tokens (the hidden size) and the windows "
                           f"hold {tokens}; use more --samples or a longer --seq-len")
    candidates = {ridge: solve_transform(gram, cross, ridge) for ridge in ridges}
    trials = []
    if validation is None:
        chosen = ridges[len(ridges) // 2]
    else:
        scores = {}
        entries = attention_entries(model)
        for ridge, transform in candidates.items():
            graph = suffix_to_logits(with_replaced_run(model, start, count, transform), entries[start])
            TokenLogprobsPass()(graph)
            session = options.session(graph, folder=folder)
            scores[ridge] = perplexity(session, validation, batch_size=options.batch_size,
                                       feed_extra=lambda rows: {HIDDEN_INPUT: entering[rows]}).perplexity
            del session  # freed before the next ridge's is built: one session on the model at a time
            trials.append({"ridge": ridge, "perplexity": scores[ridge]})
        chosen = min(scores, key=lambda r: (scores[r], -r))
    return BlockFit(start, count, candidates[chosen], chosen, distances, trials)
