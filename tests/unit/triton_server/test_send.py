"""The causal-LM model's sender threads (python_models/gantry_send.py): responses
leave in each request's order with its final flag last, a sequence's waiting
pieces leave as one, and a client that went away is seen by the generation
thread. Triton's python backend exists only inside tritonserver: its response
sender is stood in for by one that records what it is given, and blocks as the
real one's round trip does (tests/integration run the real one)."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from triton_server.repository import PYTHON_MODELS

_errors: list[str] = []  # what the lanes log


class _Backend(types.ModuleType):
    """What gantry_send uses of triton_python_backend_utils."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self) -> None:
        super().__init__("triton_python_backend_utils")
        self.Tensor = lambda name, value: (name, value.tolist())  # noqa: N803
        self.InferenceResponse = lambda output_tensors, error=None: {"tensors": dict(output_tensors), "error": error}
        self.TritonError = lambda message: message


@pytest.fixture(scope="module")
def send():  # noqa: ANN201
    sys.modules.setdefault("triton_python_backend_utils", _Backend())
    sys.path.insert(0, str(PYTHON_MODELS))
    import gantry_send

    return gantry_send


class _TritonSender:
    """A request's response sender: each send blocks a while, as its round trip does."""

    def __init__(self) -> None:
        self.sent: list[tuple[dict | None, int]] = []
        self.gone = False  # its client went away
        self.checks = 0
        self.gate = threading.Event()
        self.gate.set()

    def send(self, response=None, flags=0) -> None:  # noqa: ANN001
        self.gate.wait(5)
        time.sleep(0.001)
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.gone


class _TritonRequest:
    def __init__(self, sender: _TritonSender) -> None:
        self.sender = sender

    def get_response_sender(self) -> _TritonSender:
        return self.sender


def _until(done, timeout_s: float = 10) -> None:  # noqa: ANN001
    """Wait for ``done()`` (the lanes work on threads of their own); the asserts after it say what failed."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def _texts(sent: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for response, _ in sent:
        if response is not None:
            index = response["tensors"]["sequence_index"][0]
            texts[index] = texts.get(index, "") + response["tensors"]["text_output"][0].decode()
    return texts


def test_a_requests_responses_leave_in_order_with_the_final_flag_last(send):
    sender = send.Sender(log_error=_errors.append, lanes=2)
    try:
        tritons = [_TritonSender() for _ in range(3)]
        owners = [send.Request(_TritonRequest(t), 2, sender) for t in tritons]
        for owner in owners:
            owner.watch()
        for step in range(20):
            for owner in owners:
                for index in (0, 1):
                    last = step == 19
                    owner.send(send.Piece(f"{step},", 5, 1, index, None), last_of_sequence=last)
        for triton in tritons:
            _until(lambda t=triton: t.sent and t.sent[-1][1] == 1)
            assert [flags for _, flags in triton.sent].count(1) == 1 and triton.sent[-1][1] == 1
            steps = ",".join(str(s) for s in range(20)) + ","
            assert _texts(triton.sent) == {0: steps, 1: steps}  # every piece, in order, per sequence
            counted = sum(r["tensors"]["num_output_tokens"][0] for r, _ in triton.sent)
            assert counted == 40
    finally:
        sender.stop()


def test_pieces_that_wait_for_a_busy_lane_leave_as_one_response(send):
    sender = send.Sender(log_error=_errors.append, lanes=1)
    try:
        triton = _TritonSender()
        triton.gate.clear()  # the lane's first send blocks until the others are queued
        owner = send.Request(_TritonRequest(triton), 1, sender)
        owner.send(send.Piece("a", 3, 1, 0, [{"token": "a"}]), last_of_sequence=False)
        time.sleep(0.05)  # the lane took "a" and waits in its send
        for text in "bcd":
            owner.send(send.Piece(text, 3, 1, 0, [{"token": text}]), last_of_sequence=False)
        owner.send(send.Piece("e", 3, 1, 0, [{"token": "e"}]), last_of_sequence=True)
        triton.gate.set()
        _until(lambda: len(triton.sent) >= 2)
        texts = [r["tensors"]["text_output"][0].decode() for r, _ in triton.sent]
        assert texts == ["a", "bcde"] and [flags for _, flags in triton.sent] == [0, 1]
        assert triton.sent[1][0]["tensors"]["num_output_tokens"] == [4]
    finally:
        sender.stop()


def test_a_client_gone_is_seen_by_the_generation_thread_without_a_round_trip(send):
    """Even for a request answered whole, which sends nothing until its end."""
    sender = send.Sender(log_error=_errors.append, lanes=1)
    try:
        triton = _TritonSender()
        owner = send.Request(_TritonRequest(triton), 1, sender)
        time.sleep(0.2)
        assert triton.checks == 0  # not watched before it is accepted
        owner.watch()
        time.sleep(0.5)
        assert not owner.cancelled and 3 <= triton.checks <= 0.5 / send.CANCEL_CHECK_S + 2  # asked, not hammered
        triton.gone = True
        _until(lambda: owner.cancelled)
        assert owner.cancelled and triton.sent == []
        owner.cancel()
        _until(lambda: triton.sent)
        assert triton.sent == [(None, 1)]  # the final flag alone ends it
        checks = triton.checks
        time.sleep(0.2)
        assert triton.checks == checks  # an ended request is asked after no more
    finally:
        sender.stop()
