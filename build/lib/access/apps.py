from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class AccessConfig(AppConfig):
    default = True

    def ready(self) -> None:
        from access import schema  # noqa: F401 - registers the bearer scheme with drf-spectacular

    name = "access"
    verbose_name = "API access"
    default_auto_field = "django.db.models.BigAutoField"


class GantryAdminConfig(admin_apps.AdminConfig):
    default = False  # named in INSTALLED_APPS in place of django.contrib.admin
    default_site = "access.admin_site.GantryAdminSite"
