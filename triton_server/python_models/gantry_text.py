"""Generated token ids to streamed text, for Gantry's python-backend models.

Gantry copies this file beside a generating model's model.py (the python
backend puts that folder on sys.path). A piece of text is only certain once the
tokens after it are known: a SentencePiece token's leading space is dropped
when it is decoded alone, a WordPiece "##" continuation joins the word before
it, and a character split over several byte tokens is garbage until its last
byte arrives. So the whole output is decoded each time a token arrives and only
what is certain is sent: never a trailing replacement character, and never a
tail that may still become a stop string.
"""


class TextStream:
    """The text of one generation as its tokens arrive."""

    def __init__(self, tokenizer, stops=(), skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.stopped = False  # a stop string ended the text

    def add(self, tokens):
        """Take new token ids; return the text that became certain (maybe empty)."""
        self.ids.extend(int(t) for t in tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                text, self.stopped = text[:at], True
        self.text = text
        if self.stopped:
            return self.finish()
        # Hold back a character that may still change (an incomplete UTF-8 sequence)
        # and a tail that may be the start of a stop string.
        certain = len(text.rstrip("\ufffd"))
        if self.stops:
            hold = max(len(s) for s in self.stops) - 1
            certain = min(certain, max(self.sent, len(text) - hold))
        return self._take(certain)

    def finish(self):
        """The rest of the text, once no token will follow."""
        return self._take(len(self.text))

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
