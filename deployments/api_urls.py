from django.urls import path

from deployments import api

urlpatterns = [
    path("hosts/", api.HostList.as_view(), name="api-hosts"),
    path("hosts/<str:name>/", api.HostDetail.as_view(), name="api-host"),
    path("models/", api.ModelList.as_view(), name="api-models"),
    path("models/<int:pk>/", api.ModelDetail.as_view(), name="api-model"),
    path("builds/", api.BuildList.as_view(), name="api-builds"),
    path("builds/<int:pk>/", api.BuildDetail.as_view(), name="api-build"),
    path("builds/<int:pk>/cancel/", api.BuildCancel.as_view(), name="api-build-cancel"),
    path("builds/<int:pk>/log/", api.BuildLog.as_view(), name="api-build-log"),
    path("builds/<int:pk>/events/", api.BuildEvents.as_view(), name="api-build-events"),
    path("deployments/", api.DeploymentList.as_view(), name="api-deployments"),
    path("deployments/<int:pk>/", api.DeploymentDetail.as_view(), name="api-deployment"),
    path("deployments/<int:pk>/start/", api.DeploymentAction.as_view(action="start"), name="api-deployment-start"),
    path("deployments/<int:pk>/stop/", api.DeploymentAction.as_view(action="stop"), name="api-deployment-stop"),
    path("deployments/<int:pk>/events/", api.DeploymentEvents.as_view(), name="api-deployment-events"),
    path("deployments/<int:pk>/metrics/", api.DeploymentMetrics.as_view(), name="api-deployment-metrics"),
    path("deployments/<int:pk>/models/", api.DeploymentModels.as_view(), name="api-deployment-models"),
    path("deployments/<int:pk>/revisions/", api.DeploymentRevisions.as_view(), name="api-deployment-revisions"),
    path("deployments/<int:pk>/log/", api.DeploymentLog.as_view(), name="api-deployment-log"),
    path("deployments/<int:pk>/plan/", api.DeploymentPlan.as_view(), name="api-deployment-plan"),
]
