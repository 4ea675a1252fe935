"""Operator table, infix to reverse Polish notation (shunting-yard), and stack evaluation."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

from rpncalc.tokens import CalcError, Number, Token, tokenize


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalcError("division by zero")
    return a / b


def _modulo(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalcError("modulo by zero")
    return a % b


@dataclass(frozen=True)
class Operator:
    precedence: int  # higher binds tighter
    right_assoc: bool  # a ^ b ^ c is a ^ (b ^ c)
    arity: int
    func: Callable[..., Number]


OPERATORS = {
    "+": Operator(1, False, 2, operator.add),
    "-": Operator(1, False, 2, operator.sub),
    "*": Operator(2, False, 2, operator.mul),
    "/": Operator(2, False, 2, _divide),
    "%": Operator(2, False, 2, _modulo),
    "neg": Operator(3, True, 1, operator.neg),
    "^": Operator(4, True, 2, operator.pow),
}


def _pops_before(top: Operator, incoming: Operator) -> bool:
    """Whether the operator on top of the stack is applied before the incoming one."""
    if incoming.arity == 1:
        return False  # a prefix operator has no left operand to compete for
    if top.precedence > incoming.precedence:
        return True
    return top.precedence == incoming.precedence and not incoming.right_assoc


def to_rpn(tokens: list[Token]) -> list[Token]:
    """The tokens of an infix expression reordered into reverse Polish notation."""
    output: list[Token] = []
    stack: list[Token] = []
    for tok in tokens:
        if tok.kind == "number":
            output.append(tok)
        elif tok.kind == "op":
            spec = OPERATORS[tok.text]
            while stack and stack[-1].kind == "op" and _pops_before(OPERATORS[stack[-1].text], spec):
                output.append(stack.pop())
            stack.append(tok)
        elif tok.kind == "lparen":
            stack.append(tok)
        else:
            while stack and stack[-1].kind != "lparen":
                output.append(stack.pop())
            if not stack:
                raise CalcError("unbalanced ')'")
            stack.pop()
    while stack:
        tok = stack.pop()
        if tok.kind == "lparen":
            raise CalcError("unbalanced '('")
        output.append(tok)
    return output


def evaluate_rpn(tokens: list[Token]) -> Number:
    """Evaluate tokens in reverse Polish notation on a stack."""
    stack: list[Number] = []
    for tok in tokens:
        if tok.kind == "number":
            stack.append(tok.value)
            continue
        spec = OPERATORS.get(tok.text)
        if spec is None or tok.kind != "op":
            raise CalcError(f"unexpected token {tok.text!r}")
        if len(stack) < spec.arity:
            raise CalcError(f"not enough operands for {tok.text!r}")
        if spec.arity == 1:
            stack.append(spec.func(stack.pop()))
        else:
            right = stack.pop()
            left = stack.pop()
            stack.append(spec.func(left, right))
    if len(stack) != 1:
        raise CalcError(f"expected one result, found {len(stack)} values")
    return stack[0]


def calculate(expression: str) -> Number:
    """The value of an infix expression such as "2 * (3 + 4)"."""
    return evaluate_rpn(to_rpn(tokenize(expression)))


def rpn(text: str) -> Number:
    """The value of a space-separated postfix expression such as "3 4 + 2 *"."""
    tokens = []
    for word in text.split():
        if word in OPERATORS and word != "neg":
            tokens.append(Token("op", word))
        else:
            tokens.extend(tokenize(word))
    return evaluate_rpn(tokens)
