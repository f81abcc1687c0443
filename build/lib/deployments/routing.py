from django.urls import path

from deployments import consumers

websocket_urlpatterns = [
    path("ws/dashboard/", consumers.LiveConsumer.as_asgi(), {"topic": "dashboard"}),
    path("ws/builds/<int:pk>/", consumers.LiveConsumer.as_asgi(), {"topic": "build"}),
    path("ws/deployments/<int:pk>/", consumers.LiveConsumer.as_asgi(), {"topic": "deployment"}),
]
