"""onnxscript's private names: the rewrite rules its optimizer applies (``ONNXProgram.optimize``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def rules_tried_by_root_op() -> Iterator[None]:
    """onnxscript's rewriter, for the block, trying a rule at a node only when the node has the op
    type and domain of the node the rule's pattern ends with.

    The rewriter tries each rule at every node; a try builds a match state, and a pattern with
    several output nodes indexes the whole graph by op first.  Its matcher's first check is that
    op (``NodePattern.matches`` on the pattern's first output node), where all tries but a few
    fail: made before the try, the same check rewrites the same graph, in a third of the time
    (tiny Llama, GPT-2, BERT).  Rules whose end node's op or domain is not one fixed string, or
    whose matcher is not onnxscript's ``SimplePatternMatcher``, are tried as before."""
    from onnxscript.rewriter import _matcher, _pattern_ir, _rewrite_rule

    def root_op(rule: Any) -> tuple[str, str] | None:
        ends = rule._target_pattern.output_nodes
        if type(rule._matcher) is not _matcher.SimplePatternMatcher or not ends:
            return None
        op, domain = ends[0].op, ends[0].domain
        if isinstance(op, _pattern_ir.StringConstantPattern) and isinstance(domain, _pattern_ir.StringConstantPattern):
            return op.value(), domain.value()
        return None

    rule_class = _rewrite_rule.RewriteRule
    try_rewrite = rule_class.try_rewrite
    roots: dict[Any, tuple[str, str] | None] = {}

    def tried_at_its_root_op(rule: Any, model: Any, graph_or_function: Any, node: Any, *,
                             verbose: int | None = None, tracer: Any = None) -> Any:
        if rule not in roots:
            roots[rule] = root_op(rule)
        root = roots[rule]
        if root is not None and tracer is None and (node.op_type, node.domain) != root:
            return None
        return try_rewrite(rule, model, graph_or_function, node, verbose=verbose, tracer=tracer)

    rule_class.try_rewrite = tried_at_its_root_op  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        rule_class.try_rewrite = try_rewrite  # type: ignore[method-assign]
