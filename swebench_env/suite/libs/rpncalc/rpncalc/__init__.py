"""A calculator: tokenize, convert to reverse Polish notation (shunting-yard), evaluate on a stack."""

from rpncalc.evaluate import OPERATORS, calculate, evaluate_rpn, rpn, to_rpn
from rpncalc.tokens import CalcError, Token, tokenize

__all__ = ["OPERATORS", "CalcError", "Token", "calculate", "evaluate_rpn", "rpn", "to_rpn", "tokenize"]
__version__ = "0.4.1"
