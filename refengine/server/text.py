"""Token ids <-> text for the HTTP layer: bounded tokenization, incremental detokenization, stop strings and
stop tokens, OpenAI logprob shapes."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

from refengine.runner.logits import TopK


class PromptTooLong(ValueError):
    def __init__(self, tokens: int | None, limit: int, chars: int):
        what = f"{tokens} tokens" if tokens is not None else f"{chars} characters (more than {limit} tokens)"
        super().__init__(f"the prompt is {what}: the model's context is {limit} tokens")


class Detok:
    """Decode ids (or spell them as ' 12 34' when the checkpoint has no tokenizer); encode with a bound."""

    def __init__(self, tokenizer: Any | None):
        self.tok = tokenizer
        # the longest token in bytes: a text of more than limit * this many characters has more than limit tokens
        vocab = tokenizer.get_vocab(with_added_tokens=True) if tokenizer is not None else {}
        self.max_token_bytes = max((len(k.encode()) for k in vocab), default=1)

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f" {i}" for i in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def token(self, i: int) -> str:
        if self.tok is None:
            return f" {i}"
        return self.tok.decode([i], skip_special_tokens=False)

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of text; PromptTooLong when it has more than `limit` tokens, decided from its length alone
        when that suffices (no tokenization). encode_batch releases the GIL (encode does not): called from a
        worker thread, the event loop keeps running; the ids are only listed when within the limit."""
        if self.tok is None:
            raise ValueError("this checkpoint has no tokenizer.json: send the prompt as token ids")
        if limit is not None and len(text) > limit * self.max_token_bytes:
            raise PromptTooLong(None, limit, len(text))
        (enc,) = self.tok.encode_batch([text])
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc), limit, len(text))
        return list(enc.ids)


class IncrementalDetok:
    """Each token's new text as tokens arrive (vLLM's prefix/read-offset window): a token that ends inside a
    multi-byte character adds "" and the token completing it adds the character, so the pieces concatenate to
    decode(ids) and each decode covers a few tokens."""

    def __init__(self, detok: Detok):
        self.detok, self.prefix, self.read = detok, 0, 0
        self.ids: list[int] = []

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        if self.detok.tok is None:
            self.read = len(self.ids)
            return f" {tid}"
        before = self.detok.decode(self.ids[self.prefix : self.read])
        now = self.detok.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """The text still held (a character left incomplete at the end)."""
        before = self.detok.decode(self.ids[self.prefix : self.read])
        now = self.detok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


class TextState:
    """One choice's output as tokens arrive, one token at a time (so the result depends on the tokens only,
    not on how the engine grouped them into updates):

    - a stop token (`stop_ids`: stop_token_ids, and EOS when the server enforces min_tokens) ends it; it is
      kept (counted, with logprobs) but adds no text, as EOS does;
    - a stop string ends it at its first character; the kept tokens are those that produced text before it
      (a token straddling the stop is kept, one starting at it is not);
    - neither counts before `min_tokens` tokens.

    `take(final)` returns the next (text piece, first token, end token) safe to send: text that cannot be the
    start of a stop string, tokens whose text lies within the text sent. Pieces and token ranges concatenate
    to `text` and `kept_ids`, so a stream carries every kept token exactly once, with the offsets of `offsets`.
    """

    def __init__(self, detok: Detok, stops: list[str], stop_ids: frozenset[int] = frozenset(), min_tokens: int = 0):
        self.inc = IncrementalDetok(detok)
        self.stops, self.stop_ids, self.min_tokens = stops, stop_ids, min_tokens
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.ends: list[int] = []  # len(text) after each token (non-decreasing)
        self.text = ""
        self.sent = 0
        self.sent_tokens = 0
        self.stopped = False
        self.n_kept: int | None = None  # set when stopped
        self.flushed = False

    def add(self, ids: list[int]) -> None:
        for tid in ids:
            if self.stopped:
                return
            n = len(self.ids)
            self.ids.append(tid)
            if tid in self.stop_ids and n >= self.min_tokens:
                self.ends.append(len(self.text))
                self.stopped, self.n_kept = True, n + 1
                return
            self._extend(self.inc.push(tid))

    def _extend(self, piece: str) -> None:
        prev = len(self.text)
        self.text += piece
        if self.ends and self.flushed:
            self.ends[-1] = len(self.text)
        else:
            self.ends.append(len(self.text))
        if not piece or len(self.ids) < self.min_tokens:
            return
        cuts = [i for i in (self.text.find(s, max(0, prev - len(s) + 1)) for s in self.stops) if i >= 0]
        if cuts:
            cut = min(cuts)
            self.text = self.text[:cut]
            self.stopped, self.n_kept = True, self._cover(cut)

    def _cover(self, c: int) -> int:
        """The fewest tokens whose text reaches c characters."""
        return 0 if c == 0 else bisect_left(self.ends, c) + 1

    def take(self, final: bool) -> tuple[str, int, int]:
        if final and not self.stopped and not self.flushed:
            self.flushed = True
            rest = self.inc.flush()
            if rest:
                self._extend(rest)
        if final or self.stopped:
            end, hi = len(self.text), len(self.kept_ids)
        else:
            end = max(self.sent, len(self.text) - self.hold)
            hi = min(bisect_right(self.ends, end), self._cover(end))  # tokens whose text is all sent
        piece, self.sent = self.text[self.sent : end], end
        lo, self.sent_tokens = self.sent_tokens, max(self.sent_tokens, hi)
        return piece, lo, self.sent_tokens

    @property
    def kept_ids(self) -> list[int]:
        return self.ids[: self.n_kept] if self.n_kept is not None else self.ids

    def offsets(self, lo: int, hi: int, base: int = 0) -> list[int]:
        """Where in the text tokens lo..hi start (plus base, the echoed prompt's length)."""
        return [base + (self.ends[i - 1] if i else 0) for i in range(lo, hi)]


def _lp_of(tid: int, row: TopK) -> float:
    top_ids, top_lp = row
    return top_lp[top_ids.index(tid)] if tid in top_ids else top_lp[0]


def completion_logprobs(detok: Detok, ids: list[int], rows: list[TopK], n: int, offsets: list[int]) -> dict[str, list]:
    """OpenAI completions `logprobs` for generated tokens: rows[i] is the top-k at the position of ids[i]."""
    return {
        "tokens": [detok.token(t) for t in ids],
        "token_logprobs": [_lp_of(t, r) for t, r in zip(ids, rows)],
        "top_logprobs": [{detok.token(t): lp for t, lp in zip(r[0][:n], r[1][:n])} for r in rows[: len(ids)]],
        "text_offset": offsets,
    }


def chat_logprobs(detok: Detok, ids: list[int], rows: list[TopK], n: int) -> dict[str, list]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for tid, row in zip(ids, rows):
        s = detok.token(tid)
        top = [
            {"token": detok.token(t), "logprob": v, "bytes": list(detok.token(t).encode())}
            for t, v in zip(row[0][:n], row[1][:n])
        ]
        content.append({"token": s, "logprob": _lp_of(tid, row), "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
