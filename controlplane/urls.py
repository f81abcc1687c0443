from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from gateway.views import gateway_page

urlpatterns = [
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("deployments.api.urls")),
    path("api/", include("playground.urls")),
    path("api/", include("gateway.urls")),
    path("gateway/", gateway_page, name="gateway"),
    path("", include("deployments.web.urls")),
]

handler404 = "controlplane.errors.not_found"
handler500 = "controlplane.errors.server_error"
