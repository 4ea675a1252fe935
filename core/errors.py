"""Errors: a user's mistake (command-line tools print it without a traceback) and a run that failed.

`RunFailed` and its `DecisionTimeout` end a run that can no longer make progress (a lost resource, a
decision that never finished) instead of letting it hang. `ContractError` means a policy or an
executor broke the event contract of `core/events.py`: a bug, not bad input.
"""


class UserError(ValueError):
    """Bad input from a user (an unknown name, a bad config value, a model that does not fit)."""


def unknown_name(kind: str, name: object, choices) -> UserError:
    """Error for a name looked up in a registry: names the bad value and every valid one."""
    valid = ", ".join(sorted(str(c) for c in choices))
    return UserError(f"unknown {kind} {name!r}; valid choices: {valid}")


class RunFailed(RuntimeError):
    """The run cannot go on: too many resources were lost, or a decision never finished."""


class DecisionTimeout(RunFailed):
    """An executor did not report the completion of a started decision before its deadline."""


class ContractError(RuntimeError):
    """A policy or an executor broke the contract between them (see core/events.py)."""
