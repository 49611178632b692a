"""Token ids -> text for the HTTP layer: incremental detokenization, stop strings, OpenAI logprob shapes."""

from __future__ import annotations

from typing import Any

from refengine.runner.logits import TopK


class Detok:
    """Decode ids (or spell them as ' 12 34' when the checkpoint has no tokenizer)."""

    def __init__(self, tokenizer: Any | None):
        self.tok = tokenizer

    def decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f" {i}" for i in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def token(self, i: int) -> str:
        if self.tok is None:
            return f" {i}"
        return self.tok.decode([i], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise ValueError("this checkpoint has no tokenizer.json: send the prompt as token ids")
        return list(self.tok.encode(text).ids)


class TextState:
    """One choice's generated text as tokens arrive: stop strings cut it (finish "stop"); `take` returns the
    next piece that is safe to send (not a possible stop-string prefix, no half UTF-8 character)."""

    def __init__(self, detok: Detok, stops: list[str]):
        self.detok, self.stops = detok, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_at_token = 0  # tokens that produced text up to the stop string (logprobs are cut there)

    def add(self, ids: list[int]) -> None:
        if self.stopped:
            return
        self.ids += ids
        text = self.detok.decode(self.ids)
        cut = [i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if cut:
            text = text[: min(cut)]
            self.stopped = True
            n = 0
            while n < len(self.ids) and len(self.detok.decode(self.ids[:n])) < len(text):
                n += 1
            self.stop_at_token = n
        self.text = text

    def take(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    @property
    def kept_ids(self) -> list[int]:
        return self.ids[: self.stop_at_token] if self.stopped else self.ids


def completion_logprobs(detok: Detok, ids: list[int], rows: list[TopK], n: int, offset0: int = 0) -> dict[str, list]:
    """OpenAI completions `logprobs` for generated tokens: rows[i] is the top-k at the position of ids[i]."""
    tokens, lps, tops, offs = [], [], [], []
    off = offset0
    for tid, (top_ids, top_lp) in zip(ids, rows):
        s = detok.token(tid)
        tokens.append(s)
        lps.append(top_lp[top_ids.index(tid)] if tid in top_ids else top_lp[0])
        tops.append({detok.token(t): lp for t, lp in zip(top_ids[:n], top_lp[:n])})
        offs.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(detok: Detok, ids: list[int], rows: list[TopK], n: int) -> dict[str, list]:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for tid, (top_ids, top_lp) in zip(ids, rows):
        s = detok.token(tid)
        lp = top_lp[top_ids.index(tid)] if tid in top_ids else top_lp[0]
        top = [
            {"token": detok.token(t), "logprob": v, "bytes": list(detok.token(t).encode())}
            for t, v in zip(top_ids[:n], top_lp[:n])
        ]
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
