from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "OpenAI-compatible gateway"
    default_auto_field = "django.db.models.BigAutoField"
