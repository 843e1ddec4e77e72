"""The pass lists that write moves into an annotated graph: the moves themselves, then what every removal ends with
(the removed layers' KV cache pruned, dead code cleaned up, residual regions annotated again). Every caller that
writes moves (a command's rewrite, a search's graph with settled moves, a fit's or a run's copy) builds its list
here, so all of them write the same graph for the same moves."""

from __future__ import annotations

import onnx_ir as ir

from layerdrop.passes.cleanup import cleanup_passes
from layerdrop.passes.drop_branches import DropBranchesPass
from layerdrop.passes.find_residuals import FindResidualsPass
from layerdrop.passes.fit_attention import FitAttentionPass
from layerdrop.passes.fold_alpha import fold_alpha_rules
from layerdrop.passes.harp_bypass import HarpBypassPass
from layerdrop.passes.prune_kv_cache import PruneKvCachePass


def tidy_passes() -> list[ir.passes.PassBase]:
    """What every removal ends with: the removed layers' KV-cache inputs and outputs pruned, cleanup, residual regions
    annotated again."""
    return [PruneKvCachePass(), *cleanup_passes(), FindResidualsPass()]


def move_passes(drops: list[tuple[str, int]] | None = None, *, fits: dict | None = None,
                alphas: dict[int, float] | None = None, means: dict | None = None,
                reason: str = "") -> list[ir.passes.PassBase]:
    """Drops (kind, layer), fitted maps (layer -> FittedMap) and HARP bypasses (layer -> alpha; mean-shifted for the
    layers in `means`, alphas folded into the V·O weights), then `tidy_passes`."""
    from onnxscript.rewriter import RewritePass

    passes: list[ir.passes.PassBase] = []
    if drops:
        passes.append(DropBranchesPass(drops, reason=reason))
    if fits:
        passes.append(FitAttentionPass(fits, reason=reason))
    if alphas:
        passes += [HarpBypassPass(alphas, means), RewritePass(fold_alpha_rules())]
    return passes + tidy_passes()
