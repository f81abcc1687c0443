from django.urls import path

from deployments.web import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("models/", views.model_list, name="models"),
    path("events/", views.event_list, name="events"),
    path("models/<int:pk>/", views.model_detail, name="model"),
    path("builds/", views.build_list, name="builds"),
    path("builds/<int:pk>/", views.build_detail, name="build"),
    path("deployments/new/", views.deployment_new, name="deployment-new"),
    path("deployments/<int:pk>/", views.deployment_detail, name="deployment"),
]
