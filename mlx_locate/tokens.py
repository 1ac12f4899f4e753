"""Every special token id, read once from a checkpoint's config and tokenizer files.

No token id literal appears anywhere else in the package: tests remap ids into tiny vocabularies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenIds:
    image: int  # <IMG_CONTEXT>
    img_start: int  # <img>
    img_end: int  # </img>
    box_start: int  # <box>
    box_end: int  # </box>
    ref_start: int  # <ref>
    ref_end: int  # </ref>
    coord_start: int  # <0>
    coord_end: int  # <1000>
    none: int  # plain BPE token "None": the empty answer <box>None</box>
    none_lower: int  # "none": parsed like "None"
    im_start: int  # <|im_start|>
    im_end: int  # <|im_end|>, the end of an answer
    text_mask: int  # <text_mask>, the 5 masked slots of a block
    null: int  # <null>, fills unused block slots
    switch: int  # <switch>, unused at inference
    cat_sep: int  # </c>, joins detection categories
    vocab_size: int

    def is_coord(self, token: int) -> bool:
        return self.coord_start <= token <= self.coord_end

    def coord_value(self, token: int) -> int:
        return token - self.coord_start

    def coord_token(self, value: int) -> int:
        return self.coord_start + value


def token_ids_from_config(
    config: dict, added_tokens: dict[str, int], vocab_id: Callable[[str], int | None]
) -> TokenIds:
    """Build `TokenIds` from `config.json` (a dict) and the tokenizer's added tokens and vocabulary (`vocab_id`: a
    token's id there, None where it has none).

    Raises `ValueError` naming the missing field or token.
    """
    text = config.get("text_config", {})

    def field(source: dict, name: str, where: str) -> int:
        if name not in source:
            raise ValueError(f"config.json: missing field {where}{name}")
        value = source[name]
        # mlx-vlm's converter copies generation_config.json's eos list ([<|im_end|>, <|endoftext|>]) here.
        return int(value[0] if isinstance(value, list) and value else value)

    def token(name: str, lookup: Callable[[str], int | None], what: str) -> int:
        if (found := lookup(name)) is None:
            raise ValueError(f"tokenizer: {what} has no token {name!r}")
        return int(found)

    ids = TokenIds(
        image=field(config, "image_token_index", ""),
        img_start=token("<img>", added_tokens.get, "added tokens"),
        img_end=token("</img>", added_tokens.get, "added tokens"),
        box_start=field(config, "box_start_token_id", ""),
        box_end=field(config, "box_end_token_id", ""),
        ref_start=field(config, "ref_start_token_id", ""),
        ref_end=field(config, "ref_end_token_id", ""),
        coord_start=field(config, "coord_start_token_id", ""),
        coord_end=field(config, "coord_end_token_id", ""),
        none=field(config, "none_token_id", ""),
        none_lower=token("none", vocab_id, "vocab.json"),
        im_start=token("<|im_start|>", added_tokens.get, "added tokens"),
        im_end=field(config, "eos_token_id", ""),
        text_mask=field(text, "text_mask_token_id", "text_config."),
        null=field(text, "null_token_id", "text_config."),
        switch=field(text, "switch_token_id", "text_config."),
        cat_sep=token("</c>", added_tokens.get, "added tokens"),
        vocab_size=field(text, "vocab_size", "text_config."),
    )
    if ids.coord_end - ids.coord_start != 1000:
        raise ValueError(
            f"config.json: coordinate tokens must span <0>..<1000> (1001 ids); got {ids.coord_start}..{ids.coord_end}"
        )
    return ids
