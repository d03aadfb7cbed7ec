"""Mutation operators the judge adds to cosmic-ray's, written as cosmic-ray operators.

Each class follows ``cosmic_ray.operators.operator.Operator``: ``mutation_positions(node)``
yields one position per mutant it can make of a parso node, and ``mutate(node, index)``
returns the node that replaces it (``None``: the node is removed). ``mutants.py`` applies
them exactly as it applies cosmic-ray's own operators.

cosmic-ray 8.7 has no operator for these, and a learner makes each of these mistakes:
an operand dropped from ``and`` / ``or``; ``in`` for ``not in``; ``+=`` written ``=`` (or
``-=``); a string or ``None`` constant changed; a keyword argument forgotten or given
another value; the wrong exception raised; a return value lost; a statement left out.
``ExceptClauseReplacer`` stands in for cosmic-ray's ``ExceptionReplacer``, which writes the
name ``CosmicRayTestingException`` into the handler: that name exists only inside
cosmic-ray's own runner, so in a graded copy of course_lib the handler would raise
``NameError`` instead of simply not matching. Here the handler catches ``()``: nothing.

New code is put in as a leaf that holds the code's text (``_code``): the tree is only
printed back (``get_code``) and the result compiled, never walked again.
"""
from __future__ import annotations

from parso.python.tree import Keyword, Name, Operator as OperatorLeaf

from cosmic_ray.operators.operator import Example, Operator


def _code(text: str, like) -> Name:
    """A leaf printing ``text`` where ``like`` was, with ``like``'s leading whitespace."""
    return Name(text, like.start_pos, prefix=like.get_first_leaf().prefix)


def _is_keyword_argument(node) -> bool:
    return (node.type == "argument" and len(node.children) == 3
            and isinstance(node.children[1], OperatorLeaf) and node.children[1].value == "=")


class DropOperand(Operator):
    """``a and b and c`` made ``b and c``, ``a and c``, ``a and b`` (``or`` alike): one operand dropped."""

    def mutation_positions(self, node):
        if node.type in ("and_test", "or_test"):
            for operand in node.children[::2]:
                yield (operand.start_pos, operand.end_pos)

    def mutate(self, node, index):
        operands = node.children[::2]
        kept = operands[:index] + operands[index + 1:]
        # The rest keeps its place in the grammar (an ``and_test`` stays one), so no parentheses.
        return _code(f" {node.children[1].value} ".join(o.get_code(include_prefix=False) for o in kept), node)

    @classmethod
    def examples(cls):
        return (Example("x = a and b", "x = b"), Example("x = a and b", "x = a", occurrence=1),
                Example("x = a or b or c", "x = a or c", occurrence=1))


class ReplaceMembership(Operator):
    """``in`` made ``not in`` and back (cosmic-ray's comparison operators leave these out)."""

    def mutation_positions(self, node):
        if node.type == "comparison":
            for op in node.children[1::2]:
                if op.get_code(include_prefix=False) in ("in", "not in"):
                    yield (op.start_pos, op.end_pos)

    def mutate(self, node, index):
        ops = [op for op in node.children[1::2] if op.get_code(include_prefix=False) in ("in", "not in")]
        op = ops[index]
        new = "not in" if op.get_code(include_prefix=False) == "in" else "in"
        node.children[node.children.index(op)] = _code(new, op)
        return node

    @classmethod
    def examples(cls):
        return (Example("x in y", "x not in y"), Example("x not in y", "x in y"))


# Each augmented assignment's partner: the operation a slip of the hand gives instead.
AUGMENTED_PARTNER = {"+=": "-=", "-=": "+=", "*=": "/=", "/=": "*=", "//=": "/=", "%=": "//=", "**=": "*=",
                     "<<=": ">>=", ">>=": "<<=", "&=": "|=", "|=": "&=", "^=": "|=", "@=": "*="}


class ReplaceAugmentedAssignment(Operator):
    """``x += y`` made ``x = y`` (the old value lost), and ``x -= y`` (the partner operation)."""

    def mutation_positions(self, node):
        if isinstance(node, OperatorLeaf) and node.value in AUGMENTED_PARTNER and node.parent.type == "expr_stmt":
            yield (node.start_pos, node.end_pos)
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        node.value = "=" if index == 0 else AUGMENTED_PARTNER[node.value]
        return node

    @classmethod
    def examples(cls):
        return (Example("x += 1", "x = 1"), Example("x += 1", "x -= 1", occurrence=1))


class ReplaceStringConstant(Operator):
    """A string constant changed: ``"ab"`` made ``"XXabXX"`` and ``""`` (an empty one made
    ``"XX"``); an f-string gets the ``XX`` marks around its text. Docstrings are left alone."""

    def mutation_positions(self, node):
        if node.type == "string" and not _is_docstring(node):
            yield (node.start_pos, node.end_pos)
            if _string_body(node.value)[1]:
                yield (node.start_pos, node.end_pos)
        elif node.type == "fstring":
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        if node.type == "fstring":
            start, end = node.children[0], node.children[-1]
            inner = "".join(c.get_code() for c in node.children[1:-1])
            return _code(f"{start.value}XX{inner}XX{end.value}", node)
        head, body, tail = _string_body(node.value)
        node.value = head + ("XX" + body + "XX" if index == 0 else "") + tail
        return node

    @classmethod
    def examples(cls):
        return (Example('x = "ab"', 'x = "XXabXX"'), Example('x = "ab"', 'x = ""', occurrence=1),
                Example('x = f"a{b}"', 'x = f"XXa{b}XX"'))


def _string_body(literal: str) -> tuple[str, str, str]:
    """(prefix and opening quotes, text, closing quotes) of a string literal."""
    start = min(i for i in (literal.find('"'), literal.find("'")) if i >= 0)
    quote = literal[start:start + 3] if literal[start:start + 3] in ('"""', "'''") else literal[start]
    return literal[:start + len(quote)], literal[start + len(quote):len(literal) - len(quote)], quote


def _is_docstring(node) -> bool:
    stmt = node.parent
    return (stmt is not None and stmt.type == "simple_stmt" and stmt.children[0] is node
            and stmt.parent is not None and stmt.parent.type in ("suite", "file_input")
            and next(c for c in stmt.parent.children if c.type != "newline") is stmt)


class ReplaceNone(Operator):
    """``None`` made ``True``: a default, an argument or a value that is no longer empty."""

    def mutation_positions(self, node):
        if isinstance(node, Keyword) and node.value == "None":
            yield (node.start_pos, node.end_pos)

    def mutate(self, node, index):
        node.value = "True"
        return node

    @classmethod
    def examples(cls):
        return (Example("f(x, None)", "f(x, True)"),)


class RemoveKeywordArgument(Operator):
    """A keyword argument left out of a call: ``f(a, k=1)`` made ``f(a)``."""

    def mutation_positions(self, node):
        if node.type == "arglist" or (node.type == "trailer" and node.children[0].value == "("):
            for child in node.children:
                if _is_keyword_argument(child):
                    yield (child.start_pos, child.end_pos)

    def mutate(self, node, index):
        child = [c for c in node.children if _is_keyword_argument(c)][index]
        at = node.children.index(child)
        if node.type == "trailer":  # the call's only argument
            node.children[at:at + 1] = []
            return node
        after = node.children[at + 1] if at + 1 < len(node.children) else None
        if isinstance(after, OperatorLeaf) and after.value == ",":
            del node.children[at:at + 2]  # the argument and its comma
            if at == 0 and node.children:  # the next argument takes the removed one's place
                node.children[0] = _code(node.children[0].get_code(include_prefix=False), child)
        else:
            del node.children[at - 1:at + 1]  # the last argument and the comma before it
        return node

    @classmethod
    def examples(cls):
        return (Example("f(a, k=1)", "f(a)"), Example("f(k=1, j=2)", "f(j=2)"), Example("f(k=1)", "f()"))


class ReplaceKeywordArgumentValue(Operator):
    """A keyword argument's value made ``None`` (a ``None`` made ``True``)."""

    def mutation_positions(self, node):
        if _is_keyword_argument(node):
            yield (node.children[2].start_pos, node.children[2].end_pos)

    def mutate(self, node, index):
        value = node.children[2]
        is_none = value.get_code(include_prefix=False) == "None"
        node.children[2] = _code("True" if is_none else "None", value)
        return node

    @classmethod
    def examples(cls):
        return (Example("f(a, k=1)", "f(a, k=None)"), Example("f(k=None)", "f(k=True)"))


class ExceptClauseReplacer(Operator):
    """An exception class of an ``except`` clause made ``()``, which matches nothing: the
    handler (or that part of it) no longer catches what it should."""

    def mutation_positions(self, node):
        if node.type == "except_clause":
            for target in _except_targets(node):
                yield (target.start_pos, target.end_pos)

    def mutate(self, node, index):
        target = _except_targets(node)[index]
        parent = target.parent
        parent.children[parent.children.index(target)] = _code("()", target)
        return node

    @classmethod
    def examples(cls):
        return (Example("try: pass\nexcept OSError: pass", "try: pass\nexcept (): pass"),
                Example("try: pass\nexcept (OSError, KeyError) as e: pass",
                        "try: pass\nexcept (OSError, ()) as e: pass", occurrence=1))


def _except_targets(clause) -> list:
    caught = clause.children[1]
    if caught.type == "atom" and caught.children[0].value == "(" and len(caught.children) == 3:
        inner = caught.children[1]
        return inner.children[::2] if inner.type == "testlist_comp" else [inner]
    return [caught]


class ReplaceRaisedException(Operator):
    """The exception raised made another one: ``raise ValueError(m)`` made ``raise RuntimeError(m)``
    (a ``RuntimeError`` made ``Exception``); a bare ``raise`` (re-raise) is left alone."""

    def mutation_positions(self, node):
        if node.type == "raise_stmt":
            yield (node.children[1].start_pos, node.children[1].end_pos)

    def mutate(self, node, index):
        raised = node.children[1]
        callee, call = raised.get_code().strip(), ""
        if raised.type in ("atom_expr", "power") and raised.children[-1].type == "trailer" \
                and raised.children[-1].children[0].value == "(":  # keep the call's arguments
            call = raised.children[-1].get_code()
            callee = "".join(c.get_code() for c in raised.children[:-1]).strip()
        other = "Exception" if callee == "RuntimeError" else "RuntimeError"
        node.children[1] = _code(other + call, raised)
        return node

    @classmethod
    def examples(cls):
        return (Example("raise ValueError('m')", "raise RuntimeError('m')"),
                Example("raise errors.Bad('m') from e", "raise RuntimeError('m') from e"),
                Example("raise RuntimeError", "raise Exception"))


class ReplaceReturnValue(Operator):
    """``return x`` made ``return None``."""

    def mutation_positions(self, node):
        if node.type == "return_stmt" and node.children[1].get_code(include_prefix=False) != "None":
            yield (node.children[1].start_pos, node.children[1].end_pos)

    def mutate(self, node, index):
        node.children[1] = _code("None", node.children[1])
        return node

    @classmethod
    def examples(cls):
        return (Example("def f():\n    return x + 1", "def f():\n    return None"),)


class DeleteStatement(Operator):
    """A simple statement (an assignment, a call, ``return``, ``raise``, ``break``, ...) made ``pass``."""

    def mutation_positions(self, node):
        if node.type == "simple_stmt":
            for stmt in node.children:
                if stmt.type not in ("newline", "operator") and stmt.get_code(include_prefix=False) != "pass" \
                        and not (stmt.type == "string" and _is_docstring(stmt)):
                    yield (stmt.start_pos, stmt.end_pos)

    def mutate(self, node, index):
        stmts = [s for s in node.children if s.type not in ("newline", "operator")
                 and s.get_code(include_prefix=False) != "pass" and not (s.type == "string" and _is_docstring(s))]
        stmt = stmts[index]
        node.children[node.children.index(stmt)] = _code("pass", stmt)
        return node

    @classmethod
    def examples(cls):
        return (Example("x = 1\ny = 2\n", "pass\ny = 2\n"), Example("x = 1\ny = 2\n", "x = 1\npass\n", occurrence=1))


JUDGE_OPERATORS = (DropOperand, ReplaceMembership, ReplaceAugmentedAssignment, ReplaceStringConstant, ReplaceNone,
                   RemoveKeywordArgument, ReplaceKeywordArgumentValue, ExceptClauseReplacer, ReplaceRaisedException,
                   ReplaceReturnValue, DeleteStatement)
