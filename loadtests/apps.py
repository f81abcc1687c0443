from django.apps import AppConfig


class LoadTestsConfig(AppConfig):
    name = "loadtests"
    verbose_name = "Load tests"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The job kinds register themselves (core.jobs): a tuning run's hold
        # on its deployment is known to every process, not only those that imported it.
        from loadtests import services, tuning_services  # noqa: F401
