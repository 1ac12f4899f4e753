"""Qwen2 byte-level BPE tokenizer, built with the `tokenizers` library (no transformers).

Checkpoints ship `vocab.json` + `merges.txt` + added tokens and no `tokenizer.json`; the pipeline built here
is the one transformers' `Qwen2Converter` builds from those files (NFC, Qwen2 split regex, byte level).
"""

from __future__ import annotations

import json
import re
import unicodedata
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Tokenizer

from mlx_locate.tokens import TokenIds, token_ids_from_config

DEFAULT_MODEL_MAX_LENGTH = 32768
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _added_tokens(folder: Path) -> dict[int, AddedToken]:
    """Added tokens by id, from `added_tokens.json` and `tokenizer_config.json`'s `added_tokens_decoder`."""
    found = {int(i): (token, True) for token, i in _read_json(folder / "added_tokens.json").items()}
    for i, spec in _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {}).items():
        found[int(i)] = (spec["content"], spec.get("special", True))
    # Every added token is matched whole, on the raw (unnormalized) text, before BPE runs.
    return {i: AddedToken(token, special=special, normalized=False) for i, (token, special) in found.items()}


def qwen2_byte_level(tok: _Tokenizer) -> _Tokenizer:
    """Give `tok` Qwen2's normalizer, pre-tokenizer (split regex, then bytes), decoder and post-processor."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def _build_bpe(folder: Path) -> _Tokenizer:
    bpe = models.BPE.from_file(
        str(folder / "vocab.json"),
        str(folder / "merges.txt"),
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = qwen2_byte_level(_Tokenizer(bpe))
    # `add_tokens` numbers new tokens from the vocabulary size on, so the ids must follow it without gaps.
    added = _added_tokens(folder)
    tok.add_tokens([added[i] for i in sorted(added)])
    wrong = [(t.content, i) for i, t in sorted(added.items()) if tok.token_to_id(t.content) != i]
    if wrong:
        raise ValueError(
            f"{folder}: added token ids must continue vocab.json's ids without gaps; "
            f"(token, id) not reproduced: {wrong[:5]}"
        )
    return tok


class Tokenizer:
    """Encode text to ids (no BOS) and decode ids to text, matching the reference's Qwen2 tokenizer."""

    def __init__(self, tokenizer: _Tokenizer, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH):
        self._tok = tokenizer
        self.model_max_length = model_max_length

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` if present, else build from `vocab.json` + `merges.txt` + added tokens.

        `model_max_length` comes from `tokenizer_config.json` (default 32768).
        Raises `FileNotFoundError` naming the folder and the files expected.
        """
        folder = Path(path)
        if (folder / "tokenizer.json").is_file():
            tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            missing = [name for name in ("vocab.json", "merges.txt") if not (folder / name).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"no tokenizer in {folder}: expected tokenizer.json, or vocab.json + merges.txt "
                    f"(with added_tokens.json / tokenizer_config.json); missing {', '.join(missing)}"
                )
            tok = _build_bpe(folder)
        config = _read_json(folder / "tokenizer_config.json")
        return cls(tok, int(config.get("model_max_length", DEFAULT_MODEL_MAX_LENGTH)))

    def warm(self) -> Tokenizer:
        """Build now what the first prompt would build (the added tokens' pattern); returns self."""
        _ = self.added_pattern
        self._tok.encode("warm", add_special_tokens=False)
        return self

    def encode(self, text: str, plain: bool = False) -> list[int]:
        """Ids of `text`; `plain`: no added token is matched (`<|im_end|>` is the BPE of its characters).
        `ValueError` for text that is not valid Unicode (a lone surrogate)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text is not valid Unicode ({e.reason} at position {e.start})") from None
        # Text that holds no added token (raw or normalized, where a token may be matched) splits on none, so the
        # full pipeline gives it the plain one's ids; the plain pipeline is built only for text that needs it.
        if plain and (self.added_tokens_in(text) or self.added_tokens_in(unicodedata.normalize("NFC", text))):
            return self._plain.encode(text, add_special_tokens=False).ids
        return self._tok.encode(text, add_special_tokens=False).ids

    @cached_property
    def _plain(self) -> _Tokenizer:
        """The same pipeline without the added tokens (built from the full one's JSON, which takes a while)."""
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        return _Tokenizer.from_str(json.dumps(spec))

    @cached_property
    def added_pattern(self) -> re.Pattern:
        """Matches the added tokens as the tokenizer does: whole, on the raw text, leftmost and longest first."""
        return re.compile("|".join(re.escape(t) for t in sorted(self.added_tokens, key=len, reverse=True)))

    def added_tokens_in(self, text: str) -> list[str]:
        """The added tokens `text` holds, in order."""
        return self.added_pattern.findall(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The BPE vocabulary, without added tokens (a dict of every token: `vocab_id` looks one up)."""
        return self._tok.get_vocab(with_added_tokens=False)

    def vocab_id(self, token: str) -> int | None:
        """`token`'s id in the BPE vocabulary (added tokens not counted), None where it has none."""
        return self._tok.model.token_to_id(token)

    @cached_property
    def added_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    def token_ids(self, config: dict) -> TokenIds:
        """The special token ids, from `config.json` (a dict) and this tokenizer's tokens."""
        return token_ids_from_config(config, self.added_tokens, self.vocab_id)

    def save_json(self, path: str | Path) -> None:
        """Write a `tokenizer.json` to `path`; `from_folder` on its folder loads the same tokenizer.

        `model_max_length` is not part of it: it stays in `tokenizer_config.json`.
        """
        self._tok.save(str(path))
