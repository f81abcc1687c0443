from django.urls import path

from deployments.api import builds, deployment_state, deployments, models, timeline
from deployments.api import deployment_actions as actions

urlpatterns = [
    path("models/", models.ModelList.as_view(), name="api-models"),
    path("models/<int:pk>/", models.ModelDetail.as_view(), name="api-model"),
    path("models/<int:pk>/downloads/", models.ModelDownloads.as_view(), name="api-model-downloads"),
    path("models/<int:pk>/copies/<str:name>/", models.ModelCopy.as_view(), name="api-model-copy"),
    path("downloads/<int:pk>/cancel/", models.DownloadCancel.as_view(), name="api-download-cancel"),
    path("builds/", builds.BuildList.as_view(), name="api-builds"),
    path("builds/preflight/", builds.BuildPreflight.as_view(), name="api-build-preflight"),
    path("builds/<int:pk>/", builds.BuildDetail.as_view(), name="api-build"),
    path("builds/<int:pk>/cancel/", builds.BuildCancel.as_view(), name="api-build-cancel"),
    path("builds/<int:pk>/log/", builds.BuildLog.as_view(), name="api-build-log"),
    path("builds/<int:pk>/events/", builds.BuildEvents.as_view(), name="api-build-events"),
    path("events/", timeline.EventList.as_view(), name="api-events"),
    path("deployments/", deployments.DeploymentList.as_view(), name="api-deployments"),
    path("deployments/rates/", deployment_state.DeploymentRates.as_view(), name="api-deployment-rates"),
    path("deployments/preflight/", deployment_state.DeploymentPreflight.as_view(), name="api-deployment-preflight"),
    path("deployments/<int:pk>/", deployments.DeploymentDetail.as_view(), name="api-deployment"),
    path("deployments/<int:pk>/start/", actions.DeploymentStart.as_view(), name="api-deployment-start"),
    path("deployments/<int:pk>/stop/", actions.DeploymentStop.as_view(), name="api-deployment-stop"),
    path("deployments/<int:pk>/scale/", actions.DeploymentScale.as_view(), name="api-deployment-scale"),
    path(
        "deployments/<int:pk>/autoscale/",
        actions.DeploymentAutoscale.as_view(),
        name="api-deployment-autoscale",
    ),
    path("deployments/<int:pk>/restart/", actions.DeploymentRestart.as_view(), name="api-deployment-restart"),
    path(
        "deployments/<int:pk>/rollback/",
        actions.DeploymentRollback.as_view(),
        name="api-deployment-rollback",
    ),
    path("deployments/<int:pk>/events/", deployment_state.DeploymentEvents.as_view(), name="api-deployment-events"),
    path("deployments/<int:pk>/metrics/", deployment_state.DeploymentMetrics.as_view(), name="api-deployment-metrics"),
    path("deployments/<int:pk>/models/", deployments.DeploymentModels.as_view(), name="api-deployment-models"),
    path("deployments/<int:pk>/revisions/", deployments.DeploymentRevisions.as_view(), name="api-deployment-revisions"),
    path("deployments/<int:pk>/log/", deployment_state.DeploymentLog.as_view(), name="api-deployment-log"),
    path("deployments/<int:pk>/plan/", deployment_state.DeploymentPlan.as_view(), name="api-deployment-plan"),
]
