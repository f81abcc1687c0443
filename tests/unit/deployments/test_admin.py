"""The admin: builds read-only with their history."""

from __future__ import annotations

from deployments.services import builds
from tests import factories


def request(operator, **spec):  # noqa: ANN001, ANN003, ANN201
    return builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec=spec, user=operator)


def test_admin_shows_a_build_read_only_with_its_history(client, django_user_model, llama, operator):
    build, _ = request(operator)
    builds.build_claim(build_id=build.pk, source="worker:h100-host", output_dir="/x")
    builds.build_progress(build_id=build.pk, source="worker:h100-host", phase="converting")
    auditor = django_user_model.objects.create_superuser(username="auditor", password="pw")
    client.force_login(auditor)
    page = client.get(f"/admin/deployments/enginebuild/{build.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "build.requested" in text and "build.status" in text and "converting" in text
    assert f"user:{operator.username}" in text
    assert 'name="_save"' not in text  # read-only
    listing = client.get("/admin/deployments/enginebuild/?trtllm_version=0.16.0&compute_capability=9.0")
    assert listing.status_code == 200 and "llama" in listing.content.decode()
