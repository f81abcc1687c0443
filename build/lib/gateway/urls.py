from django.urls import path

from gateway import api

urlpatterns = [
    path("gateway/aliases/", api.AliasList.as_view(), name="api-gateway-aliases"),
    path("gateway/aliases/<int:pk>/", api.AliasDetail.as_view(), name="api-gateway-alias"),
    path("gateway/keys/", api.KeyList.as_view(), name="api-gateway-keys"),
    path("gateway/keys/<int:pk>/", api.KeyDetail.as_view(), name="api-gateway-key"),
    path("gateway/keys/<int:pk>/revoke/", api.KeyRevoke.as_view(), name="api-gateway-key-revoke"),
    path("gateway/usage/", api.UsageList.as_view(), name="api-gateway-usage"),
]
