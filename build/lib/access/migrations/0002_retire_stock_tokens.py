"""Retire DRF's stock tokens: each keeps working as a personal token (only its
digest is kept), then the table that held them in plain text is dropped."""

import hashlib

from django.db import migrations

STOCK_TABLE = "authtoken_token"


def import_stock_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if STOCK_TABLE not in connection.introspection.table_names():
        return
    ApiToken = apps.get_model("access", "ApiToken")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT key, user_id, created FROM {STOCK_TABLE}")
        rows = cursor.fetchall()
    for key, user_id, created in rows:
        digest = hashlib.sha256(key.encode()).hexdigest()
        ApiToken.objects.get_or_create(
            digest=digest,
            defaults={"user_id": user_id, "name": "imported stock token", "prefix": key[:10], "created_at": created},
        )
    schema_editor.execute(f"DROP TABLE {STOCK_TABLE}")


class Migration(migrations.Migration):
    dependencies = [("access", "0001_tokens_and_idempotency")]

    operations = [migrations.RunPython(import_stock_tokens, migrations.RunPython.noop)]
