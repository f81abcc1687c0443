from django.urls import path

from hosts import api

urlpatterns = [
    path("hosts/", api.HostList.as_view(), name="api-hosts"),
    path("hosts/join-tokens/", api.HostJoinTokens.as_view(), name="api-host-join-tokens"),
    path("hosts/join/", api.HostJoin.as_view(), name="api-host-join"),
    path("hosts/<str:name>/", api.HostDetail.as_view(), name="api-host"),
    path("hosts/<str:name>/revoke/", api.HostRevoke.as_view(), name="api-host-revoke"),
    path("hosts/<str:name>/cordon/", api.HostCordon.as_view(), name="api-host-cordon"),
    path("hosts/<str:name>/uncordon/", api.HostUncordon.as_view(), name="api-host-uncordon"),
    path("hosts/<str:name>/drain/", api.HostDrain.as_view(), name="api-host-drain"),
]
