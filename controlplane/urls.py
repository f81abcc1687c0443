from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from access.views import LoginView, tokens_page
from controlplane.health import healthz
from deployments.web.hub_relay import relay as hub_relay
from gateway.views import gateway_page

urlpatterns = [
    path("admin/", admin.site.urls),
    path("login/", LoginView.as_view(), name="login"),
    path("healthz", healthz, name="healthz"),
    path("hub/<path:path>", hub_relay, name="hub-relay"),  # GPU hosts' downloads through the control plane
    # Browsers ask for /favicon.ico where a page names no icon (the API's browsable pages).
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("oidc/", include("mozilla_django_oidc.urls")),  # single sign-on (access/oidc.py)
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # The docs are pages: a signed-out visitor is sent to sign in (the schema itself answers 401).
    path("api/docs/", login_required(SpectacularSwaggerView.as_view(url_name="api-schema")), name="api-docs"),
    # Redoc drew a logo from its maker's CDN on every view (an outside request from a
    # private control plane); Swagger UI serves the same schema from the sidecar.
    path("api/redoc/", RedirectView.as_view(pattern_name="api-docs", permanent=True), name="api-redoc"),
    path("api/", include("hosts.urls")),
    path("api/", include("deployments.api.urls")),
    path("api/", include("inference.urls")),
    path("api/", include("gateway.urls")),
    path("api/", include("access.urls")),
    path("api/", include("loadtests.urls")),
    path("gateway/", gateway_page, name="gateway"),
    path("tokens/", tokens_page, name="tokens"),
    path("", include("loadtests.web_urls")),
    path("", include("deployments.web.urls")),
]

handler400 = "controlplane.errors.bad_request"
handler403 = "controlplane.errors.forbidden"
handler404 = "controlplane.errors.not_found"
handler500 = "controlplane.errors.server_error"
