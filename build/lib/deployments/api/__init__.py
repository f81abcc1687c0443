"""The REST API under /api/: one module per resource, its serializers beside
its views; every view is a thin door into a selector or a service."""
