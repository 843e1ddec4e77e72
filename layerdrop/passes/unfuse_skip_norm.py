"""Split ONNX Runtime's fused skip-norms into the residual Add and the norm, so every pass sees the residual.

Graphs from onnxruntime-genai's model builder (and ORT-optimized graphs) hide each residual Add inside a
`SkipSimplifiedLayerNormalization` or `SkipLayerNormalization` (com.microsoft): output 0 is Norm(input + skip
[+ bias]), output 3 the sum itself. This pass rewrites each into `Add` (+ bias) followed by
`SimplifiedLayerNormalization` or `LayerNormalization` with the same gamma, beta and epsilon. The result computes the
same values. A folder layerdrop writes keeps them split (ONNX Runtime's CPU provider does not fuse them back by
itself), unless `--fuse` applies ONNX Runtime's fusions, which restores the fused form.
"""

from __future__ import annotations

import onnx_ir as ir

from layerdrop.errors import LayerdropError

FUSED = {"SkipSimplifiedLayerNormalization": "SimplifiedLayerNormalization",
         "SkipLayerNormalization": "LayerNormalization"}


class UnfuseSkipNormPass(ir.passes.InPlacePass):
    """Replace every com.microsoft Skip(Simplified)LayerNormalization by Add + the plain norm.

    Raises:
        LayerdropError: a skip-norm's mean or inverse-variance output (training outputs 1 and 2) is used.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type not in FUSED or node.domain != "com.microsoft":
                continue
            for index in (1, 2):
                if len(node.outputs) > index and (node.outputs[index].uses() or node.outputs[index].is_graph_output()):
                    raise LayerdropError(f"{node.name}: output {index} (a training statistic) is used; layerdrop "
                                         "cannot split this skip-norm")
            simplified = node.op_type == "SkipSimplifiedLayerNormalization"
            inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
            residual, skip, gamma = inputs[0], inputs[1], inputs[2]
            beta, bias = (None, inputs[3]) if simplified else (inputs[3], inputs[4])
            epsilon = node.attributes.get_float("epsilon", 1e-5)
            new_nodes = []
            if bias is not None:
                biased = ir.node("Add", [skip, bias], name=f"{node.name}/layerdrop_bias")
                new_nodes.append(biased)
                skip = biased.outputs[0]
            total = ir.node("Add", [residual, skip], name=f"{node.name}/layerdrop_residual")
            norm_inputs = [total.outputs[0], gamma] + ([] if simplified or beta is None else [beta])
            norm = ir.node(FUSED[node.op_type], norm_inputs, attributes={"axis": -1, "epsilon": epsilon},
                           name=f"{node.name}/layerdrop_norm")
            new_nodes += [total, norm]
            graph.insert_before(node, new_nodes)
            pairs = [(node.outputs[0], norm.outputs[0])]
            if len(node.outputs) > 3:
                pairs.append((node.outputs[3], total.outputs[0]))
            names = []
            for old, new in pairs:
                names.append((new, old.name, old.shape, old.type))
                if old.is_graph_output():
                    graph.outputs[graph.outputs.index(old)] = new
                old.replace_all_uses_with(new)
            graph.remove(node, safe=True)
            for new, name, shape, type_ in names:
                new.name, new.shape, new.type = name, shape, type_
            modified = True
        if modified:
            model.opset_imports.setdefault("", 17)
        return ir.passes.PassResult(model, modified=modified)
