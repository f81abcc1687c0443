"""The transactional outbox: the one way Gantry sends work to a host's worker.

``enqueue_on_commit`` writes the task as a row in the caller's transaction, so
a status change and the work it asks for commit together or not at all. Once
the transaction commits, the process's sender thread hands the row to the
broker and deletes it; the request that asked never waits on the broker (a
down Redis costs its client seconds of retries). When the broker is
unreachable the row stays: the host agent (each beat) and the control plane's
sweep send what is left with ``relay``, and the timeline says how long each
task waited. A message sent twice (a sender that died between the broker
taking it and the delete) is harmless: every task re-reads its row and acts
only on the state it expects.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import F
from django.utils import timezone

from core import events, queues
from hosts.models import GpuHost, OutboxMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostTask:
    """A task Gantry sends a host's worker, registered once by the service that
    owns its rows (``register``): what the timeline says its sends are about,
    and how the rows on a host that wait for it send it again when the broker
    may have lost it (a restart: ``resend_waiting``)."""

    name: str  # as core.queues names it
    # Its first argument (a row's id) as event fields: {"deployment": ...}; {} when the row is gone.
    about: Callable[[int], dict[str, Any]] | None = None
    # (host name, source, message): send the task again for every row on the host that waits
    # for it (or for a sibling task: a replica's status says which); what was sent, in words.
    resend_waiting: Callable[[str, str, str], list[str]] | None = None


TASKS: dict[str, HostTask] = {}


def register(task: HostTask) -> HostTask:
    """Add a host task to the registry (once, where its rows' services are)."""
    if task.name in TASKS and TASKS[task.name] != task:
        raise ValueError(f"host task {task.name!r} is registered twice")
    TASKS[task.name] = task
    return task


def resend_waiting(*, host_name: str, source: str, message: str) -> list[str]:
    """Send again every registered task that a row on ``host_name`` waits for; what was sent."""
    sent: list[str] = []
    for task in TASKS.values():
        if task.resend_waiting is not None:
            sent += task.resend_waiting(host_name, source, message)
    return sent


# A task sent this long after it was asked for (or after the broker refused it) is noted on the timeline.
NOTE_DELAY_S = 5.0
# A task's header naming when the broker took it (epoch seconds).
SENT_AT_HEADER = "gantry_sent_at"
# A message the broker refuses this many times while answering others is parked (a dead letter).
PARK_AFTER = 3


def enqueue_on_commit(task_name: str, *, host_name: str, args: list[Any]) -> OutboxMessage:
    """Ask ``host_name``'s worker for ``task_name(*args)``: written now, sent once the
    current transaction commits (and later, by ``relay``, if the broker is down)."""
    message = OutboxMessage.objects.create(task=task_name, queue=queues.queue_for(task_name, host_name), args=args)
    transaction.on_commit(lambda: send_soon(message.pk))
    return message


class _Sender:
    """One daemon thread per process that sends committed messages in order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ids: SimpleQueue[int] = SimpleQueue()
        threading.Thread(target=self._run, name="gantry-outbox", daemon=True).start()

    def _run(self) -> None:
        while True:
            ids = [self.ids.get()]
            while not self.ids.empty():
                ids.append(self.ids.get_nowait())
            try:
                close_old_connections()
                send(ids=ids)
            except Exception:  # noqa: BLE001 - the relay sends what this could not
                log.exception("the outbox sender failed; the relay will send these")
            finally:
                connection.close()


_sender: _Sender | None = None
_sender_lock = threading.Lock()


def send_soon(message_id: int) -> None:
    """Hand a committed message to this process's sender thread (started on
    first use, and again in a forked child, where the parent's thread is gone)."""
    global _sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid():
            _sender = _Sender()
    _sender.ids.put(message_id)


def is_waiting(task_name: str, subject_id: int) -> bool:
    """Whether a ``task_name`` for object ``subject_id`` still waits to be sent."""
    return OutboxMessage.objects.filter(task=task_name, args__0=subject_id, parked_at__isnull=True).exists()


def redrive(task_name: str, *, host_name: str, args: list[Any], source: str, message: str, **subject: Any) -> bool:
    """Send a task again whose first message may be lost (with a worker that
    died, or inside a broker that restarted), noting it on the subject's
    timeline; False when one still waits here anyway. Call inside a transaction
    that has locked the subject's row."""
    if is_waiting(task_name, args[0]):
        return False
    events.record(
        kind="task.redriven",
        source=source,
        host=GpuHost.objects.filter(name=host_name).first(),
        message=message,
        data={"task": task_name, "args": _shown(args)},
        **subject,
    )
    enqueue_on_commit(task_name, host_name=host_name, args=args)
    return True


def send(*, ids: Iterable[int] | None = None, host_name: str | None = None) -> int:
    """Hand waiting messages (these ``ids``, or all for ``host_name``, or all) to the
    broker, oldest first. Returns how many were sent. Never raises for a broker
    that is down: the first refusal while it does not answer a ping stops the
    pass (relay tries again on the next beat). A refusal while it answers is
    the message's own: the message is skipped this pass, and parked for good
    after PARK_AFTER of them, so one poisoned message never blocks its queue."""
    if settings.GANTRY_JOINED_HOST:  # its Redis user reaches its own queues only; the beat sends the rest
        host_name = settings.GANTRY_HOST_NAME
    sent = 0
    skipped: list[int] = []
    while True:
        with transaction.atomic():
            rows = OutboxMessage.objects.select_for_update(skip_locked=True).filter(parked_at__isnull=True)
            rows = rows.exclude(pk__in=skipped).order_by("id")
            if ids is not None:
                rows = rows.filter(pk__in=list(ids))
            if host_name is not None:
                rows = rows.filter(queue__in=queues.host_queues(host_name))
            message = rows.first()
            if message is None:
                return sent
            try:
                # No retries here: a down broker must not hold a request (or a
                # row lock) for seconds; relay tries again on the next beat.
                # SENT_AT_HEADER: how long a task has waited in the queue (controlplane.metrics).
                current_app.send_task(
                    message.task, args=message.args, queue=message.queue, retry=False,
                    headers={SENT_AT_HEADER: time.time()},
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - any broker failure leaves the message waiting
                if not _broker_answers():
                    _failed(message, exc, park=False)
                    log.warning("broker unreachable; %s waits in the outbox: %s", message, exc)
                    return sent
                _failed(message, exc, park=message.attempts + 1 >= PARK_AFTER)
                skipped.append(message.pk)
                continue
            message.delete()
            waited = (timezone.now() - message.created_at).total_seconds()
            if message.attempts or waited >= NOTE_DELAY_S:
                _note_sent_late(message, waited)
        sent += 1


def _broker_answers() -> bool:
    """Whether the broker answers a ping now (a refusal then was the message's own)."""
    try:
        with current_app.connection_for_write() as conn:
            return bool(conn.default_channel.client.ping())
    except Exception:  # noqa: BLE001 - any failure means it does not answer
        return False


def _failed(message: OutboxMessage, exc: Exception, *, park: bool) -> None:
    error = f"{type(exc).__name__}: {exc}"[:255]
    OutboxMessage.objects.filter(pk=message.pk).update(
        attempts=F("attempts") + 1, last_error=error, parked_at=timezone.now() if park else None
    )
    if park:
        log.error("the broker refused %s %d times while answering; parked: %s", message, PARK_AFTER, error)
        events.record(
            kind="task.parked",
            source="system",
            host=_host(message),
            message=f"the broker refused the {_what(message)} {PARK_AFTER} times while it answered others "
            f"({error}); it is parked in the outbox (message {message.pk}) and will not be sent again",
            data={"task": message.task, "outbox_message": message.pk, "error": error},
            **_subject(message),
        )
    elif message.attempts == 0:
        _note_waiting(message, exc)


def relay(*, host_name: str | None = None) -> int:
    """Send what the broker could not take when it was asked (see ``send``)."""
    return send(host_name=host_name)


def _subject(message: OutboxMessage) -> dict[str, Any]:
    task = TASKS.get(message.task)
    if task is None or task.about is None or not message.args:
        return {}
    return task.about(message.args[0])


def _shown(args: list[Any]) -> list[Any]:
    """A task's arguments as the timeline shows them: ids, never a secret (a load test's gateway key)."""
    return [arg if isinstance(arg, int) else "(hidden)" for arg in args]


def _host(message: OutboxMessage) -> GpuHost | None:
    return GpuHost.objects.filter(name=queues.host_of(message.queue)).first()


def _what(message: OutboxMessage) -> str:
    return f"{message.task.rsplit('.', 1)[-1].replace('_', ' ')} task"


def _note_waiting(message: OutboxMessage, exc: Exception) -> None:
    events.record(
        kind="task.waiting",
        source="system",
        host=_host(message),
        message=f"the broker is unreachable ({type(exc).__name__}); the {_what(message)} waits in the "
        "outbox and is sent as soon as the broker is back",
        data={"task": message.task, "args": _shown(message.args), "error": str(exc)[:255]},
        **_subject(message),
    )


def _note_sent_late(message: OutboxMessage, waited: float) -> None:
    events.record(
        kind="task.redriven",
        source="system",
        host=_host(message),
        message=f"sent the {_what(message)} {waited:.0f}s after it was asked for (the broker was unreachable)",
        data={"task": message.task, "args": _shown(message.args), "waited_s": round(waited, 1)},
        **_subject(message),
    )
