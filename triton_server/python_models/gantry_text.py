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
