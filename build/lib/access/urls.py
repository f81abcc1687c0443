from django.urls import path

from access import api

urlpatterns = [
    path("tokens/", api.TokenList.as_view(), name="api-tokens"),
    path("tokens/<int:pk>/", api.TokenDetail.as_view(), name="api-token"),
    path("tokens/<int:pk>/revoke/", api.TokenRevoke.as_view(), name="api-token-revoke"),
]
