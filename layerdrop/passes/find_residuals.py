"""Analysis pass: find every residual region of a decoder graph and annotate its residual Add.

A residual region (SPEC §1) is a skip input X, a residual Add, and the branch: every node on a path from X to
the Add's other operand. Regions are found from graph structure alone; the exporter's provenance metadata
(`pkg.torch.onnx.name_scopes`) is only a cross-check for layer indices, so graphs from other exporters and
graphs with their metadata stripped give the same result.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx_ir as ir

from layerdrop.errors import LayerdropError
from layerdrop.formats import NUM_LAYERS_KEY, REGION_KEY, SCOPES_KEY
from layerdrop.passes._ir_utils import constant_array

ATTENTION_OPS = frozenset({"Softmax", "Attention", "MultiHeadAttention", "GroupQueryAttention"})
# Kinds of attention regions a rewrite replaced by a per-token map: structure alone would call them MLPs.
REPLACED_ATTENTION = ("harp", "fit")
PROJECTION_OPS = frozenset({"MatMul", "Gemm", "MatMulNBits", "FusedMatMul"})
_LAYER_SCOPE = re.compile(r"layers\.(?:slice\([^)]*\)\.)?(\d+)$")


@dataclass
class ResidualRegion:
    """One residual sublayer: Y = X + branch(X)."""

    kind: str  # "attn", "mlp", or what replaced an attention layer: "harp" (HARP's map), "fit" (a fitted map)
    layer: int
    add: ir.Node
    skip: ir.Value  # X
    branch_output: ir.Value  # the Add's other operand
    branch: list[ir.Node] = field(repr=False)
    norm_output: ir.Value | None  # the normalized X the branch's first projections read
    kv_inputs: list[str]
    kv_outputs: list[str]

    @property
    def output(self) -> ir.Value:
        """Y, the residual sum."""
        return self.add.outputs[0]

    def annotation(self) -> dict:
        return {
            "kind": self.kind,
            "layer": self.layer,
            "skip": self.skip.name,
            "skip_input": 0 if self.add.inputs[0] is self.skip else 1,
            "norm_output": self.norm_output.name if self.norm_output is not None else None,
            "branch_nodes": len(self.branch),
            "kv_inputs": self.kv_inputs,
            "kv_outputs": self.kv_outputs,
        }


# An initializer behind a graph input still marks which operand is the weight, so it counts here.
def _is_constant(value: ir.Value | None) -> bool:
    return value is None or value.is_initializer() or constant_array(value) is not None


def _ancestors(value: ir.Value, stop_before: int, order: dict[ir.Node, int]) -> set[ir.Node]:
    """Nodes that `value` depends on, not searching past nodes that come before position `stop_before`."""
    seen: set[ir.Node] = set()
    stack = [value.producer()]
    while stack:
        node = stack.pop()
        if node is None or node in seen or order[node] < stop_before:
            continue
        seen.add(node)
        stack.extend(inp.producer() for inp in node.inputs if inp is not None)
    return seen


def _branch_nodes(skip: ir.Value, other: ir.Value, order: dict[ir.Node, int]) -> list[ir.Node]:
    """Nodes on a path from `skip` to `other`, or [] when `other` does not depend on `skip`."""
    start = order[skip.producer()] if skip.producer() is not None else -1
    upstream = _ancestors(other, start, order)
    if not upstream:
        return []
    reached: set[ir.Node] = set()
    frontier = [use.node for use in skip.uses() if use.node in upstream]
    while frontier:
        node = frontier.pop()
        if node in reached:
            continue
        reached.add(node)
        for out in node.outputs:
            frontier.extend(use.node for use in out.uses() if use.node in upstream)
    if other.producer() not in reached:
        return []
    return sorted(reached, key=order.__getitem__)


def _has_weight_projection(nodes: Iterable[ir.Node]) -> bool:
    return any(
        node.op_type in PROJECTION_OPS and any(_is_constant(inp) for inp in node.inputs[1:]) for node in nodes
    ) or any(node.op_type in ATTENTION_OPS - {"Softmax"} for node in nodes)


def _norm_output(branch: list[ir.Node]) -> ir.Value | None:
    """The activation read by the branch's first weight projections: the branch's normalized input."""
    members = set(branch)
    projections = {n for n in branch if n.op_type in PROJECTION_OPS and _is_constant(n.inputs[1])}
    for node in branch:
        if node not in projections:
            continue
        seen: set[ir.Node] = set()
        stack = [node.inputs[0].producer()]
        while stack:
            current = stack.pop()
            if current is None or current in seen or current not in members:
                continue
            seen.add(current)
            stack.extend(inp.producer() for inp in current.inputs if inp is not None)
        if not seen & projections:
            return node.inputs[0]
    return None


def _provenance_layer(node: ir.Node) -> int | None:
    scopes = node.metadata_props.get(SCOPES_KEY)
    if not scopes:
        return None
    try:  # torch.onnx writes a Python list literal ("['', 'model', ...]"); other writers a JSON list or CSV
        entries = ast.literal_eval(scopes) if scopes.startswith("[") else scopes.split(",")
    except (ValueError, SyntaxError):
        return None
    for entry in reversed(entries if isinstance(entries, list) else []):
        match = _LAYER_SCOPE.search(str(entry).strip())
        if match:
            return int(match.group(1))
    return None


def find_residual_regions(graph: ir.Graph) -> list[ResidualRegion]:
    """Find the residual regions of `graph`, in graph order, with kinds and layer indices from structure.

    Raises:
        LayerdropError: the graph has no residual regions (it is not a transformer decoder).
    """
    order = {node: i for i, node in enumerate(graph)}
    regions: list[ResidualRegion] = []
    for node in graph:
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        if _is_constant(a) or _is_constant(b):
            continue
        for skip, other in ((a, b), (b, a)):
            branch = _branch_nodes(skip, other, order)
            if branch and _has_weight_projection(branch):
                kind = "attn" if any(n.op_type in ATTENTION_OPS for n in branch) else "mlp"
                if _recorded(node).get("kind") in REPLACED_ATTENTION:
                    kind = _recorded(node)["kind"]  # an attention layer turned into a per-token map
                regions.append(
                    ResidualRegion(kind, -1, node, skip, other, branch, _norm_output(branch), [], [])
                )
                break
    regions = _residual_stream(regions)
    if not regions:
        raise LayerdropError("no residual regions found: this graph does not look like a transformer decoder")
    _assign_layers(regions)
    _assign_kv(graph, regions)
    return regions


def _residual_stream(candidates: list[ResidualRegion]) -> list[ResidualRegion]:
    """Keep the longest chain of candidates in which each region's skip input is the previous region's sum.

    Other "X + f(X)" Adds exist (an attention-mask Add, whose mask feeds every later layer, looks like one);
    only the residual stream chains through every block.
    """
    by_skip: dict[ir.Value, list[ResidualRegion]] = {}
    for region in candidates:
        by_skip.setdefault(region.skip, []).append(region)
    longest: dict[int, list[ResidualRegion]] = {}
    for region in reversed(candidates):  # graph order: successors come later
        best: list[ResidualRegion] = []
        for successor in by_skip.get(_through_constant_adds(region.output), []):
            chain = longest.get(id(successor), [])
            if len(chain) > len(best):
                best = chain
        longest[id(region)] = [region, *best]
    return max(longest.values(), key=len, default=[])


def _through_constant_adds(value: ir.Value) -> ir.Value:
    """The stream value after any Adds of a constant that it alone feeds (a branch replaced by its mean)."""
    while len(uses := value.uses()) == 1:
        node = uses[0].node
        other = node.inputs[1 - uses[0].idx] if node.op_type == "Add" and len(node.inputs) == 2 else None
        if other is None or not _is_constant(other) or value.is_graph_output():
            break
        value = node.outputs[0]
    return value


def _recorded(node: ir.Node) -> dict:
    """The annotation an earlier analysis left on this Add ({} if none or unreadable)."""
    try:
        recorded = json.loads(node.metadata_props.get(REGION_KEY, "{}"))
    except json.JSONDecodeError:
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _layer_hint(node: ir.Node) -> int | None:
    """The layer an earlier analysis recorded on this Add (stable across drops), else the exporter's provenance."""
    layer = _recorded(node).get("layer")
    if isinstance(layer, int):
        return layer
    return _provenance_layer(node)


def _assign_layers(regions: list[ResidualRegion]) -> None:
    """A layer starts at each attention region, and at an MLP region that follows another MLP region.

    Structure alone cannot see a whole block that was removed; where every region carries a consistent hint
    (an earlier annotation or the exporter's provenance), the hints win.
    """
    layer = -1
    previous = None
    for region in regions:
        if region.kind in ("attn", *REPLACED_ATTENTION) or previous in (None, "mlp"):
            layer += 1
        region.layer = layer
        previous = region.kind
    hints = [_layer_hint(r.add) for r in regions]
    if all(h is not None for h in hints) and hints != [r.layer for r in regions]:
        pairs = [(h, r.kind) for h, r in zip(hints, regions)]
        if len(set(pairs)) == len(pairs) and hints == sorted(hints):
            for hint, region in zip(hints, regions):
                region.layer = hint


def _assign_kv(graph: ir.Graph, regions: list[ResidualRegion]) -> None:
    """An attention branch owns the graph inputs it reads alone (not its skip input, which the first layer may take
    straight from a graph input) and the graph outputs it produces."""
    readers: dict[str, set[int]] = {}
    for index, region in enumerate(regions):
        for node in region.branch:
            for inp in node.inputs:
                if inp is not None and inp.is_graph_input():
                    readers.setdefault(inp.name, set()).add(index)
    input_names = [v.name for v in graph.inputs]
    output_names = [v.name for v in graph.outputs]
    for index, region in enumerate(regions):
        if region.kind != "attn":
            continue
        owned = {name for name, who in readers.items() if who == {index} and name != region.skip.name}
        region.kv_inputs = [name for name in input_names if name in owned]
        produced = {out.name for node in region.branch for out in node.outputs}
        region.kv_outputs = [name for name in output_names if name in produced]


class FindResidualsPass(ir.passes.InPlacePass):
    """Analysis: annotate each residual Add with its region (kind, layer, which input is the skip, norm output,
    KV inputs/outputs) under node metadata `layerdrop.region`, and the layer count under model metadata
    `layerdrop.num_layers`. It changes nothing else, and reports `modified` only when an annotation changed, so
    running it twice is a no-op. Rewrite passes read these annotations (`annotated_regions`).

    Raises:
        LayerdropError: the graph has no residual regions.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = _annotations(model)
        regions = find_residual_regions(model.graph)
        for node in model.graph:
            node.metadata_props.pop(REGION_KEY, None)
        for region in regions:
            region.add.metadata_props[REGION_KEY] = json.dumps(region.annotation(), sort_keys=True)
        model.metadata_props[NUM_LAYERS_KEY] = str(regions[-1].layer + 1)
        return ir.passes.PassResult(model, modified=_annotations(model) != before)


def _annotations(model: ir.Model) -> tuple:
    return (model.metadata_props.get(NUM_LAYERS_KEY),
            tuple((node.name, node.metadata_props[REGION_KEY]) for node in model.graph
                  if REGION_KEY in node.metadata_props))


def annotated_regions(model: ir.Model) -> list[ResidualRegion]:
    """The regions `FindResidualsPass` annotated, rebuilt from the annotated Adds (in graph order).

    Each region's skip input is the Add input the annotation names; its branch is every node on a path from it to
    the Add's other input, as the analysis defined it, so a rewrite that rewired a skip input (a drop before it)
    still finds the branch.

    Raises:
        LayerdropError: the model carries no annotations (run `FindResidualsPass` first).
    """
    order = {node: i for i, node in enumerate(model.graph)}
    regions = []
    for node in model.graph:
        recorded = _recorded(node)
        if not recorded or "skip_input" not in recorded:
            continue
        skip, other = node.inputs[recorded["skip_input"]], node.inputs[1 - recorded["skip_input"]]
        branch = _branch_nodes(skip, other, order)
        if not branch:
            raise LayerdropError(f"the annotation of {node.name} no longer matches the graph; run FindResidualsPass "
                                 "again after rewriting")
        regions.append(ResidualRegion(recorded["kind"], recorded["layer"], node, skip, other, branch,
                                      _norm_output(branch), recorded.get("kv_inputs", []),
                                      recorded.get("kv_outputs", [])))
    if not regions:
        raise LayerdropError("the model has no residual-region annotations; run FindResidualsPass on it first")
    return regions


def attention_regions(model: ir.Model, layers, what: str) -> dict[int, ResidualRegion]:
    """The annotated attention regions of `layers` (layer -> region), for a rewrite that will `what` them.

    Raises:
        LayerdropError: a layer has no attention region (or no annotations at all).
    """
    regions = {r.layer: r for r in annotated_regions(model) if r.kind == "attn"}
    missing = sorted(set(layers) - set(regions))
    if missing:
        raise LayerdropError(f"no attention to {what} in layer(s) {missing}: the model's attention layers are "
                             f"{sorted(regions)}")
    return regions
