"""What every app's REST API is built of: strict serializers and the error
mapping (base), lists and cursor pages (lists), the JSON renderer, the OpenAPI
schema."""
