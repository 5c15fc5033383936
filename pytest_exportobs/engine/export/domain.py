"""The dynamic domain an export really has, read back from the ExportedProgram and the ONNX file.

The shape model says which dims should be dynamic; torch decides.  It may prove two dims equal,
restrict a side to even sizes (``height = 2*k``) or turn a dim into a constant.  This module reads
the input shapes torch produced, tells which intended dims became constants, refines the shape
model with what torch proved, and reports the dims of the file actually written.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any

import sympy
import torch

from ...compat.torch_private import sympy_functions
from ...core.onnx_wire import graph_inputs
from ...core.vocabulary import RefinementKind
from ...shapes.dims import Axis, Relation, Variable
from ...shapes.model import ShapeModel
from ...shapes.synthesis import complete_sizes, free_variables
from .integers import holds

Shape = tuple[Any, ...]  # per axis: an int (static) or a sympy expression / ONNX dim name
SAMPLES = 64  # draws of the free sizes a runtime assert must break once to be kept as a condition
TRACED_MINIMUM = 2  # the smallest size a dynamic dim traces at (0 and 1 are special to torch)


@dataclass(frozen=True)
class StaticAxis:
    """An axis the shape model made dynamic and the export made the constant ``value``."""

    variable: Variable
    leaf_name: str
    dim: int
    value: int


def program_shapes(program: torch.export.ExportedProgram) -> list[Shape]:
    """Shape of every tensor input of the program, in order: ints and sympy expressions."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    shapes = []
    for name in program.graph_signature.user_inputs:
        value = nodes[name].meta.get("val") if name in nodes else None
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in value.shape))
    return shapes


def onnx_shapes(path: str | Path) -> list[Shape]:
    """Shape of every input of an ONNX file, in order: ints and dim names (``None`` if unknown)."""
    import onnx

    inputs = [onnx.ValueInfoProto.FromString(serialized) for serialized in graph_inputs(Path(path))]
    return [
        tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in i.type.tensor_type.shape.dim)
        for i in inputs
    ]


def static_axes(shapes: ShapeModel, inputs: list[int], read: list[Shape]) -> list[StaticAxis]:
    """The axes of variables that are constants in ``read`` (the shapes of the graph inputs,
    ``inputs`` the leaves they stand for)."""
    position = {leaf: i for i, leaf in enumerate(inputs)}
    return [
        StaticAxis(var, shapes.aligned.leaf_names[leaf], dim, int(read[position[leaf]][dim]))
        for var in shapes.variables for leaf, dim in var.axes
        if leaf in position and _is_int(read[position[leaf]][dim])
    ]


def upper_bounds(
    shapes: ShapeModel, inputs: list[int], read: list[Shape], ranges: dict[Any, Any]
) -> list[tuple[str, str, int]]:
    """``(variable, symbol, upper)`` for every demanded variable whose axis is a symbol torch
    bounded above (``ranges``: the program's range constraints)."""
    return [(name, symbol, int(bound.upper)) for name, symbol, bound in _bounded(shapes, inputs, read, ranges)
            if math.isfinite(float(bound.upper))]


def lower_bounds(
    shapes: ShapeModel, inputs: list[int], read: list[Shape], ranges: dict[Any, Any]
) -> list[tuple[str, str, int]]:
    """``(variable, symbol, lower)`` for every demanded variable whose axis is a symbol torch
    bounded below past :data:`TRACED_MINIMUM` (sizes 0 and 1 are special to torch, and a dim
    traces from 2)."""
    return [(name, symbol, int(bound.lower)) for name, symbol, bound in _bounded(shapes, inputs, read, ranges)
            if bound.lower > TRACED_MINIMUM]


def _bounded(
    shapes: ShapeModel, inputs: list[int], read: list[Shape], ranges: dict[Any, Any]
) -> list[tuple[str, str, Any]]:
    """``(variable, symbol, range)`` of every demanded variable whose axis is a symbol of the program."""
    position = {leaf: i for i, leaf in enumerate(inputs)}
    found = []
    for var in shapes.variables:
        symbols = {read[position[leaf]][dim] for leaf, dim in var.axes if leaf in position}
        symbol = next((s for s in symbols if isinstance(s, sympy.Symbol)), None)
        bound = ranges.get(symbol) if var.demanded and symbol is not None else None
        if bound is not None:
            found.append((var.name, str(symbol), bound))
    return found


def read_dims(
    shapes: ShapeModel, inputs: list[int], read: list[Shape], names: dict[str, str]
) -> dict[str, dict[str, str]]:
    """``{input: {axis: name}}`` of every axis that is not a constant in ``read``; sympy
    expressions are spelled with the variable names in ``names`` (symbol -> name)."""
    dims: dict[str, dict[str, str]] = {}
    for leaf, shape in zip(inputs, read):
        axes = {str(dim): _spelled(size, names) for dim, size in enumerate(shape) if not _is_int(size)}
        if axes:
            dims[shapes.aligned.leaf_names[leaf]] = axes
    return dims


def deferred_asserts(program: torch.export.ExportedProgram) -> list[sympy.Basic]:
    """The conditions the program checks at run time: its asserts (``Eq(s75, 2*((s75 - 1)//2) +
    2)``) and the upper bounds of its sizes (``s75 <= 16``: a position table at the model's
    declared maximum)."""
    found = []
    for node in program.graph.nodes:
        if node.target is torch.ops.aten._assert_scalar.default and isinstance(node.args[0], torch.fx.Node):
            value = node.args[0].meta.get("val")
            if isinstance(value, torch.SymBool):
                found.append(value.node.expr)
    for symbol, bound in program.range_constraints.items():
        if isinstance(symbol, sympy.Symbol) and math.isfinite(float(bound.upper)):
            found.append(sympy.Le(symbol, int(bound.upper)))
    return found


@dataclass(frozen=True)
class Refinement:
    """What the export established of variable ``name``: ``merge``, the same as variable
    ``value`` (torch proved it); ``scale``, a multiple of ``value`` (torch proved it); ``split``,
    its ``axes`` a length of their own, at most ``value`` (the model's next step holds them at
    torch's bound: a sliding window); ``assert``, the condition ``value`` (a JSON expression tree
    over variables, :func:`conditions`) holds: the program asserts it at run time, the ONNX file
    does not; ``static``, made static while tracing (torch pinned it, a guess: the trace's note
    says where).  JSON (the export cache): ``[kind, name, value]``, and the axes of a split."""

    kind: RefinementKind
    name: str
    value: str | int
    axes: tuple[Axis, ...] = ()

    def to_json(self) -> list[Any]:
        axes = [[[leaf, dim] for leaf, dim in self.axes]] if self.axes else []
        return [str(self.kind), self.name, self.value, *axes]

    @classmethod
    def from_json(cls, data: list[Any]) -> Refinement:
        kind, name, value, *axes = data
        return cls(RefinementKind(kind), name, value, *(tuple((leaf, dim) for leaf, dim in a) for a in axes))


def refinements(
    shapes: ShapeModel, inputs: list[int], read: list[Shape], asserts: Sequence[sympy.Basic] = ()
) -> tuple[dict[str, str], list[Refinement]]:
    """What torch proved or asserts about the variables, from the program's input shapes and
    runtime asserts: variables whose axes share one symbol are equal (``merge``), a variable
    whose axes read ``c*s``, or whose symbol torch asserts to be a multiple of ``c``, is one
    (``scale``).  Also the name of every symbol and expression (for the ONNX axis names)."""
    position = {leaf: i for i, leaf in enumerate(inputs)}
    names: dict[str, str] = {}
    found: list[Refinement] = []
    for var in shapes.variables:
        read_exprs = {read[position[leaf]][dim] for leaf, dim in var.axes if leaf in position}
        exprs = [e for e in read_exprs if isinstance(e, sympy.Expr) and not e.is_number]
        if len(exprs) != 1:
            continue
        expr, scaled = exprs[0], _scaled_symbol(exprs[0])
        if isinstance(expr, sympy.Symbol):
            owner = names.setdefault(str(expr), var.name)
            if owner != var.name:
                found.append(Refinement(RefinementKind.MERGE, var.name, owner))
            elif (divisor := _asserted_divisor(expr, asserts)) is not None:
                found.append(Refinement(RefinementKind.SCALE, var.name, divisor))
        elif scaled is not None:
            symbol, scale = scaled
            names.setdefault(str(symbol), _scaled_name(var.name, scale))
            names.setdefault(str(expr), var.name)
            found.append(Refinement(RefinementKind.SCALE, var.name, scale))
    return names, found


def made_static(before: ShapeModel, after: ShapeModel) -> list[Refinement]:
    """The variables of ``before`` that tracing made static, ``after`` being its shape model."""
    kept = {v.name for v in after.variables}
    return [Refinement(RefinementKind.STATIC, v.name, 0) for v in before.variables if v.name not in kept]


def apply_refinements(shapes: ShapeModel, found: list[Refinement]) -> tuple[ShapeModel, list[str]]:
    """The shape model refined with :func:`refinements`, and one note per refinement (one for
    all conditions)."""
    notes = []
    for refinement in found:
        name = refinement.name
        if refinement.kind == RefinementKind.STATIC:
            shapes = shapes.without(name)
        elif refinement.kind == RefinementKind.MERGE:
            into = str(refinement.value)
            shapes = shapes.merged(name, into=into)
            notes.append(f"torch.export proved {name} = {into}")
        elif refinement.kind == RefinementKind.SPLIT:
            held, limit = _window_name(name), int(refinement.value)
            shapes = shapes.split(name, refinement.axes, held, limit)
            axes = ", ".join(f"{shapes.aligned.leaf_names[leaf]}.{dim}" for leaf, dim in refinement.axes)
            notes.append(f"{held} ({axes}) a length apart from {name}, {held} = min({name}, {limit}): the"
                         f" model's own next step holds those axes at {limit} where the others go past it"
                         " (a sliding window)")
        elif refinement.kind == RefinementKind.SCALE:
            assert isinstance(refinement.value, int)
            scale = refinement.value
            free = _scaled_name(name, scale)
            shapes = shapes.derived(name, Relation(name, (free,), scale=scale))
            notes.append(f"torch.export restricts {name} to multiples of {scale}: {name} = {scale}*{free}")
    if asserted := conditions(found):
        notes.append(f"torch.export asserts {'; '.join(map(str, asserted))} at run time, the ONNX file does not"
                     " check it: variations keep within it")
    return shapes, notes


def asserted_conditions(
    shapes: ShapeModel, names: Mapping[str, str], asserts: Sequence[sympy.Basic],
) -> list[Refinement]:
    """The program's runtime asserts on the sizes of input axes that exclude sizes the shape model
    allows, as conditions on its variables (``names``: the variable of each symbol, as
    :func:`refinements` and the export name them; ``Eq((height//5)*(width//5), 16)``: a vision
    model's grid of patches).  Left out: those that hold on every one of :data:`SAMPLES` draws of
    the free sizes from 2 to 64 (torch's ``Ne(batch, 1)``, a relation the shape model has), and
    those made of functions :func:`conditions` cannot read back."""
    draws = Random(0)
    free = free_variables(shapes)
    samples = [complete_sizes(shapes, {name: draws.randint(2, 64) for name in free}) for _ in range(SAMPLES)]
    found = []
    for condition in asserts:
        if not condition.free_symbols or (condition := _named(condition, names)) is None:
            continue
        if all(satisfied([condition], sizes) for sizes in samples) or _holds_by(condition, asserts, names):
            continue
        if (tree := _tree(condition)) is not None:
            found.append(Refinement(RefinementKind.ASSERT, "", json.dumps(tree)))
    return found


def _holds_by(condition: sympy.Basic, asserts: Sequence[sympy.Basic], names: Mapping[str, str]) -> bool:
    """Whether ``condition`` is a conjunction of other asserted conditions (torch 2.15 asserts
    ``(height >= 5) & (width >= 5)`` beside each of its terms)."""
    if not isinstance(condition, sympy.And):
        return False
    named = {a.xreplace({s: sympy.Symbol(names.get(str(s), str(s)), integer=True) for s in a.free_symbols})
             for a in asserts}
    return all(term in named for term in condition.args)


def conditions(found: Sequence[Refinement]) -> list[sympy.Basic]:
    """The conditions of the ``assert`` refinements among ``found``."""
    return [expression(str(r.value)) for r in found if r.kind == RefinementKind.ASSERT]


def output_elements(program: torch.export.ExportedProgram, names: Mapping[str, str]) -> str:
    """How many elements the program's tensor outputs hold together, as a function of the
    variables (``names``: the variable of each symbol), the JSON text :func:`expression` reads;
    ``""`` when a size is of a symbol no variable names (data-dependent) or of a function
    :func:`_tree` does not know."""
    nodes = {n.name: n for n in program.graph.nodes}
    total = sympy.Integer(0)
    for name in program.graph_signature.user_outputs:
        value = nodes[name].meta.get("val") if isinstance(name, str) and name in nodes else None
        if isinstance(value, torch.Tensor):
            total += sympy.Mul(*(d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d) for d in value.shape))
    named = _named(total, names)
    tree = None if named is None else _tree(named)
    return "" if tree is None else json.dumps(tree)


def _named(expr: sympy.Basic, names: Mapping[str, str]) -> sympy.Basic | None:
    """``expr`` with each symbol replaced by its variable (``names``); ``None`` when a symbol has none."""
    if not {str(s) for s in expr.free_symbols} <= names.keys():
        return None
    return expr.xreplace({s: sympy.Symbol(names[str(s)], integer=True) for s in expr.free_symbols})


def satisfied(conditions: Sequence[sympy.Basic], sizes: Mapping[str, int]) -> bool:
    """Whether ``sizes`` (per variable) meet every condition (one on a variable ``sizes`` lacks counts as met)."""
    return all(holds(c, sizes) for c in conditions if {str(s) for s in c.free_symbols} <= sizes.keys())


def _tree(expr: sympy.Basic) -> Any:
    """``expr`` as nested JSON lists (``["Equality", ["Mul", ...], 16]``, a variable ``["Symbol",
    name]``); ``None`` when it holds a function :func:`expression` does not know."""
    if isinstance(expr, sympy.Symbol):
        return ["Symbol", expr.name]
    if isinstance(expr, sympy.Integer):
        return int(expr)
    function = type(expr)
    if _functions().get(function.__name__) is not function:
        return None
    args = [_tree(arg) for arg in expr.args]
    return None if any(arg is None for arg in args) else [function.__name__, *args]


def expression(text: str) -> sympy.Basic:
    """The condition or size a :func:`_tree` JSON text spells."""

    def build(node: Any) -> Any:
        if isinstance(node, int):
            return sympy.Integer(node)
        name, *args = node
        if name == "Symbol":
            return sympy.Symbol(args[0], integer=True)
        return _functions()[name](*map(build, args))

    return build(json.loads(text))


@functools.cache
def _functions() -> dict[str, type]:
    """What a condition is made of: sympy's arithmetic, relations and logic, and torch's functions."""
    return {**{cls.__name__: cls for cls in (
        sympy.Add, sympy.Mul, sympy.Pow, sympy.Mod, sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge,
        sympy.And, sympy.Or, sympy.Not)}, **sympy_functions()}


def _window_name(name: str) -> str:
    """The variable a sliding window's axes of variable ``name`` become."""
    return f"{name}_window"


def _scaled_name(name: str, scale: int) -> str:
    return f"{name}_half" if scale == 2 else f"{name}_div{scale}"


def _asserted_divisor(symbol: sympy.Symbol, asserts: Sequence[sympy.Basic]) -> int | None:
    """The smallest ``c`` such that, from the first size the asserts on ``symbol`` alone allow,
    no other size than multiples of ``c`` passes them and most multiples do (what a stride-2
    layer with a skip connection asserts).  A lower bound or a few sizes excluded
    (``Ne(s//20, 2)``, from a convolution's output length) make no divisor."""
    own = [a for a in asserts if a.free_symbols == {symbol}]
    if not own:
        return None

    def holds(size: int) -> bool:
        return all(bool(a.subs(symbol, size)) for a in own)

    start = next((size for size in range(2, 1024) if holds(size)), None)
    if start is None:
        return None
    for divisor in (2, 3, 4, 8, 16, 32):
        window = range(start, start + 16 * divisor)
        multiples = [size for size in window if size % divisor == 0]
        if not any(holds(size) for size in window if size % divisor) and (
                4 * sum(map(holds, multiples)) >= 3 * len(multiples)):
            return divisor
    return None


def _scaled_symbol(expr: sympy.Expr) -> tuple[sympy.Symbol, int] | None:
    """``(s, c)`` when ``expr`` is ``c*s`` with an integer ``c > 1``."""
    if isinstance(expr, sympy.Mul) and len(expr.args) == 2:
        number, symbol = sorted(expr.args, key=lambda a: not a.is_number)
        if number.is_Integer and int(number) > 1 and isinstance(symbol, sympy.Symbol):
            return symbol, int(number)
    return None


def _spelled(size: Any, names: dict[str, str]) -> str:
    if not isinstance(size, sympy.Expr):
        return str(size)
    if str(size) in names:
        return names[str(size)]
    return str(size.subs({s: sympy.Symbol(names[str(s)]) for s in size.free_symbols if str(s) in names}))


def _is_int(size: Any) -> bool:
    return isinstance(size, int) or (isinstance(size, sympy.Expr) and size.is_number)
