from django.urls import path

from inference.api import DeploymentEmbed, DeploymentRerank, deployment_generate

urlpatterns = [
    path("deployments/<int:pk>/embed/", DeploymentEmbed.as_view(), name="api-deployment-embed"),
    path("deployments/<int:pk>/rerank/", DeploymentRerank.as_view(), name="api-deployment-rerank"),
    path("deployments/<int:pk>/generate/", deployment_generate, name="api-deployment-generate"),
]
