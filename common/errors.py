"""Gantry's own errors. Outside-system modules translate SDK errors into
TransientError / PermanentError; services raise the rest. The API maps each
to a status code in one place (core.api.base.exception_handler)."""

from __future__ import annotations


class GantryError(Exception):
    """Base of every error Gantry raises on purpose."""


class ValidationFailed(GantryError):
    """Bad input: ``errors`` maps each field to the rules it broke."""

    def __init__(self, errors: dict[str, list[str] | str]) -> None:
        self.errors = {field: [msg] if isinstance(msg, str) else list(msg) for field, msg in errors.items()}
        super().__init__("; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in self.errors.items()))

    def under(self, prefix: str, *, keep: tuple[str, ...] = ()) -> ValidationFailed:
        """The same refusals named as fields of ``prefix`` (``spec.max_seq_len``), as
        the API names a nested input's type errors; the names in ``keep`` stay as they are."""
        return ValidationFailed(
            {name if name in keep else f"{prefix}.{name}": rules for name, rules in self.errors.items()}
        )


class NothingToChange(ValidationFailed):
    """A change that asks for what is there already (refused by field, as bad input is)."""


class NotFound(GantryError):
    pass


class InvalidTransition(GantryError):
    """A status change the state machine does not allow from the current state."""


class PermissionDenied(GantryError):
    pass


class TransientError(GantryError):
    """An outside system failed in a way that may pass: retry later."""


class PermanentError(GantryError):
    """An outside system refused in a way that retrying will not fix."""


class ContextExceeded(PermanentError):
    """A model refused a prompt that, with the tokens asked for, does not fit its context."""


class ConfirmationRequired(InvalidTransition):
    """The action would disturb others (a load test on a deployment real clients
    use): ask again, confirmed."""
