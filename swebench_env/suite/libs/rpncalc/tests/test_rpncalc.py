import pytest

from rpncalc import CalcError, calculate, rpn, to_rpn, tokenize


def test_tokenize_numbers_and_operators():
    assert [t.text for t in tokenize("12 + 3.5*(4)")] == ["12", "+", "3.5", "*", "(", "4", ")"]
    assert tokenize("3.5")[0].value == 3.5
    assert tokenize("12")[0].value == 12


def test_tokenize_rejects_unknown_characters():
    with pytest.raises(CalcError, match="unexpected character '&' at position 2"):
        tokenize("1 & 2")


def test_tokenize_rejects_bad_numbers():
    with pytest.raises(CalcError, match="bad number"):
        tokenize("1.2.3")


def test_leading_minus_is_a_sign():
    assert [t.text for t in tokenize("-3")] == ["neg", "3"]


def test_minus_after_operator_or_parenthesis_is_a_sign():
    assert [t.text for t in tokenize("2*-3")] == ["2", "*", "neg", "3"]
    assert [t.text for t in tokenize("(-3)")] == ["(", "neg", "3", ")"]


def test_to_rpn_order():
    assert [t.text for t in to_rpn(tokenize("1 + 2 * 3"))] == ["1", "2", "3", "*", "+"]


def test_addition_and_multiplication():
    assert calculate("1 + 2 * 3") == 7
    assert calculate("2 * 3 + 1") == 7


def test_subtraction_and_division_keep_operand_order():
    assert calculate("10 - 4") == 6
    assert calculate("8 / 2") == 4
    assert calculate("10 - 4 - 3") == 3


def test_modulo():
    assert calculate("17 % 5") == 2


def test_parentheses_override_precedence():
    assert calculate("2 * (3 + 4)") == 14
    assert calculate("((1 + 1))") == 2


def test_power_is_right_associative():
    assert calculate("2 ^ 3 ^ 2") == 512


def test_power_binds_tighter_than_negation():
    assert calculate("-2 ^ 2") == -4
    assert calculate("2 ^ 2") == 4


def test_negative_operands():
    assert calculate("2 * -3") == -6
    assert calculate("(-3) + 5") == 2
    assert calculate("-3 + 5") == 2


def test_float_results():
    assert calculate("7 / 2") == 3.5
    assert calculate("0.5 + 0.25") == 0.75


def test_division_by_zero_is_a_calc_error():
    with pytest.raises(CalcError, match="division by zero"):
        calculate("1 / (2 - 2)")


def test_modulo_by_zero_is_a_calc_error():
    with pytest.raises(CalcError, match="modulo by zero"):
        calculate("5 % 0")


def test_unbalanced_parentheses():
    with pytest.raises(CalcError, match=r"unbalanced '\('"):
        calculate("(1 + 2")


def test_unbalanced_closing_parenthesis():
    with pytest.raises(CalcError, match=r"unbalanced '\)'"):
        calculate("1 + 2)")


def test_missing_operand():
    with pytest.raises(CalcError, match="not enough operands"):
        calculate("1 +")


def test_too_many_operands():
    with pytest.raises(CalcError, match="expected one result"):
        rpn("1 2")


def test_rpn_strings():
    assert rpn("3 4 + 2 *") == 14
    assert rpn("5 1 2 + 4 * + 3 -") == 14
