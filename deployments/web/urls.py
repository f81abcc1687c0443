from django.urls import path

from deployments.web import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("models/<int:pk>/", views.model_detail, name="model"),
    path("builds/<int:pk>/", views.build_detail, name="build"),
    path("deployments/<int:pk>/", views.deployment_detail, name="deployment"),
]
