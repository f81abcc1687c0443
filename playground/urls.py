from django.urls import path

from playground.api import DeploymentEmbed, DeploymentRerank

urlpatterns = [
    path("deployments/<int:pk>/embed/", DeploymentEmbed.as_view(), name="api-deployment-embed"),
    path("deployments/<int:pk>/rerank/", DeploymentRerank.as_view(), name="api-deployment-rerank"),
]
