"""Bug-injection operators: each rewrites exactly the chosen node, and bad sites are refused with the choices."""

from __future__ import annotations

import pytest

from swebench_env.suite.mutations import OPERATORS, MutationError, make_operator, mutate

SOURCE = """\
LIMIT = 10


class Box:
    def fits(self, size, margin=2):
        if size + margin <= LIMIT and size > 0:
            return True
        total = 0
        for i in range(len(self.items) - 1):
            total += self.items[i]
        return max(total, size) - self.start
"""


def mutated(name: str, where: str = "Box.fits", match: str = "", occurrence: int | None = None, **params) -> str:
    edit = mutate(SOURCE, where, make_operator(name, **params), match, occurrence)
    return edit.apply(SOURCE)


def changed_lines(text: str) -> list[str]:
    return [new for old, new in zip(SOURCE.splitlines(), text.splitlines(), strict=False) if old != new]


def test_compare_swap():
    assert changed_lines(mutated("compare_swap", match="<= LIMIT", new="<")) == [
        "        if size + margin < LIMIT and size > 0:"
    ]


def test_binop_swap_and_augmented_assignment():
    assert changed_lines(mutated("binop_swap", match="size + margin", new="-"))[0].endswith(
        "size - margin <= LIMIT and size > 0:"
    )
    assert changed_lines(mutated("binop_swap", match="total +=", new="-")) == ["            total -= self.items[i]"]


def test_boolop_swap():
    assert changed_lines(mutated("boolop_swap", match="and"))[0].endswith("<= LIMIT or size > 0:")


def test_constant_change_at_module_level():
    assert changed_lines(mutated("constant_change", where="<module>", match="10", new="100")) == ["LIMIT = 100"]


def test_off_by_one_adjusts_an_existing_offset_or_adds_one():
    assert changed_lines(mutated("off_by_one", match="len(self.items) - 1", delta=1)) == [
        "        for i in range(len(self.items)):"
    ]
    assert changed_lines(mutated("off_by_one", match="len(self.items)", occurrence=0, delta=-1)) == [
        "        for i in range(len(self.items) - 1 - 1):"
    ]
    assert changed_lines(mutated("off_by_one", match="0", occurrence=1, delta=1)) == ["        total = 1"]


def test_invert_condition_negates_the_test():
    assert changed_lines(mutated("invert_condition", match="size > 0")) == [
        "        if not (size + margin <= LIMIT and size > 0):"
    ]


def test_remove_statement_deletes_whole_lines():
    text = mutated("remove_statement", match="total += self.items[i]")
    assert "total +=" not in text
    assert "            pass\n" in text  # the emptied loop body keeps a statement
    without_if = mutated("remove_statement", match="if size + margin")
    assert "return True" not in without_if
    assert without_if.count("\n") == SOURCE.count("\n") - 2


def test_change_default_names_the_parameter():
    assert changed_lines(mutated("change_default", param="margin", new="0")) == ["    def fits(self, size, margin=0):"]


def test_swap_operands_of_a_call_and_a_binop():
    assert changed_lines(mutated("swap_operands", match="max(total, size)")) == [
        "        return max(size, total) - self.start"
    ]
    assert changed_lines(mutated("swap_operands", match="max(total, size) - self.start")) == [
        "        return self.start - max(total, size)"
    ]


def test_wrong_variable_on_a_name_and_an_attribute():
    assert changed_lines(mutated("wrong_variable", match="max", new="min")) == [
        "        return min(total, size) - self.start"
    ]
    assert changed_lines(mutated("wrong_variable", match="self.start", new="end")) == [
        "        return max(total, size) - self.end"
    ]


def test_unknown_operator_lists_the_choices():
    with pytest.raises(MutationError, match=r"unknown operator 'swap'; choose one of \['binop_swap'"):
        make_operator("swap")
    assert len(OPERATORS) == 10


def test_bad_parameters_are_named():
    with pytest.raises(MutationError, match=r"operator 'compare_swap': bad parameters \{'old': '<'\}"):
        make_operator("compare_swap", old="<")


def test_unknown_function_lists_the_functions():
    with pytest.raises(MutationError, match=r"no function 'Box.size'; the module defines \['Box.fits'\]"):
        mutated("boolop_swap", where="Box.size")


def test_a_site_that_matches_nothing_is_refused():
    with pytest.raises(MutationError, match=r"CompareSwap finds nothing containing '>= 3' in Box.fits"):
        mutated("compare_swap", match=">= 3", new="<")


def test_an_ambiguous_site_needs_an_occurrence():
    with pytest.raises(MutationError, match=r"'total' fits 3 places in Box.fits: .*give an occurrence"):
        mutated("wrong_variable", match="total", new="size")
    with pytest.raises(MutationError, match=r"occurrence 5 of 'total' in Box.fits: there are 3"):
        mutated("wrong_variable", match="total", occurrence=5, new="size")


def test_an_edit_that_changes_nothing_is_refused():
    with pytest.raises(MutationError, match="does not change the program"):
        mutated("constant_change", match="0", occurrence=1, new="0")


def test_an_edit_that_breaks_the_syntax_is_refused():
    with pytest.raises(MutationError, match="does not parse"):
        mutated("constant_change", match="0", occurrence=1, new="0 0")
