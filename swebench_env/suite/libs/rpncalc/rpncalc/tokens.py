"""Split an arithmetic expression into number, operator and parenthesis tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

OPERATOR_CHARS = "+-*/%^"
Number = Union[int, float]


class CalcError(ValueError):
    """An expression that cannot be evaluated."""


@dataclass(frozen=True)
class Token:
    kind: str  # "number", "op", "lparen" or "rparen"
    text: str  # the operator's symbol; "neg" for a unary minus
    value: Number | None = None


def tokenize(text: str) -> list[Token]:
    """The tokens of `text`; a '-' where an operand must start is a unary minus ("neg")."""
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if ch.isdigit() or ch == ".":
            i = _read_number(text, i, tokens)
            continue
        if ch in OPERATOR_CHARS:
            if ch == "-" and _expects_operand(tokens):
                tokens.append(Token("op", "neg"))
            else:
                tokens.append(Token("op", ch))
        elif ch == "(":
            tokens.append(Token("lparen", ch))
        elif ch == ")":
            tokens.append(Token("rparen", ch))
        else:
            raise CalcError(f"unexpected character {ch!r} at position {i}")
        i += 1
    return tokens


def _read_number(text: str, i: int, tokens: list[Token]) -> int:
    j = i
    while j < len(text) and (text[j].isdigit() or text[j] == "."):
        j += 1
    literal = text[i:j]
    if literal.count(".") > 1 or literal == ".":
        raise CalcError(f"bad number {literal!r} at position {i}")
    tokens.append(Token("number", literal, float(literal) if "." in literal else int(literal)))
    return j


def _expects_operand(tokens: list[Token]) -> bool:
    """Whether the next token must start an operand, so that a '-' there is a sign, not a subtraction."""
    if not tokens:
        return True
    return tokens[-1].kind == "op" or tokens[-1].kind == "lparen"
