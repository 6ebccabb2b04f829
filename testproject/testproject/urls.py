from demo import views
from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("pgqueue/", include("django_pgqueue.urls")),
    path("demo/orders/", views.place_order, name="demo-place-order"),
    path("demo/orders/async/", views.place_order_async, name="demo-place-order-async"),
    path(
        "demo/orders/async/with-writes/",
        views.place_order_with_writes,
        name="demo-place-order-with-writes",
    ),
]
