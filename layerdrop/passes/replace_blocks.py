"""Rewrite pass: ReplaceMe's move -- remove a run of blocks and put a fitted transform in their place.

Blocks start+1 .. start+count are dropped whole, and block `start`'s MLP branch output M is multiplied by a d x d
transform T before its residual Add: block `start` then computes Y_A + M T, which T was fitted to make equal the
output of block start+count (`search.blocks`). The Add reads MatMul(M, T); the `fold_chain_rules` fold T into the
MLP's down-projection wherever M comes straight out of it (Llama, Qwen, Mistral, Phi-3: W_down <- W_down T, no new
parameters), and leave it a MatMul of its own after a post-feedforward norm (Gemma-2/3), where no fold is exact.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.passes._ir_utils import add_initializer
from layerdrop.passes.drop_branches import bypass, expand_targets
from layerdrop.passes.find_residuals import annotated_regions
from layerdrop.passes.metadata import record_removals, removal_record


class ReplaceBlocksPass(ir.passes.InPlacePass):
    """Drop blocks start+1 .. start+count and multiply block `start`'s MLP output by `transform` [d, d].

    Reads the regions `FindResidualsPass` annotated; records the dropped modules (how = "replaced", with the run)
    under `layerdrop.dropped`, so `PruneKvCachePass` removes their caches.

    Raises:
        LayerdropError: the run does not fit the model's blocks, or block `start` has no MLP.
    """

    def __init__(self, start: int, count: int, transform: np.ndarray, reason: str = "replaceme") -> None:
        super().__init__()
        self.start, self.count, self.transform, self.reason = start, count, np.asarray(transform), reason

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        regions = annotated_regions(model)
        if self.count == 0:  # no block to replace: the transform would stand in for nothing
            return ir.passes.PassResult(model, modified=False)
        mlp = next((r for r in regions if r.kind == "mlp" and r.layer == self.start), None)
        if mlp is None:
            raise LayerdropError(f"block {self.start} has no MLP to carry the fitted transform")
        run = [("block", layer) for layer in range(self.start + 1, self.start + 1 + self.count)]
        chosen = expand_targets(regions, run)
        dtype = mlp.skip.dtype.numpy() if mlp.skip.dtype is not None else np.float32
        name = f"layerdrop.replaceme.{self.start}.transform"
        weight = add_initializer(model.graph, name, self.transform.astype(dtype))
        project = ir.node("MatMul", [mlp.branch_output, weight])
        model.graph.insert_before(mlp.add, [project])
        mlp.add.replace_input_with(0 if mlp.add.inputs[0] is mlp.branch_output else 1, project.outputs[0])
        run_label = {"start": self.start, "count": self.count}
        record_removals(model, [removal_record(region, "replaced", self.reason, run=run_label) for region in chosen])
        bypass(chosen)
        return ir.passes.PassResult(model, modified=True)
