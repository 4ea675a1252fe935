"""Bug-injection operators: small local edits of one function's source, located with the AST.

In the spirit of SWE-smith's procedural bugs, each operator knows which syntax nodes it can act on
(comparisons, arithmetic, conditions, statements, defaults, names, constants) and rewrites only the
text of the chosen node, so the rest of the file keeps its formatting and the gold patch (the
reverse edit) is a minimal diff. A bug names its site: the function's qualified name
(`IntervalSet.add`) and a `match` text; among the operator's candidate nodes in that function whose
text contains `match`, the innermost (shortest) is chosen, and `occurrence` picks among equals.
Operators are chosen by name from `OPERATORS`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Protocol

COMPARE_TEXT = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
INVERSE = {
    "==": "!=",
    "!=": "==",
    "<": ">=",
    ">=": "<",
    ">": "<=",
    "<=": ">",
    "in": "not in",
    "not in": "in",
    "is": "is not",
    "is not": "is",
}
BINOP_TEXT = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.MatMult: "@",
}


class MutationError(ValueError):
    """A bug's site does not exist or is ambiguous, or the edit would not be a valid, different program."""


@dataclass(frozen=True)
class Edit:
    start: int  # character offsets into the module's text
    end: int
    text: str

    def apply(self, source: str) -> str:
        return source[: self.start] + self.text + source[self.end :]


class Module:
    """A module's text and AST, with node positions as character offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tree = ast.parse(text)
        self.lines = text.splitlines(keepends=True)
        self._starts = [0]
        for line in self.lines:
            self._starts.append(self._starts[-1] + len(line))

    def offset(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1]
        return self._starts[lineno - 1] + len(line.encode()[:col_bytes].decode())

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_start(self, lineno: int) -> int:
        return self._starts[lineno - 1]

    def function(self, qualname: str) -> ast.Module | ast.FunctionDef | ast.AsyncFunctionDef:
        """The function or method `qualname` (`IntervalSet.add`, `wrap`, `outer.inner`); `<module>`: the module."""
        if qualname == "<module>":
            return self.tree
        found = dict(_functions(self.tree))
        if qualname not in found:
            raise MutationError(f"no function {qualname!r}; the module defines {sorted(found)}")
        return found[qualname]


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")


def _in_order(nodes) -> list:
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))


def _body_nodes(func: ast.AST) -> list[ast.AST]:
    """Every node in `func`'s body (not its decorators or signature)."""
    return [n for stmt in func.body for n in ast.walk(stmt)]


def _gap_replace(module: Module, left: ast.AST, right: ast.AST, old: str, new: str) -> Edit:
    """Replace the operator `old` that sits between the nodes `left` and `right`."""
    start, end = module.span(left)[1], module.span(right)[0]
    gap = module.text[start:end]
    found = re.search(rf"(?<![\w=<>!*/]){re.escape(old)}(?![\w=*/])", gap)
    if found is None:
        raise MutationError(f"cannot find {old!r} between the operands in {gap!r}")
    return Edit(start + found.start(), start + found.end(), new)


class Operator(Protocol):
    """Finds the nodes of one kind in a function and rewrites one of them."""

    def candidates(self, module: Module, func: ast.AST) -> list[tuple[ast.AST, str]]:
        """(node, the text `match` is looked for in), in source order."""
        ...

    def edit(self, module: Module, node: ast.AST) -> Edit: ...


@dataclass(frozen=True)
class CompareSwap:
    """`a <= b` -> `a < b`: a comparison with another operator (`new`)."""

    new: str

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.Compare) and len(n.ops) == 1]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        return _gap_replace(module, node.left, node.comparators[0], COMPARE_TEXT[type(node.ops[0])], self.new)


@dataclass(frozen=True)
class BinOpSwap:
    """`a + b` -> `a - b` (also `x += 1` -> `x -= 1`): arithmetic with another operator (`new`)."""

    new: str

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.BinOp | ast.AugAssign)]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        symbol = BINOP_TEXT[type(node.op)]
        if isinstance(node, ast.AugAssign):
            return _gap_replace(module, node.target, node.value, symbol + "=", self.new + "=")
        return _gap_replace(module, node.left, node.right, symbol, self.new)


@dataclass(frozen=True)
class BoolOpSwap:
    """`a and b` -> `a or b`, and the reverse."""

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.BoolOp) and len(n.values) == 2]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        old = "and" if isinstance(node.op, ast.And) else "or"
        return _gap_replace(module, node.values[0], node.values[1], old, "or" if old == "and" else "and")


@dataclass(frozen=True)
class ConstantChange:
    """A literal (number, string, True/False/None) replaced by the source text `new`."""

    new: str

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.Constant)]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        start, end = module.span(node)
        return Edit(start, end, self.new)


@dataclass(frozen=True)
class OffByOne:
    """An integer expression shifted by `delta`: `n` -> `n + 1`, `len(x) - 1` -> `len(x)`, `2` -> `1`."""

    delta: int = 1

    def candidates(self, module, func):
        skip = ast.Compare | ast.BoolOp | ast.Lambda | ast.IfExp | ast.NamedExpr | ast.Starred
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.expr) and not isinstance(n, skip)]
        nodes = [n for n in nodes if not (isinstance(n, ast.Constant) and type(n.value) is not int)]
        nodes = [n for n in nodes if not isinstance(getattr(n, "ctx", None), ast.Store | ast.Del)]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        start, end = module.span(node)
        if isinstance(node, ast.Constant):
            return Edit(start, end, str(node.value + self.delta))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub) and _is_int(node.right):
            shift = node.right.value if isinstance(node.op, ast.Add) else -node.right.value
            shift += self.delta
            left = module.segment(node.left)
            text = left if shift == 0 else f"{left} {'+' if shift > 0 else '-'} {abs(shift)}"
            return Edit(start, end, text)
        text = module.segment(node)
        if isinstance(node, ast.BinOp) and not isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            text = f"({text})"
        return Edit(start, end, f"{text} {'+' if self.delta > 0 else '-'} {abs(self.delta)}")


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


@dataclass(frozen=True)
class InvertCondition:
    """The test of an `if`, `while`, conditional expression or comprehension filter negated."""

    def candidates(self, module, func):
        tests = []
        for n in _body_nodes(func):
            if isinstance(n, ast.If | ast.While | ast.IfExp):
                tests.append(n.test)
            elif isinstance(n, ast.comprehension):
                tests.extend(n.ifs)
        return [(t, module.segment(t)) for t in _in_order(tests)]

    def edit(self, module, node):
        start, end = module.span(node)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            old = COMPARE_TEXT[type(node.ops[0])]
            return _gap_replace(module, node.left, node.comparators[0], old, INVERSE[old])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return Edit(start, end, module.segment(node.operand))
        text = module.segment(node)
        if isinstance(node, ast.BoolOp | ast.IfExp | ast.NamedExpr | ast.Lambda):
            text = f"({text})"
        return Edit(start, end, f"not {text}")


@dataclass(frozen=True)
class RemoveStatement:
    """A whole statement deleted (a missing guard, branch, update or return); `pass` fills an emptied block."""

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.stmt)]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        start = module.line_start(node.lineno)
        end = module.line_start(node.end_lineno + 1) if node.end_lineno < len(module.lines) else len(module.text)
        if module.text[start : module.span(node)[0]].strip():
            raise MutationError(f"the statement {module.segment(node)!r:.60} does not start its line")
        parent = next(p for p in ast.walk(module.tree) if _holds(p, node))
        block = next(b for b in _blocks(parent) if any(s is node for s in b))
        if len(block) == 1:
            indent = module.text[start : module.span(node)[0]]
            return Edit(start, end, f"{indent}pass\n")
        return Edit(start, end, "")


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [getattr(node, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(node, f, None), list)]


def _holds(parent: ast.AST, node: ast.AST) -> bool:
    return any(s is node for b in _blocks(parent) for s in b) or any(
        s is node for h in getattr(parent, "handlers", []) for s in h.body
    )


@dataclass(frozen=True)
class ChangeDefault:
    """The default value of the function's parameter `param` replaced by the source text `new`."""

    param: str
    new: str

    def candidates(self, module, func):
        args = func.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
        return [(d, a.arg) for a, d in pairs if a.arg == self.param]

    def edit(self, module, node):
        start, end = module.span(node)
        return Edit(start, end, self.new)


@dataclass(frozen=True)
class SwapOperands:
    """`a - b` -> `b - a`, `lo < hi` -> `hi < lo`, `f(a, b)` -> `f(b, a)`."""

    def candidates(self, module, func):
        nodes = [
            n
            for n in _body_nodes(func)
            if isinstance(n, ast.BinOp)
            or (isinstance(n, ast.Compare) and len(n.ops) == 1)
            or (isinstance(n, ast.Call) and len(n.args) == 2 and not n.keywords)
        ]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        if isinstance(node, ast.BinOp):
            left, right = node.left, node.right
        elif isinstance(node, ast.Compare):
            left, right = node.left, node.comparators[0]
        else:
            left, right = node.args
        (a0, a1), (b0, b1) = module.span(left), module.span(right)
        text = module.text
        return Edit(a0, b1, text[b0:b1] + text[a1:b0] + text[a0:a1])


@dataclass(frozen=True)
class WrongVariable:
    """A name (`end`) or attribute (`self.end`) replaced by another one, `new`: the wrong variable used."""

    new: str

    def candidates(self, module, func):
        nodes = [n for n in _body_nodes(func) if isinstance(n, ast.Name | ast.Attribute)]
        return [(n, module.segment(n)) for n in _in_order(nodes)]

    def edit(self, module, node):
        start, end = module.span(node)
        if isinstance(node, ast.Attribute):
            return Edit(end - len(node.attr), end, self.new)
        return Edit(start, end, self.new)


OPERATORS: dict[str, type] = {
    "compare_swap": CompareSwap,
    "binop_swap": BinOpSwap,
    "boolop_swap": BoolOpSwap,
    "constant_change": ConstantChange,
    "off_by_one": OffByOne,
    "invert_condition": InvertCondition,
    "remove_statement": RemoveStatement,
    "change_default": ChangeDefault,
    "swap_operands": SwapOperands,
    "wrong_variable": WrongVariable,
}


def make_operator(name: str, **params) -> Operator:
    """The operator registered under `name`, built with `params`."""
    if name not in OPERATORS:
        raise MutationError(f"unknown operator {name!r}; choose one of {sorted(OPERATORS)}")
    try:
        return OPERATORS[name](**params)
    except TypeError as e:
        raise MutationError(f"operator {name!r}: bad parameters {params}: {e}") from None


def mutate(source: str, where: str, operator: Operator, match: str = "", occurrence: int | None = None) -> Edit:
    """The edit `operator` makes in function `where` at the candidate whose text contains `match`.

    Among the candidates containing `match`, the innermost (shortest text) ones are kept; `occurrence`
    (0-based, in source order) picks among them and is required when more than one remains. The
    mutated module must still parse and must differ from the original.
    """
    module = Module(source)
    func = module.function(where)
    found = [(n, label) for n, label in operator.candidates(module, func) if match in label]
    if not found:
        raise MutationError(f"{type(operator).__name__} finds nothing containing {match!r} in {where}")
    shortest = min(len(label) for _, label in found)
    found = [(n, label) for n, label in found if len(label) == shortest]
    if occurrence is None and len(found) > 1:
        labels = [label for _, label in found]
        raise MutationError(f"{match!r} fits {len(found)} places in {where}: {labels}; give an occurrence")
    if occurrence is not None and not 0 <= occurrence < len(found):
        raise MutationError(f"occurrence {occurrence} of {match!r} in {where}: there are {len(found)}")
    edit = operator.edit(module, found[occurrence or 0][0])
    mutated = edit.apply(source)
    try:
        changed = ast.dump(ast.parse(mutated)) != ast.dump(module.tree)
    except SyntaxError as e:
        raise MutationError(f"the edit at {where} / {match!r} does not parse: {e}") from None
    if not changed:
        raise MutationError(f"the edit at {where} / {match!r} does not change the program")
    return edit
