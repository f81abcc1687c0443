"""Responses of Gantry's causal-LM python model, sent off its generation thread.

Gantry copies this file beside causal_lm_model.py. The python backend's
``send()`` is a blocking round trip to Triton's core (0.2-0.5 ms, the GIL
released while it waits; response_sender.cc), and so is ``is_cancelled()``:
done on the generation thread, 32 streams' sends took about 7 ms of an 11 ms
step. Here the generation thread only queues what each response says (a
``Piece``), and sender threads (``Sender``'s lanes) build the responses and
send them. A request keeps one lane, so its responses leave in the order they
were made and its final flag last; what piles up for one sequence while its
lane is busy leaves as one response (the text joined, the tokens and
log-probabilities added up). Each lane also asks whether its requests' clients
went away, each request every CANCEL_CHECK_S (a request answered whole sends
nothing until its end, so this cannot wait for its responses), and the
generation thread reads the answer (``Request.cancelled``) without a round trip.
"""

import json
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Seconds between two is_cancelled() calls for one request (each a round trip to Triton's core).
CANCEL_CHECK_S = 0.05
LANES = 4  # sender threads: a step's sends spread over them, each request on one
WATCH = ("watch", "")  # a new request, for its lane to ask after


@dataclass
class Piece:
    """What one response of a sequence says."""

    text: str
    prompt_tokens: int
    output_tokens: int  # the tokens it adds
    index: int  # the sequence's index in its request
    entries: list | None  # its tokens' logprobs entries, when asked
    final: bool = False  # the request's last response (FINAL flag)

    def join(self, later: "Piece") -> "Piece":
        """This piece and a later one of the same sequence, as one response."""
        entries = None if self.entries is None else self.entries + (later.entries or [])
        return Piece(self.text + later.text, later.prompt_tokens, self.output_tokens + later.output_tokens,
                     self.index, entries, later.final)  # fmt: skip

    def response(self):
        tensors = [
            pb_utils.Tensor("text_output", np.array([self.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("num_input_tokens", np.array([self.prompt_tokens], dtype=np.int32)),
            pb_utils.Tensor("num_output_tokens", np.array([self.output_tokens], dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.array([self.index], dtype=np.int32)),
        ]
        if self.entries is not None:
            encoded = json.dumps(self.entries).encode("utf-8")
            tensors.append(pb_utils.Tensor("log_probs", np.array([encoded], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)


class Request:
    """One request: its response sender, shared by the sequences it asked for; the
    last of them to finish makes the final response. Its state (closed, how many
    sequences are left) is the generation thread's; ``cancelled`` is its lane's."""

    def __init__(self, request, count, sender):
        self.triton = request.get_response_sender()
        self.left = count
        self.closed = False
        self.cancelled = False  # its client went away (its lane asked Triton)
        self.ended = False  # its last response left (its lane's)
        self.lane = sender.lane()
        self.sender = sender

    def watch(self):
        """From now on its lane asks whether its client went away. Not before its
        request is accepted: asking after a request Triton has let go of crashes the
        model's process."""
        self.sender.put(self, WATCH)

    def send(self, piece, *, last_of_sequence):
        if self.closed:
            return
        if last_of_sequence:
            self.left -= 1
        piece.final = last_of_sequence and self.left == 0
        self.closed = piece.final
        self.sender.put(self, piece)

    def fail(self, message):
        if not self.closed:
            self.closed = True
            self.sender.put(self, ("fail", message))

    def cancel(self):
        if not self.closed:
            self.closed = True
            self.sender.put(self, ("cancel", ""))


class Sender:
    """The model's sender threads (LANES of them)."""

    def __init__(self, log_error, lanes=LANES):
        self.log_error = log_error
        self.queues = [queue.SimpleQueue() for _ in range(lanes)]
        self.next = 0
        self.threads = [
            threading.Thread(target=self._run, args=(q,), name=f"gantry-send-{i}", daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for thread in self.threads:
            thread.start()

    def lane(self):
        """A lane for a new request, in turn."""
        self.next = (self.next + 1) % len(self.queues)
        return self.next

    def put(self, owner, item):
        self.queues[owner.lane].put((owner, item))

    def stop(self):
        for q in self.queues:
            q.put(None)
        for thread in self.threads:
            thread.join(timeout=10)

    def _run(self, lane):
        watched, checked = {}, time.monotonic()  # the lane's requests not ended yet
        while True:
            try:
                batch = [lane.get(timeout=CANCEL_CHECK_S)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(lane.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch
            batch = [entry for entry in batch if entry is not None]
            watched.update((id(owner), owner) for owner, item in batch if item is WATCH)
            for owner, item in joined([entry for entry in batch if entry[1] is not WATCH]):
                try:
                    self._send(owner, item)
                except Exception as exc:  # noqa: BLE001 - a client gone mid-send: the generation stops for it
                    owner.cancelled = True
                    self.log_error(f"a response could not be sent: {exc}")
                if owner.ended:
                    watched.pop(id(owner), None)
            if stopping:
                return
            if time.monotonic() - checked >= CANCEL_CHECK_S:
                checked = time.monotonic()
                for owner in list(watched.values()):
                    try:
                        owner.cancelled = owner.cancelled or owner.triton.is_cancelled()
                    except Exception:  # noqa: BLE001 - a request Triton no longer knows: nobody waits for it
                        owner.cancelled = True

    @staticmethod
    def _send(owner, item):
        if isinstance(item, Piece):
            owner.ended = item.final
            owner.triton.send(item.response(), flags=FINAL if item.final else 0)
        elif item[0] == "fail":
            owner.ended = True
            error = pb_utils.TritonError(item[1])
            owner.triton.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        else:
            owner.ended = True
            owner.triton.send(flags=FINAL)


def joined(batch):
    """A lane's waiting (request, item) pairs with each sequence's pieces joined into
    one, each placed where its last part was, so a request's final response stays its
    last; a request's failure or cancellation (items that are not pieces) ends it."""
    merged, order = {}, {}
    for position, (owner, item) in enumerate(batch):
        key = (id(owner), item.index if isinstance(item, Piece) else "end")
        if key in merged and isinstance(item, Piece):
            item = merged[key][1].join(item)
        merged[key] = (owner, item)
        order[key] = position
    return [merged[key] for key in sorted(merged, key=order.get)]
