"""The options clients send are declared once (`server/schemas.py`): the REST bodies, the OpenAI body and the MCP
tools take each shared option with the same type, range and refusal, their defaults are `Request`'s, and the
mode names come from `decide.Mode` alone. No model is loaded."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from mcp import Client
from PIL import Image
from pydantic import ValidationError

import mlx_locate.server
from mlx_locate import Request
from mlx_locate.decide import Mode
from mlx_locate.request import MIN_IMAGE_TOKENS, RequestError, check_image_options
from mlx_locate.server.mcp import build_server
from mlx_locate.server.protocol import Settings
from mlx_locate.server.schemas import ChatBody, Decoding, GroundBody, LocateBody, validation_message
from mlx_locate.server.worker import Worker

DECODING = ("GroundBody", "mcp.locate", "mcp.ground")  # besides LocateBody: where every decoding option is taken
SHARED = {  # option: where it is taken besides LocateBody
    "mode": (*DECODING, "ChatBody"),
    "task": ("ChatBody", "mcp.locate"),
    "max_tokens": (*DECODING, "ChatBody"),
    "temperature": (*DECODING, "ChatBody"),
    "top_p": (*DECODING, "ChatBody"),
    "top_k": (*DECODING, "ChatBody"),
    "repetition_penalty": (*DECODING, "ChatBody"),
    "seed": (*DECODING, "ChatBody"),
    "orientation": DECODING,
    "max_image_tokens": DECODING,
    "strict": DECODING,
    "categories": ("mcp.locate",),
    "joint": ("mcp.locate",),
    "tiles": ("mcp.locate",),
}


async def listed_tools() -> list:
    async with Client(build_server(Worker(lambda: None), Settings())) as client:
        return (await client.list_tools()).tools


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict]:
    """The properties of every body's and every MCP tool's JSON schema, by name."""
    out = {m.__name__: m.model_json_schema()["properties"] for m in (LocateBody, GroundBody, ChatBody)}
    return {**out, **{f"mcp.{t.name}": t.input_schema["properties"] for t in asyncio.run(listed_tools())}}


def value_schema(prop: dict) -> dict:
    """A property's schema without its title, default and null branch: what a value must be."""
    prop = {k: v for k, v in prop.items() if k not in ("title", "default")}
    branches = [b for b in prop.pop("anyOf", [prop]) if b != {"type": "null"}]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


@pytest.mark.parametrize("option", sorted(SHARED))
def test_each_shared_option_has_one_type_and_range_everywhere(schemas, option):
    expected = value_schema(schemas["LocateBody"][option])
    for where in SHARED[option]:
        assert value_schema(schemas[where][option]) == expected, (option, where)


def test_the_mode_names_are_decide_modes_everywhere(schemas):
    names = [m.value for m in Mode]
    for where in ("LocateBody", *SHARED["mode"]):
        assert value_schema(schemas[where]["mode"])["enum"] == names, where


def test_defaults_are_the_requests(schemas):
    request = Request(Image.new("RGB", (8, 8)), "x")
    options = Decoding().options(Settings(max_pixels=None))
    assert options == {k: getattr(request, k) for k in options}
    body = LocateBody()
    assert (body.task, body.joint, body.tiles) == (request.task, request.joint, request.tiles)
    chat = ChatBody(messages=[{}]).decoding()
    assert Decoding(**chat).options(Settings(max_pixels=None)) == options
    for name in ("task", "mode", "max_tokens"):
        assert schemas["mcp.locate"][name]["default"] == getattr(request, name), name
    assert schemas["mcp.ground"]["mode"]["default"] == request.mode
    assert schemas["mcp.ground"]["mode"]["default"] == GroundBody.model_fields["mode"].default


@pytest.mark.parametrize("field, value", [("seed", 2**64), ("max_tokens", 0), ("temperature", float("nan"))])
def test_a_bad_value_gets_the_same_message_from_every_body(field, value):
    messages = set()
    for model, rest in ((LocateBody, {}), (GroundBody, {"instruction": "x"}), (ChatBody, {"messages": [{}]})):
        with pytest.raises(ValidationError) as caught:
            model.model_validate({field: value, **rest})
        messages.add(validation_message(caught.value))
    assert len(messages) == 1, messages


@pytest.mark.parametrize("tokens", [MIN_IMAGE_TOKENS - 1, MIN_IMAGE_TOKENS])
def test_the_smallest_patch_budget_is_the_requests(tokens):
    try:
        check_image_options("exif", tokens, 256)
        allowed = True
    except RequestError:
        allowed = False
    try:
        LocateBody(max_image_tokens=tokens)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == allowed == (tokens >= MIN_IMAGE_TOKENS)


def test_the_server_spells_no_mode_name():
    """A mode name as a string in the server (a Literal, a default, a loop) is a copy of `decide.Mode`."""
    names = {m.value for m in Mode}
    spelled = [
        f"{path.name}:{node.lineno} {node.value!r}"
        for path in sorted(Path(mlx_locate.server.__file__).parent.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not spelled
