from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Gantry deployments"

    def ready(self) -> None:
        # The host tasks register themselves where their rows' services are
        # (hosts.outbox.HostTask): every process knows all of them.
        from deployments.services import builds, downloads, registered_models, replicas  # noqa: F401
