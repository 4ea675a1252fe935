"""The error a user's mistake raises: command-line tools print it without a traceback."""


class UserError(ValueError):
    """Bad input from a user (an unknown name, a bad config value, a model that does not fit)."""


def unknown_name(kind: str, name: object, choices) -> UserError:
    """Error for a name looked up in a registry: names the bad value and every valid one."""
    valid = ", ".join(sorted(str(c) for c in choices))
    return UserError(f"unknown {kind} {name!r}; valid choices: {valid}")
