from django.apps import AppConfig


class LoadTestsConfig(AppConfig):
    name = "loadtests"
    verbose_name = "Load tests"
    default_auto_field = "django.db.models.BigAutoField"
