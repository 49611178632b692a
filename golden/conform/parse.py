"""Completions responses -> token ids and teacher-forced top-k rows, for refengine, vLLM and SGLang servers.

Fields read (all servers speak the OpenAI completions shape; `choices[i].logprobs` is read the same way):

- OpenAI completions `logprobs` (https://platform.openai.com/docs/api-reference/completions/object):
  `tokens` [str], `token_logprobs` [float|None], `top_logprobs` [{token string: logprob}|None].
  refengine (docs/SERVING.md): with `echo` + `logprobs` the prompt's entries come first (entry 0 is None),
  then the generated tokens'; a token string is the token decoded alone (`decode([id])`).
  SGLang (https://docs.sglang.io/basic_usage/openai_api_completions.html): the same OpenAI fields.
- vLLM (https://docs.vllm.ai/en/stable/serving/openai_compatible_server.html), extra request fields:
  `return_tokens_as_token_ids: true` makes every token string `token_id:N` (exact ids, no tokenizer needed);
  `prompt_logprobs: k` adds `choices[i].prompt_logprobs`: [None, {"<id>": {"logprob", "rank",
  "decoded_token"}}, ...], one dict per prompt token (the top-k plus the prompt token itself).

Token strings are mapped back to ids with the pair's tokenizer (TokenMap). Several ids can decode to the same
string (byte tokens of a partial UTF-8 character all read U+FFFD); such a string is resolved to the
reference's own id when that is one of its candidates, else to the lowest candidate, and counted as
`ambiguous` in the report. In a top-k row an ambiguous entry is left out (counted as `dropped`), except
the argmax, which keeps all its candidate ids (Row). Exact ids need `token_id:N` strings (vLLM's flag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from golden.errors import GoldenError

TOKEN_ID_PREFIX = "token_id:"


class ResponseError(GoldenError):
    """A completions answer that lacks the fields a check needs, or whose tokens cannot be mapped to ids."""


@dataclass
class TokenMap:
    """Token string -> candidate ids, from a tokenizer.json (or none: then only `token_id:N` strings and
    strings that are a bare integer, as a tokenizer-less refengine writes them, can be read)."""

    by_string: dict[str, list[int]] = field(default_factory=dict)
    ambiguous: int = 0  # strings resolved among several candidates so far
    dropped: int = 0  # non-argmax top-k entries left out because their string is ambiguous
    tokenizer: Any = None  # tokenizers.Tokenizer, for decode()

    @classmethod
    def from_tokenizer(cls, path: Path | None) -> TokenMap:
        if path is None:
            return cls()
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        by: dict[str, list[int]] = {}
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            by.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
        return cls(by_string=by, tokenizer=tok)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids` as a whole: the tokenizer's decode; without a tokenizer, each id's string joined
        (an empty map writes each id as " N", as a tokenizer-less refengine does)."""
        if self.tokenizer is None:
            if self.by_string:
                inverse = {i: s for s, cands in self.by_string.items() for i in cands}
                return "".join(inverse[i] for i in ids)
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def is_ambiguous(self, s: str) -> bool:
        return not s.startswith(TOKEN_ID_PREFIX) and len(self.by_string.get(s, ())) > 1

    def resolve(self, s: str, hints: Sequence[int] = ()) -> int:
        """The id of token string `s`; among several candidates, the first hint that is one of them."""
        if s.startswith(TOKEN_ID_PREFIX):
            return int(s[len(TOKEN_ID_PREFIX) :])
        cands = self.by_string.get(s)
        if cands is None:
            if not self.by_string and s.strip().lstrip("-").isdigit():
                return int(s.strip())
            raise ResponseError(f"token string {s!r} is not in the tokenizer's vocabulary (wrong --tokenizer?)")
        if len(cands) == 1:
            return cands[0]
        self.ambiguous += 1
        return next((h for h in hints if h in cands), cands[0])


def _choice(resp: dict, index: int = 0) -> dict:
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) <= index:
        raise ResponseError(f"answer has no choices[{index}]: keys {sorted(resp)}")
    return choices[index]


@dataclass(frozen=True)
class Row:
    """One teacher-forced row as a server reported it: `argmax` holds the candidate ids of its best entry
    (one id unless that token string is ambiguous), `ids` / `lps` its unambiguous entries, best first."""

    argmax: list[int]
    ids: list[int]
    lps: list[float]


@dataclass(frozen=True)
class ScoredSequence:
    name: str
    token_ids: list[int]
    rows: list[Row]  # row p: after token_ids[:p+1]


def _row(top: dict | None, tmap: TokenMap, what: str) -> Row:
    """Servers write top_logprobs best first; the first key is the argmax. A colliding string's value is
    whichever of its ids was written last, so values alone cannot place it: ambiguous entries are left out
    of ids / lps (counted in tmap.dropped) and the argmax keeps all its candidates."""
    if not top:
        raise ResponseError(f"{what}: no top_logprobs (did the server honour `logprobs`?)")
    first = next(iter(top))
    argmax = list(tmap.by_string[first]) if tmap.is_ambiguous(first) else [tmap.resolve(first)]
    if tmap.is_ambiguous(first):
        tmap.ambiguous += 1
    pairs = sorted(((float(lp), s) for s, lp in top.items() if not tmap.is_ambiguous(s)), key=lambda p: -p[0])
    tmap.dropped += len(top) - len(pairs)
    return Row(argmax, [tmap.resolve(s) for _, s in pairs], [lp for lp, _ in pairs])


def _vllm_row(entry: dict) -> Row:
    pairs = sorted(((float(v["logprob"]), int(k)) for k, v in entry.items()), key=lambda p: -p[0])
    return Row([pairs[0][1]], [t for _, t in pairs], [lp for lp, _ in pairs])


def scored_sequence(name: str, resp: dict, ids: Sequence[int], tmap: TokenMap) -> ScoredSequence:
    """The rows of an `echo` + `logprobs` (+ optional vLLM `prompt_logprobs`) answer sent with max_tokens 1.

    Row p (after ids[:p+1]) is entry p+1 of the prompt's logprobs for p < n-1, and the generated token's
    entry for p = n-1."""
    n = len(ids)
    choice = _choice(resp)
    plp = choice.get("prompt_logprobs")
    lp = choice.get("logprobs") or {}
    tops = lp.get("top_logprobs") or []
    if isinstance(plp, list) and len(plp) >= n:  # vLLM: exact ids
        rows = [_vllm_row(e) for e in plp[1:n]]
        gen_top = tops[-1] if tops else None
    else:
        if len(tops) < n + 1:
            raise ResponseError(
                f"{name}: {len(tops)} top_logprobs entries for a {n}-token echoed prompt + 1 generated "
                f"(want {n + 1}: does the server support `echo` with `logprobs`?)"
            )
        rows = [_row(tops[p + 1], tmap, f"{name} row {p}") for p in range(n - 1)]
        gen_top = tops[n]
    rows.append(_row(gen_top, tmap, f"{name} row {n - 1} (generated)"))
    return ScoredSequence(name, list(ids), rows)


def generated_ids(resp: dict, tmap: TokenMap, hints: Sequence[int] = (), index: int = 0) -> list[int]:
    """The generated token ids of a non-echo answer sent with `logprobs` >= 0 (read from `logprobs.tokens`);
    `hints[j]` (the reference's token at j) resolves an ambiguous string."""
    choice = _choice(resp, index)
    if isinstance(choice.get("token_ids"), list):  # SGLang/vLLM variants that return ids directly
        return [int(t) for t in choice["token_ids"]]
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        raise ResponseError("answer has no logprobs.tokens: the server must honour `logprobs` to report token ids")
    return [tmap.resolve(s, [hints[j]] if j < len(hints) else ()) for j, s in enumerate(lp["tokens"])]
