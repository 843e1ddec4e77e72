"""Rewrite pass: HARP (SPEC §4) -- replace attention by a rescaled, per-token V·O projection.

For a chosen layer the attention branch becomes  alpha * (Norm(X) W_V') W_O  (+ folded biases), where W_V' repeats
the KV heads to match the query heads. W_V' W_O is one constant d x d matrix. Q, K, rotary, softmax and the
layer's KV cache become dead. A post-attention norm inside the branch (Gemma-2) stays, and alpha multiplies after
it. alpha = 0 removes the branch. The Mul by alpha is folded into the matrix afterwards by `fold_alpha` rules
wherever it directly follows the projection.

Mean shift (the planner's extension, beyond SPEC §4): with the calibration means of the original branch, m_B, and
of the unscaled bypass P (the V·O map, after the post-attention norm if any), m_P, the branch becomes

    alpha * P(X) + (m_B - alpha * m_P)

so on calibration text it keeps the original branch's mean output; alpha = 0 then adds the constant m_B instead
of removing the branch. Both are plain constant Adds; the KV cache goes as without the shift.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import REGION_KEY
from layerdrop.passes._ir_utils import add_initializer, constant_array
from layerdrop.passes.drop_branches import bypass
from layerdrop.passes.find_residuals import PROJECTION_OPS, ResidualRegion, attention_regions
from layerdrop.passes.matmul_nbits import dequantized_weight
from layerdrop.passes.metadata import head_layout_metadata, record_removals, removal_record


def _weight(node: ir.Node) -> np.ndarray | None:
    """The constant [in, out] weight of a MatMul (through a Transpose of a constant, if any), or of an int4
    MatMulNBits read back exactly (float64)."""
    if node.op_type == "MatMulNBits":
        return dequantized_weight(node)
    if node.op_type != "MatMul":
        return None
    value = node.inputs[1]
    constant = constant_array(value)
    if constant is not None:
        return constant
    producer = value.producer()
    if producer is not None and producer.op_type == "Transpose":
        source = constant_array(producer.inputs[0])
        if source is not None:
            return np.transpose(source, producer.attributes.get_ints("perm", None))
    return None


def _bias_after(value: ir.Value) -> tuple[ir.Value, np.ndarray | None]:
    """If `value` is only read by an Add with a constant, return (that Add's output, the constant)."""
    uses = value.uses()
    if len(uses) == 1 and uses[0].node.op_type == "Add":
        add = uses[0].node
        other = constant_array(add.inputs[1 - uses[0].idx])
        if other is not None:
            return add.outputs[0], other
    return value, None


def _reaches(start: ir.Value, targets: set[ir.Node], members: set[ir.Node]) -> bool:
    stack, seen = [use.node for use in start.uses()], set()
    while stack:
        node = stack.pop()
        if node in seen or node not in members:
            continue
        if node in targets:
            return True
        seen.add(node)
        stack.extend(use.node for out in node.outputs for use in out.uses())
    return False


def _constant_ints(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    return None if array is None else [int(v) for v in np.asarray(array).reshape(-1)]


FUSED_ATTENTION = frozenset({"GroupQueryAttention", "MultiHeadAttention", "Attention"})


def _projection_of(value: ir.Value | None, members: set[ir.Node]) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(weight, bias) of the MatMul (+ constant bias Add) in the branch that produces `value`."""
    producer = value.producer() if value is not None else None
    bias = None
    if producer is not None and producer.op_type == "Add" and producer in members:
        for index in (0, 1):
            const = constant_array(producer.inputs[1 - index])
            if const is not None and producer.inputs[index].producer() is not None:
                bias, producer = const, producer.inputs[index].producer()
                break
    if producer is None or producer not in members or _weight(producer) is None:
        return None
    return _weight(producer), bias


def _fused_value_projection(region: ResidualRegion, attention: ir.Node, heads: int, kv_heads: int,
                            head_dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """W_V and its bias for a GroupQueryAttention/MultiHeadAttention op: its value input's projection, or the V
    columns [q | k | v] of the packed qkv projection that feeds its query input alone."""
    members = set(region.branch)
    if attention.op_type == "Attention":
        raise LayerdropError(f"layer {region.layer}: HARP cannot take V out of a com.microsoft Attention op (its "
                             "weights are packed inside); export the model with `layerdrop export` or the builder")
    value = attention.inputs[2] if len(attention.inputs) > 2 else None
    if value is not None:
        found = _projection_of(value, members)
        if found is None:
            raise LayerdropError(f"cannot find the value projection of attention layer {region.layer}; HARP needs it")
        return found
    found = _projection_of(attention.inputs[0], members)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    if found is None or found[0].shape[1] != q_size + 2 * kv_size:
        raise LayerdropError(f"layer {region.layer}: the packed qkv projection does not fit {heads} heads / "
                             f"{kv_heads} KV heads of size {head_dim}; HARP cannot find V")
    weight, bias = found
    columns = slice(q_size + kv_size, q_size + 2 * kv_size)
    return weight[:, columns], None if bias is None else bias[columns]


def _value_projection(region: ResidualRegion, heads: int, kv_heads: int,
                      head_dim: int) -> tuple[np.ndarray, np.ndarray | None]:
    """W_V [d, kv*hd] and its bias, also out of a packed qkv projection (the slice that feeds no Softmax)."""
    fused = [n for n in region.branch if n.op_type in FUSED_ATTENTION]
    if fused:
        return _fused_value_projection(region, fused[0], heads, kv_heads, head_dim)
    members = set(region.branch)
    softmax = {n for n in region.branch if n.op_type == "Softmax"}
    entries = [n for n in region.branch if n.op_type in PROJECTION_OPS and n.inputs[0] is region.norm_output]
    for node in entries:
        weight = _weight(node)
        out, bias = _bias_after(node.outputs[0])
        if weight is not None and not _reaches(out, softmax, members):
            return weight, bias
    for node in entries:
        weight = _weight(node)
        out, bias = _bias_after(node.outputs[0])
        for use in out.uses():
            piece = use.node
            if weight is None or piece.op_type != "Slice" or _reaches(piece.outputs[0], softmax, members):
                continue
            starts, ends = _constant_ints(piece.inputs[1]), _constant_ints(piece.inputs[2])
            axes = _constant_ints(piece.inputs[3]) if len(piece.inputs) > 3 else [-1]
            steps = _constant_ints(piece.inputs[4]) if len(piece.inputs) > 4 else [1]
            rank = len(out.shape) if out.shape is not None else 3
            if None in (starts, ends, axes, steps) or len(starts) != 1 or steps != [1] or axes[0] % rank != rank - 1:
                continue
            width = weight.shape[1]
            begin, end = (max(0, min(v if v >= 0 else v + width, width)) for v in (starts[0], ends[0]))
            return weight[:, begin:end], None if bias is None else bias[begin:end]
    raise LayerdropError(f"cannot find the value projection of attention layer {region.layer}; HARP needs it")


def output_projection(region: ResidualRegion) -> tuple[ir.Node, ir.Value, np.ndarray, np.ndarray | None]:
    """The last weight projection of the branch (W_O), its output value (after its bias) and weights."""
    for node in reversed(region.branch):
        weight = _weight(node)
        if node.op_type in PROJECTION_OPS and weight is not None:
            out, bias = _bias_after(node.outputs[0])
            return node, out, weight, bias
    raise LayerdropError(f"cannot find the output projection of attention layer {region.layer}; HARP needs it")


def head_layout(model: ir.Model) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim): from the metadata written at export, else from the attributes of a
    GroupQueryAttention/MultiHeadAttention op and the width its output projection reads.

    Raises:
        LayerdropError: neither is there.
    """
    recorded = head_layout_metadata(model)
    if recorded is not None:
        return recorded
    for node in model.graph:
        if node.op_type not in ("GroupQueryAttention", "MultiHeadAttention"):
            continue
        heads = node.attributes.get_int("num_heads", 0)
        kv_heads = node.attributes.get_int("kv_num_heads", heads)
        weights = [w for use in node.outputs[0].uses() if (w := _weight(use.node)) is not None]
        if heads and weights:
            return heads, kv_heads, weights[0].shape[0] // heads
    raise LayerdropError("the model has no head layout (no export metadata, no GroupQueryAttention op); "
                         "re-export it with `layerdrop export`")


def expanded_value_projection(region: ResidualRegion, heads: int, kv_heads: int, head_dim: int
                              ) -> tuple[np.ndarray, np.ndarray | None]:
    """W_V' [d, heads * head_dim] and its bias: W_V with each KV head repeated for the query heads that read it,
    so that  Norm(X) W_V'  is what the output projection would read if every token attended only to itself."""
    w_v, b_v = _value_projection(region, heads, kv_heads, head_dim)
    if w_v.shape[1] != kv_heads * head_dim:
        raise LayerdropError(f"layer {region.layer}: V is {w_v.shape[1]} wide, which does not fit {kv_heads} KV "
                             f"heads of size {head_dim}")
    source = np.repeat(np.arange(kv_heads), heads // kv_heads)  # query head h reads KV head h // n_rep
    columns = (source[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)
    return w_v[:, columns], None if b_v is None else b_v[columns]


def folded_vo(region: ResidualRegion, heads: int, kv_heads: int, head_dim: int):
    """(O-projection node, its output value, W_V' W_O [d, d], folded bias or None)."""
    w_v_expanded, b_v_expanded = expanded_value_projection(region, heads, kv_heads, head_dim)
    o_node, o_out, w_o, b_o = output_projection(region)
    if w_o.shape[0] != heads * head_dim:
        raise LayerdropError(f"layer {region.layer}: O reads {w_o.shape[0]} values, which does not fit {heads} heads "
                             f"of size {head_dim}")
    matrix = (w_v_expanded.astype(np.float64) @ w_o.astype(np.float64)).astype(w_o.dtype)
    bias = None
    if b_v_expanded is not None or b_o is not None:
        bias = np.zeros(w_o.shape[1], dtype=np.float64)
        if b_v_expanded is not None:
            bias += b_v_expanded.astype(np.float64) @ w_o.astype(np.float64)
        if b_o is not None:
            bias += b_o.astype(np.float64)
        bias = bias.astype(w_o.dtype)
    return o_node, o_out, matrix, bias


def bypass_attention(graph: ir.Graph, region: ResidualRegion, layout: tuple[int, int, int],
                     alpha: float | ir.Value, means: tuple[np.ndarray, np.ndarray] | None = None,
                     keep: ir.Value | None = None) -> None:
    """Rewrite one attention branch into  alpha * P(X) (+ m_B - alpha * m_P),  P(X) = Norm(X) W_V' W_O + b, after
    the family's post-attention norm if it has one (module docstring).

    `alpha` is a number, or a scalar graph input (a search's); with `keep` (a boolean scalar input) the branch is
    Where(keep, attention, P) and its scale Where(keep, 1, alpha), so one graph computes both the kept layer and
    every alpha of its bypass. This is the one place that writes the map; `HarpBypassPass` and the gated search
    graph both call it.
    """
    o_node, o_out, matrix, bias = folded_vo(region, *layout)
    dtype = region.skip.dtype.numpy() if region.skip.dtype is not None else matrix.dtype  # int4 weights read as float64
    matrix, bias = matrix.astype(dtype), None if bias is None else bias.astype(dtype)
    prefix = f"layerdrop.harp.{region.layer}"
    nodes = [ir.node("MatMul", [region.norm_output, add_initializer(graph, f"{prefix}.vo", matrix)])]
    if bias is not None:
        nodes.append(ir.node("Add", [nodes[-1].outputs[0], add_initializer(graph, f"{prefix}.bias", bias)]))
    projected = nodes[-1].outputs[0]
    graph.insert_before(o_node, nodes)
    readers = [(use.node, use.idx) for use in o_out.uses()]
    if keep is not None:
        chosen = ir.node("Where", [keep, o_out, projected])
        graph.insert_after(o_out.producer(), [chosen])
        projected = chosen.outputs[0]
    for node, index in readers:
        node.replace_input_with(index, projected)
    if o_out.is_graph_output():
        raise LayerdropError(f"layer {region.layer}: the attention output is a graph output; HARP cannot bypass it")
    branch_output = projected if region.branch_output is o_out else region.branch_output

    tail: list[ir.Node] = []

    def add(op: str, *inputs: ir.Value) -> ir.Value:
        tail.append(ir.node(op, list(inputs)))
        return tail[-1].outputs[0]

    if isinstance(alpha, ir.Value):
        scale = alpha
        if keep is not None:
            scale = add("Where", keep, add_initializer(graph, f"{prefix}.one", np.asarray(1.0, dtype=dtype)), alpha)
    else:
        scale = add_initializer(graph, f"{prefix}.alpha", np.asarray(alpha, dtype=dtype))
    result = add("Mul", branch_output, scale)
    if means is not None:  # + (m_B - alpha * m_P)
        branch_mean, bypass_mean = (np.asarray(m, dtype=np.float64) for m in means)
        if isinstance(alpha, ir.Value):
            offset = add("Sub", add_initializer(graph, f"{prefix}.branch_mean", branch_mean.astype(dtype)),
                         add("Mul", add_initializer(graph, f"{prefix}.bypass_mean", bypass_mean.astype(dtype)), alpha))
            if keep is not None:
                offset = add("Where", keep, add_initializer(graph, f"{prefix}.zero", np.asarray(0.0, dtype=dtype)),
                             offset)
        else:
            offset = add_initializer(graph, f"{prefix}.shift", (branch_mean - alpha * bypass_mean).astype(dtype))
        result = add("Add", result, offset)
    graph.insert_before(region.add, tail)
    region.add.replace_input_with(1 - _skip_index(region), result)


def _skip_index(region: ResidualRegion) -> int:
    return 0 if region.add.inputs[0] is region.skip else 1


class HarpBypassPass(ir.passes.InPlacePass):
    """Replace the attention of chosen layers by the rescaled V·O map (`bypass_attention`).

    Args:
        alphas: layer -> alpha in [0, 1]. Alpha 0 removes the branch (or, with the shift, leaves its mean).
        means: layer -> (m_B, m_P) [d] for the layers that get the mean shift (module docstring).

    Reads the regions `FindResidualsPass` annotated; records each layer with its alpha, whether it is shifted,
    and KV entries under model metadata `layerdrop.dropped` (how = "harp").

    Raises:
        LayerdropError: a layer has no attention region, or its V/O projections cannot be located.
    """

    def __init__(self, alphas: dict[int, float], means: dict[int, tuple[np.ndarray, np.ndarray]] | None = None
                 ) -> None:
        super().__init__()
        self.alphas = dict(alphas)
        self.means = dict(means or {})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        regions = attention_regions(model, self.alphas, "bypass")
        layout = head_layout(model)
        entries, removed = [], []
        for layer in sorted(self.alphas, reverse=True):
            region, alpha, means = regions[layer], self.alphas[layer], self.means.get(layer)
            entries.append(removal_record(region, "harp", "harp", alpha=alpha, shift=means is not None))
            if alpha == 0 and means is None:
                removed.append(region)
                continue
            if alpha == 0:  # the shift alone: the branch becomes its calibration mean, a constant
                dtype = region.skip.dtype.numpy() if region.skip.dtype is not None else np.float32
                constant = add_initializer(graph, f"layerdrop.harp.{layer}.mean", means[0].astype(dtype))
                region.add.replace_input_with(1 - _skip_index(region), constant)
                region.add.metadata_props.pop(REGION_KEY, None)
                continue
            bypass_attention(graph, region, layout, alpha, means)
            # Structure alone would call this branch an MLP now; the annotation keeps what it was.
            region.add.metadata_props[REGION_KEY] = json.dumps({**region.annotation(), "kind": "harp"},
                                                               sort_keys=True)
        bypass(sorted(removed, key=lambda r: r.layer))
        record_removals(model, entries)
        return ir.passes.PassResult(model, modified=bool(self.alphas))
