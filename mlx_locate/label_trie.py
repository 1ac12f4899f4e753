"""The asked category names as a trie of token ids: what a label may continue with inside `<ref>...</ref>`
(docs/model.md §10.8).

A name's ids are what the tokenizer makes of `<ref>NAME</ref>` between the two added tokens, as an answer writes
it (after `<ref>` a name has no leading space; in the prompt it has one, so it encodes differently there). A
state is a node of the trie (`ROOT` just after `<ref>`) or `OUTSIDE` a label. Plain Python: the decoder walks it
on the host, and the step's summary applies the ids it allows as a mask (`sampling.label_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .tokens import TokenIds

OUTSIDE = -1  # not inside a <ref> span: nothing is restricted
ROOT = 0  # just after <ref>: the first token of any name


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LabelTrie:
    """Names as token-id paths. `allowed(state)` is what may follow inside a label: the next id of every name
    the label can still become, and `</ref>` where it already spells a whole name."""

    def __init__(self, names: Sequence[str], encoded: Sequence[Sequence[int]], ids: TokenIds):
        self.names = tuple(names)  # each path's label as the parser reads it
        self.ref_start, self.ref_end = ids.ref_start, ids.ref_end
        children: list[dict[int, int]] = [{}]
        whole = [False]
        for name, path in zip(names, encoded, strict=True):
            if not path:
                raise ValueError(f"category {name!r} encodes to no tokens")
            node = ROOT
            for token in path:
                if token not in children[node]:
                    children[node][token] = len(children)
                    children.append({})
                    whole.append(False)
                node = children[node][token]
            whole[node] = True
        self._children = children
        self._allowed = [
            tuple(sorted(c)) + ((self.ref_end,) if w else ()) for c, w in zip(children, whole, strict=True)
        ]

    @classmethod
    def of(cls, names: Sequence[str], tokenizer: Encoder, ids: TokenIds) -> LabelTrie:
        """The trie of `names` as `tokenizer` encodes each inside `<ref>...</ref>`; each named as its ids decode
        (the parser's label: the name in the tokenizer's normal form)."""
        encoded = []
        for name in names:
            full = tokenizer.encode(f"<ref>{name}</ref>")
            if len(full) < 3 or full[0] != ids.ref_start or full[-1] != ids.ref_end:
                raise ValueError(f"category {name!r} does not encode as a label between <ref> and </ref>")
            encoded.append(full[1:-1])
        return cls([tokenizer.decode(path).strip() for path in encoded], encoded, ids)

    def allowed(self, state: int) -> tuple[int, ...]:
        """The ids that may follow at `state` (a node, not `OUTSIDE`), ascending, `</ref>` last when allowed."""
        return self._allowed[state]

    def after(self, state: int, token: int) -> int:
        """The state once `token` is committed at `state`. `<ref>` opens a label; inside one, `</ref>` or an id
        that continues no name leaves it."""
        if token == self.ref_start:
            return ROOT
        if state == OUTSIDE:
            return OUTSIDE
        return self._children[state].get(token, OUTSIDE)

    def walk(self, state: int, tokens: Sequence[int]) -> int:
        for token in tokens:
            state = self.after(state, token)
        return state
