import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from common.errors import PermissionDenied, ValidationFailed
from core.models import Event
from core.secrets import secret_digest
from gateway import services
from gateway.models import ApiKey, Usage
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_deployments(minilm, host):  # noqa: ANN001, ANN201
    first = factories.deployment(host=host, name="first")
    second = factories.deployment(host=host, name="second")
    return first, second


def test_an_alias_moves_in_one_step_and_lands_on_both_timelines(two_deployments, operator):  # noqa: ANN001
    first, second = two_deployments
    alias = services.alias_create(name="org/embed", deployment_id=first.pk, triton_name="minilm", user=operator)
    services.alias_move(alias_id=alias.pk, deployment_id=second.pk, triton_name="minilm", user=operator)
    alias.refresh_from_db()
    assert alias.deployment_id == second.pk
    moved = Event.objects.filter(kind="alias.moved")
    assert {e.deployment_id for e in moved} == {first.pk, second.pk}
    assert all("first/minilm to second/minilm" in e.message and e.actor == operator for e in moved)


def test_alias_refusals_name_the_field(two_deployments, operator, viewer):  # noqa: ANN001
    first, _ = two_deployments
    with pytest.raises(ValidationFailed) as missing:
        services.alias_create(name="a", deployment_id=first.pk, triton_name="nope", user=operator)
    assert missing.value.errors["model"] == ["first serves no model named 'nope' (it serves: minilm)"]
    with pytest.raises(ValidationFailed) as gone:
        services.alias_create(name="a", deployment_id=999, triton_name="minilm", user=operator)
    assert "deployment" in gone.value.errors
    services.alias_create(name="a", deployment_id=first.pk, triton_name="minilm", user=operator)
    with pytest.raises(ValidationFailed) as taken:
        services.alias_create(name="a", deployment_id=first.pk, triton_name="minilm", user=operator)
    assert "exists; move it instead" in taken.value.errors["name"][0]
    with pytest.raises(PermissionDenied):
        services.alias_create(name="b", deployment_id=first.pk, triton_name="minilm", user=viewer)


def test_a_key_is_stored_hashed_and_scoped(two_deployments, operator):  # noqa: ANN001
    first, _ = two_deployments
    services.alias_create(name="embed", deployment_id=first.pk, triton_name="minilm", user=operator)
    created = services.key_create(name="ci", user=operator, alias_names=["embed"], requests_per_minute=10)
    stored = ApiKey.objects.get(pk=created.key.pk)
    assert created.secret not in str(ApiKey.objects.filter(pk=stored.pk).values().first())
    assert stored.digest == secret_digest(created.secret) and stored.prefix == created.secret[:10]
    assert [a.name for a in stored.aliases.all()] == ["embed"] and stored.state == "active"
    with pytest.raises(ValidationFailed):
        services.key_create(name="x", user=operator, all_aliases=True, alias_names=["embed"])
    with pytest.raises(ValidationFailed) as past:
        services.key_create(name="x", user=operator, all_aliases=True, expires_at=timezone.now() - dt.timedelta(1))
    assert "expires_at" in past.value.errors
    assert services.key_revoke(key_id=stored.pk, user=operator).state == "revoked"


def test_usage_adds_up_per_key_alias_and_day(operator):  # noqa: ANN001
    key = services.key_create(name="u", user=operator, all_aliases=True).key
    today = timezone.now().date()
    for _ in range(2):
        services.usage_add(
            counts={
                (key.pk, "chat", today): services.Tally(requests=3, failed=1, prompt_tokens=10, completion_tokens=5)
            },
            last_used={key.pk: timezone.now()},
        )
    row = Usage.objects.get(key=key, alias="chat", day=today)
    assert (row.requests, row.failed, row.prompt_tokens, row.completion_tokens) == (6, 2, 20, 10)
    assert ApiKey.objects.get(pk=key.pk).last_used_at is not None


def test_a_new_key_is_shown_once_through_the_api(operator):  # noqa: ANN001
    client = APIClient()
    client.force_authenticate(operator)
    created = client.post("/api/gateway/keys/", {"name": "ci", "all_aliases": True}, format="json")
    assert created.status_code == 201 and created.json()["key"].startswith("gk-")
    assert "key" not in client.get(f"/api/gateway/keys/{created.json()['id']}/").json()
