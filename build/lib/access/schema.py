"""How the OpenAPI schema names personal-token authentication (a bearer scheme)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class PersonalTokenScheme(OpenApiAuthenticationExtension):
    target_class = "access.auth.PersonalTokenAuthentication"
    name = "personalToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A personal API token (gt-…): the API tokens page, POST /api/tokens/, "
            "or manage.py gantry_token. 'Token <secret>' is accepted too.",
        }
