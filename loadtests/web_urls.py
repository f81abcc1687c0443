from django.urls import path

from loadtests import views

urlpatterns = [
    path("loadtests/", views.loadtest_list, name="loadtests"),
    path("loadtests/compare/", views.loadtest_compare, name="loadtest-compare"),
    path("loadtests/<int:pk>/", views.loadtest_detail, name="loadtest"),
    path("tuning/", views.tuning_list, name="tuning-runs"),
    path("tuning/<int:pk>/", views.tuning_detail, name="tuning-run"),
]
