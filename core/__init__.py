"""The toolkit every domain app builds on, below them all: the REST API's base
(strict serializers, the error mapping, lists and cursors, the renderer, the
OpenAPI schema), the roles and their permissions, the one job state machine,
the host queues and task names, the JSON model field, and the names and ids
every table checks. It imports no domain app (tests/unit/test_layers.py)."""
