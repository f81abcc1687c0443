from django.urls import path

from hosts import api

urlpatterns = [
    path("hosts/", api.HostList.as_view(), name="api-hosts"),
    path("hosts/join-tokens/", api.HostJoinTokens.as_view(), name="api-host-join-tokens"),
    path("hosts/join/", api.HostJoin.as_view(), name="api-host-join"),
    path("hosts/<str:name>/", api.HostDetail.as_view(), name="api-host"),
    path("hosts/<str:name>/revoke/", api.HostRevoke.as_view(), name="api-host-revoke"),
]
