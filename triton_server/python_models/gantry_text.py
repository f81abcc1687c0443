"""Generated token ids to streamed text, for Gantry's python-backend models.

Gantry copies this file beside a generating model's model.py (the python
backend puts that folder on sys.path). A piece of text is only certain once the
tokens after it are known: a SentencePiece token's leading space is dropped
when it is decoded alone, a WordPiece "##" continuation joins the word before
it, and a character split over several byte tokens is garbage until its last
byte arrives. So each new token is decoded with the tokens before it that were
not yet certain and the last ones that were (their context), and only what is
certain is sent: never a trailing replacement character, and never a tail that
may still become a stop string.

(Decoding the whole output again for each token, as this did before, cost a
quarter of the generation thread at 32 streams of 128 tokens on the H100, and
grows with each token: docs/performance.md.)
"""


class TextStream:
    """The text of one generation as its tokens arrive."""

    def __init__(self, tokenizer, stops=(), skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.text = ""  # the text decoded so far (a stop string and what followed it cut off)
        self.sent = 0  # characters of text already handed out
        self.stopped = False  # a stop string ended the text
        # ids[context:read] were decoded into text already: the context the tokens
        # after them are decoded with; ids[read:] are not in text yet.
        self.context = 0
        self.read = 0

    def add(self, tokens):
        """Take new token ids; return the text that became certain (maybe empty)."""
        self.ids.extend(int(t) for t in tokens)
        if not self.stopped:
            self._extend(complete=False)
        if self.stopped:
            return self.finish()
        # Hold back a tail that may be the start of a stop string.
        certain = len(self.text)
        if self.stops:
            hold = max(len(s) for s in self.stops) - 1
            certain = min(certain, max(self.sent, len(self.text) - hold))
        return self._take(certain)

    def finish(self):
        """The rest of the text, once no token will follow."""
        if not self.stopped:
            self._extend(complete=True)
        return self._take(len(self.text))

    def _extend(self, complete):
        """Add to text what ids[read:] decode to after their context: only once it
        ends in a whole character, unless ``complete`` (no token follows)."""
        if self.read == len(self.ids):
            return
        known = self._decode(self.ids[self.context : self.read]) if self.read > self.context else ""
        text = self._decode(self.ids[self.context :])
        if len(text) <= len(known) or (text.endswith("\ufffd") and not complete):
            return  # nothing yet, or a character still incomplete: wait for the next token
        seen = len(self.text)
        self.text += text[len(known) :]
        self.context, self.read = self.read, len(self.ids)
        for stop in self.stops:  # a stop string the new text completes, earlier than any before
            at = self.text.find(stop, max(0, seen - len(stop) + 1))
            if at != -1:
                self.text, self.stopped = self.text[:at], True

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _take(self, upto):
        if upto <= self.sent:
            return ""
        piece = self.text[self.sent : upto]
        self.sent = upto
        return piece


def logit_bias(ids, values, vocab):
    """logit_bias_ids and logit_bias_values (lists) as (token id, value) pairs, checked
    the same way by every generating model; ValueError names the rule broken."""
    if len(ids) != len(values):
        raise ValueError("logit_bias_ids and logit_bias_values must be as long as each other")
    if any(not 0 <= int(i) < vocab for i in ids):
        raise ValueError(f"logit_bias_ids must be token ids below {vocab}")
    if any(not -100 <= v <= 100 for v in values):
        raise ValueError("logit_bias_values must be -100 to 100")
    return tuple(zip((int(i) for i in ids), values, strict=True))


class TokenTexts:
    """Each token's text and bytes, made once: OpenAI's logprobs entries. A token that
    holds part of a character decodes to a replacement character alone; its bytes
    are still its own (a byte-level BPE piece, or SentencePiece's <0xNN> fallback),
    so a client joins the bytes of a character's tokens into that character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known = {}

    def entry(self, token, logprob):
        """A token's logprobs entry: its text and UTF-8 bytes, and its log-probability."""
        known = self.known.get(token)
        if known is None:
            text = self.tokenizer.decode([token])
            known = self.known[token] = (text, list(self._bytes(token, text)))
        return {"token": known[0], "logprob": logprob, "bytes": known[1]}

    def _bytes(self, token, text):
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return text.encode("utf-8")


def _byte_level_alphabet():
    """Byte-level BPE's characters (GPT-2's): each byte as a printable character."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()
