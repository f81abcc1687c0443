from django.urls import path

from playground.api import DeploymentEmbed

urlpatterns = [
    path("deployments/<int:pk>/embed/", DeploymentEmbed.as_view(), name="api-deployment-embed"),
]
