"""The search engine: perplexities of move sets over a pool of attention layers, and HARP's greedy alpha search
(SPEC §4) on top of it.

A move set maps layers to alphas (0: dropped, or its mean with the shift); every other pool layer keeps its
attention. All move sets over a pool run in one gated graph per start layer (`passes.gated_search`: keep and
alpha are inputs), cut to start at the hidden state entering that layer (`passes.graph_cuts`), which is computed
once from the unmodified model: layers below the lowest changed one are the original's for every candidate. Moves
that stay fixed while others vary above the start (the layers a greedy search has settled, above the one it
sweeps) can be written into that graph instead of gated (`fixed`), so their attention is not computed at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from layerdrop.errors import LayerdropError
from layerdrop.model_folder import copy_model
from layerdrop.passes.cleanup import run_passes
from layerdrop.passes.fit_attention import FittedMap
from layerdrop.passes.gated_search import GatedBypassPass, GatedFitPass, GatedMixedPass, move_feeds
from layerdrop.passes.graph_cuts import HIDDEN_INPUT, segment, suffix_to_logits
from layerdrop.passes.moves import move_passes
from layerdrop.passes.token_logprobs import TokenLogprobsPass
from layerdrop.runtime.evaluate import perplexity
from layerdrop.runtime.feeds import numpy_type, prefill_feed
from layerdrop.runtime.session import RunOptions
from layerdrop.search.measure import attention_entries, hidden_states_at

ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(11))


class GatedSuffix:
    """Perplexities of move sets over a fixed pool of layers on fixed windows, without a graph per move set: one
    gated suffix session for the current start layer (rebuilt only when the start changes).

    With `fits` (layer -> FittedMap for every pool layer), a moved layer is replaced by its map instead of bypassed
    (`GatedFitPass`; the alphas of the moves are then not read); with `fits` and `mixed`, a move is an alpha or
    `FIT`, so both kinds mix (`GatedMixedPass`, with `means`)."""

    def __init__(self, model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int],
                 means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None, *,
                 fits: dict[int, FittedMap] | None = None, mixed: bool = False,
                 options: RunOptions = RunOptions()) -> None:
        self.model, self.folder, self.windows, self.layers = model, folder, windows, sorted(layers)
        self.means, self.fits, self.options = means, fits, options
        self.mixed = mixed and fits is not None
        self.entries = attention_entries(model)
        unknown = sorted(set(self.layers) - set(self.entries))
        if unknown:
            raise LayerdropError(f"layers {unknown} have no attention to search")
        self.hidden = hidden_states_at(model, folder, windows, self.layers, options)
        self.start: tuple | None = None  # (start layer, fixed moves) of the session
        self.session = None
        self._entered: tuple | None = None  # (layer and moves below it, the state they leave there)

    def _gated(self, start: int, fixed: dict[int, float] | None = None) -> ir.Model:
        """A copy of the model whose pool layers from `start` up are gated, but those of `fixed` (layer -> alpha;
        a bypass search only), which are bypassed at their alpha (mean-shifted where `means` has the layer)."""
        gated = copy_model(self.model)
        fixed = fixed or {}
        moved = [k for k in self.layers if k >= start and k not in fixed]
        if fixed:
            if self.fits is not None:
                raise LayerdropError("fixed moves are bypasses: a search over fits gates every layer")
            means = {k: self.means[k] for k in fixed if k in (self.means or {})} or None
            run_passes(gated, move_passes(alphas=fixed, means=means))
        if self.mixed:
            rewrite = GatedMixedPass({k: self.fits[k] for k in moved}, self.means)
        elif self.fits is not None:
            rewrite = GatedFitPass({k: self.fits[k] for k in moved})
        else:
            rewrite = GatedBypassPass(moved, self.means)
        run_passes(gated, [rewrite])
        return gated

    def _session(self, start: int, fixed: dict[int, float] | None = None):
        key = (start, tuple(sorted((fixed or {}).items())))
        if key != self.start:
            self.session = None  # free the old graph's weights before building the next
            graph = suffix_to_logits(self._gated(start, fixed), self.entries[start])
            TokenLogprobsPass()(graph)  # perplexity from ONNX Runtime's log-softmax, not numpy's
            self.start, self.session = key, self.options.session(graph, folder=self.folder)
        return self.session

    def entering(self, below: dict[int, float | str], layer: int) -> np.ndarray:
        """The hidden state entering pool layer `layer` with the moves `below` (of pool layers under it) applied:
        the windows run once through a gated graph from the lowest of them to `layer` (the last result is kept)."""
        if not below:
            return self.hidden[layer]
        key = (layer, tuple(sorted(below.items())))
        if self._entered is None or self._entered[0] != key:
            self._entered = None
            low = min(below)
            graph = segment(self._gated(low), self.entries[low], [self.entries[layer]])
            session = self.options.session(graph, folder=self.folder)
            feeds = self._move_feeds(session, [k for k in self.layers if low <= k < layer], below)
            parts = []
            batch = self.options.batch_size
            for start in range(0, len(self.windows), batch):
                rows = slice(start, start + batch)
                extra = {**feeds, HIDDEN_INPUT: self.hidden[low][rows]}
                parts += session.run([self.entries[layer]], prefill_feed(session, self.windows[rows], extra=extra))
            self._entered = (key, np.concatenate(parts))
        return self._entered[1]

    @staticmethod
    def _move_feeds(session, layers: list[int], moves: dict) -> dict[str, np.ndarray]:
        """The move inputs of `session` for `moves` over the gated `layers` (those the graph reads)."""
        inputs = {i.name: i.type for i in session.get_inputs()}
        dtype = numpy_type(next((t for n, t in inputs.items() if n.startswith("layerdrop_alpha_")), "tensor(float)"))
        return {k: v for k, v in move_feeds(layers, moves, dtype).items() if k in inputs}

    def perplexity(self, moves: dict[int, float | str], start: int | None = None,
                   below: dict[int, float | str] | None = None, fixed: dict[int, float] | None = None) -> float:
        """Perplexity with `moves` (layer -> alpha, or `FIT` in a mixed search) applied and every other pool layer
        kept, run from the pool layer `start` (default: the lowest moved layer; a fixed start saves building a graph
        per start). With `below` (moves of pool layers under `start`, kept while `moves` vary above), from the state
        they leave at `start` (`entering`), so those layers run once for every move set above them. With `fixed`
        (bypasses of pool layers above the start, layer -> alpha, kept while `moves` vary), those are written into
        the session's graph rather than gated (a session per start and fixed moves)."""
        below, fixed = below or {}, fixed or {}
        unknown = sorted(set(moves) - set(self.layers))
        if unknown:
            raise LayerdropError(f"layers {unknown} are not in the search pool {self.layers}")
        start = min(moves) if start is None else min([start, *moves])
        if any(k >= start for k in below):
            raise LayerdropError(f"moves {sorted(below)} are not all below the start layer {start}")
        if any(k <= start or k in moves for k in fixed):
            raise LayerdropError(f"fixed moves {sorted(fixed)} are not all above the start layer {start} and unmoved")
        session, states = self._session(start, fixed), self.entering(below, start)
        extra = self._move_feeds(session, [k for k in self.layers if k >= start and k not in fixed], moves)
        return perplexity(session, self.windows, batch_size=self.options.batch_size,
                          feed_extra=lambda rows: {**extra, HIDDEN_INPUT: states[rows]}).perplexity


def best_alpha(sweep: dict[float, float]) -> float:
    """The alpha with the lowest perplexity (the smaller alpha on a tie)."""
    return min(sweep, key=lambda alpha: (sweep[alpha], alpha))


@dataclass
class SearchResult:
    """Chosen alphas (layer -> alpha) and every perplexity tried, in search order."""

    alphas: dict[int, float] = field(default_factory=dict)
    trials: list[dict] = field(default_factory=list)


def greedy_alpha_search(model: ir.Model, folder: Path, windows: np.ndarray, layers: list[int], *,
                        grid: tuple[float, ...] = ALPHA_GRID, progress: bool = True, cache: dict | None = None,
                        options: RunOptions = RunOptions()) -> SearchResult:
    """Choose an alpha for each of `layers` in the order given (top-down for HARP) by perplexity on `windows`:
    while a layer is searched, the ones before it keep their chosen alphas and the rest keep their attention.

    `cache` (move set -> perplexity on the same windows) is read and filled, so searches that share it do not
    measure a move set twice (HARP's and a score-selected search share their first sweeps when both start at
    the top layers)."""
    result = SearchResult()
    suffix = GatedSuffix(model, folder, windows, list(layers), options=options)
    cache = {} if cache is None else cache
    bar = tqdm(total=len(layers) * len(grid), desc="alpha search", unit="try", disable=not progress, leave=False)
    for layer in layers:
        sweep = {}
        for alpha in grid:
            moves = {**result.alphas, layer: alpha}
            key = tuple(sorted(moves.items()))
            if key not in cache:  # the layers settled above this one are written into its graph
                settled = {k: a for k, a in result.alphas.items() if k > layer}
                cache[key] = suffix.perplexity({k: a for k, a in moves.items() if k not in settled}, fixed=settled)
            sweep[alpha] = cache[key]
            result.trials.append({"layer": layer, "alpha": alpha, "perplexity": sweep[alpha]})
            bar.set_postfix(layer=layer, best=f"{min(sweep.values()):.2f}")
            bar.update()
        result.alphas[layer] = best_alpha(sweep)
    bar.close()
    return result
