"""What every table of the domain checks its names and ids against."""

from __future__ import annotations

from django.core.validators import RegexValidator

# Triton model names and host names end up in paths, queue names and URLs.
slug_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9_.-]{0,62}$",
    "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
)

# The database's integers are 64-bit: a larger id in a body, a query or a form is
# refused by name (serializers and forms bound to it), never an OverflowError.
DB_INT_MAX = 2**63 - 1
