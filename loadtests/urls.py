from django.urls import path

from loadtests import api

urlpatterns = [
    path("loadtests/", api.LoadTestList.as_view(), name="api-loadtests"),
    path("loadtests/compare/", api.LoadTestCompare.as_view(), name="api-loadtest-compare"),
    path("loadtests/export/", api.LoadTestExport.as_view(), name="api-loadtest-export"),
    path("loadtests/<int:pk>/", api.LoadTestDetail.as_view(), name="api-loadtest"),
    path("loadtests/<int:pk>/cancel/", api.LoadTestCancel.as_view(), name="api-loadtest-cancel"),
    path("loadtests/<int:pk>/records/", api.LoadTestRecords.as_view(), name="api-loadtest-records"),
    path("tuning/", api.TuningList.as_view(), name="api-tuning-runs"),
    path("tuning/<int:pk>/", api.TuningDetail.as_view(), name="api-tuning-run"),
    path("tuning/<int:pk>/cancel/", api.TuningCancel.as_view(), name="api-tuning-cancel"),
    path("tuning/<int:pk>/apply/", api.TuningApply.as_view(), name="api-tuning-apply"),
    path("tuning/<int:pk>/export/", api.TuningExport.as_view(), name="api-tuning-export"),
]
