"""The options clients send, each declared once for the HTTP routes (`/v1/locate`, `/v1/ground`), the OpenAI chat
adapter and the MCP tools: its type and range here, its default `Request`'s, its names from the enum or tuple of
the module that owns them (`decide.Mode`, `prompts.TASKS`, `preprocess.ORIENTATIONS`). The bodies and the MCP tools'
arguments are pydantic models built from these types, checked by `parse` (strict JSON types, errors in words).

No web framework here: the MCP tool imports it too.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..admission import MAX_SEED
from ..decide import MODE_NAMES
from ..preprocess import ORIENTATIONS
from ..prompts import TASKS
from ..request import DEFAULT_MAX_TOKENS, DEFAULT_MODE, DEFAULT_TASK, MIN_IMAGE_TOKENS, Request
from ..sampling import MAX_TEMPERATURE, REPETITION_PENALTY_RANGE, Sampling
from ..tiles import parse_tiles
from .protocol import InputError, Settings

MAX_TEXT = 4096  # characters of one query, instruction or chat text
MAX_TOKENS = 65536  # a request's max_tokens (the engine clips it to the model's positions)
GROUND_MAX_TOKENS = 64  # `ground`'s answers are one point or one box
SAMPLING = Request.sampling  # a request's default (greedy)
PENALTY_LOW, PENALTY_HIGH = REPETITION_PENALTY_RANGE


FORM_TEXT = {bool: r"true|false", int: r"-?[0-9]+", float: r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"}


def form_text(kind: type) -> BeforeValidator:
    """Reads a form field's text (validated with `context={"form": True}`) as `kind` when it is spelled as
    `FORM_TEXT` says; JSON bodies, validated strictly, must send the type itself."""
    pattern = re.compile(FORM_TEXT[kind])

    def read(value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and (info.context or {}).get("form") and pattern.fullmatch(value):
            return value == "true" if kind is bool else kind(value)
        return value  # refused by the type, unless it is one

    return BeforeValidator(read)


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


def whole(**bounds) -> Any:
    """An integer within `bounds` (pydantic's `ge`, `le`), a boolean refused. The bounds come before the
    validator, so pydantic checks them on the parsed integer (exactly; `minimum`/`maximum` in the schema)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_no_bool), form_text(int)]


def real(**bounds) -> Any:
    """A finite number within `bounds` (pydantic's `ge`, `gt`, `le`; they also refuse inf and nan), a boolean
    refused."""
    return Annotated[float, Field(**bounds), BeforeValidator(_no_bool), Field(allow_inf_nan=False), form_text(float)]


def described(kind: Any, what: str) -> Any:
    """`kind`, its refusal one error in words (not one per member of a union): the field expects `what`."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", f"expected {what}") from None

    return Annotated[kind, WrapValidator(check)]


def _grid(value: Any) -> Any:
    """Tiles as the command line spells them ("2x3", `tiles.parse_tiles`), or [rows, cols] as a tuple."""
    if isinstance(value, str):
        try:
            return parse_tiles(value)
        except ValueError:
            return value  # refused by the type
    return tuple(value) if isinstance(value, list) else value


# Tokenizing runs on the worker thread, between everyone's steps: a query's length is bounded here.
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Int = whole()
Flag = Annotated[bool, form_text(bool)]

# One type per decoding option.
ModeName = Literal[MODE_NAMES]
TaskName = Literal[TASKS]
MaxTokens = whole(ge=1, le=MAX_TOKENS)
Temperature = real(ge=0, le=MAX_TEMPERATURE)
TopP = real(gt=0, le=1)
TopK = whole(ge=0)  # and at most the vocabulary: checked with the model (`check_request`)
RepetitionPenalty = real(ge=PENALTY_LOW, le=PENALTY_HIGH)
Seed = whole(ge=0, le=MAX_SEED)
Orientation = Literal[ORIENTATIONS]  # "stored": boxes in the stored pixels, EXIF orientation ignored
ImageTokens = whole(ge=MIN_IMAGE_TOKENS)  # a patch budget below the model's (at most the model's)
Tiles = described(
    Annotated[Literal["auto"] | tuple[Int, Int], BeforeValidator(_grid)],
    "'auto', ROWSxCOLS such as '2x3', or [rows, cols]",
)
Query = described(Text | list[Text], f"a string of at most {MAX_TEXT} characters, or a list of them")
OneQuery = described(Text, f"a string of at most {MAX_TEXT} characters")  # an MCP tool's: one answer a call
# Several categories of one detect request: one row each, one result.
Categories = Annotated[list[Text], Field(min_length=1)]
Instruction = Annotated[Text, Field(min_length=1)]


class Decoding(BaseModel):
    """Decoding fields every endpoint takes (see `mlx_locate.Request`); every number bounded."""

    model_config = ConfigDict(extra="forbid")
    mode: ModeName = DEFAULT_MODE
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    strict: Flag = Request.strict
    temperature: Temperature = SAMPLING.temperature
    top_p: TopP = SAMPLING.top_p
    top_k: TopK = SAMPLING.top_k
    repetition_penalty: RepetitionPenalty = SAMPLING.repetition_penalty
    seed: Seed = Request.seed
    orientation: Orientation = Request.orientation
    max_image_tokens: ImageTokens | None = Request.max_image_tokens

    @model_validator(mode="after")
    def _sampling_is_valid(self) -> Decoding:
        self.sampling()
        return self

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.repetition_penalty)

    def options(self, settings: Settings) -> dict:
        """The `Request` fields these set, with the server's pixel limit."""
        return {
            "mode": self.mode,
            "max_tokens": self.max_tokens,
            "strict": self.strict,
            "sampling": self.sampling(),
            "seed": self.seed,
            "max_pixels": settings.max_pixels,
            "orientation": self.orientation,
            "max_image_tokens": self.max_image_tokens,
        }


class Asking(Decoding):
    """What `/v1/locate` and the MCP tool `locate` ask about an image: a query or categories, a task, tiles."""

    query: Query | None = None  # a list: separate questions, answered under "queries"
    categories: Categories | None = None
    joint: Flag = Request.joint  # categories in ONE prompt joined by </c> (the reference's; also with strict)
    task: TaskName = DEFAULT_TASK
    tiles: Tiles | None = Request.tiles

    def queries(self) -> list:
        """The questions: `[categories]` (one detect request), else the query or each query of a list."""
        if self.categories is not None:
            if self.query is not None or self.task != "detect":
                raise InputError(
                    "invalid_request", "categories make one detect request; do not combine with query/task"
                )
            return [self.categories]
        queries = self.query if isinstance(self.query, list) else [self.query]
        if not queries:
            raise InputError("invalid_request", "query is an empty list")
        return queries

    def options(self, settings: Settings) -> dict:
        """`Decoding.options` with the categories' `joint` and the `tiles`."""
        return {**super().options(settings), "joint": self.joint, "tiles": self.tiles}


class Grounding(Decoding):
    """What `/v1/ground` and the MCP tool `ground` ask: where an instruction's element is."""

    instruction: Instruction
    max_tokens: MaxTokens = GROUND_MAX_TOKENS


class LocateBody(Asking):
    image: str | None = None  # data URL or base64 (or a file part in multipart)
    stream: Flag = False


class GroundBody(Grounding):
    image: str | None = None  # data URL or base64 (or a file part in multipart)


class LocalImage(BaseModel):
    """An MCP tool's image: a local file or base64 (a data URL too); exactly one."""

    model_config = ConfigDict(extra="forbid")
    image_path: str | None = None
    image_base64: str | None = None


class LocateTool(LocalImage, Asking):
    """The MCP tool `locate`'s arguments: `/v1/locate`'s, one query a call."""

    query: OneQuery | None = None


class GroundTool(LocalImage, Grounding):
    """The MCP tool `ground`'s arguments: `/v1/ground`'s."""


class ChatBody(BaseModel):
    """The OpenAI fields we use; others an OpenAI client may send are ignored. `mode`, `task`, `top_k` and
    `repetition_penalty` ride in extra_body."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature = SAMPLING.temperature
    top_p: TopP = SAMPLING.top_p
    top_k: TopK = SAMPLING.top_k
    repetition_penalty: RepetitionPenalty = SAMPLING.repetition_penalty
    seed: Seed | None = None
    n: Int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    mode: ModeName = DEFAULT_MODE
    task: TaskName | None = None

    def decoding(self) -> dict:
        """The `Decoding` fields of this body."""
        fields = ("mode", "temperature", "top_p", "top_k", "repetition_penalty")
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        seed = Request.seed if self.seed is None else self.seed
        return {"max_tokens": max_tokens, "seed": seed, **{f: getattr(self, f) for f in fields}}


TYPE_WORDS = {"bool_type": "true or false", "int_type": "an integer", "float_type": "a number"}


def validation_message(e: ValidationError) -> str:
    """Each error as `field: what is wrong`; a value of the wrong type says the type the field takes. (FastAPI's
    `RequestValidationError` has the same `errors()`.)"""

    def words(err: dict) -> str:
        kind = TYPE_WORDS.get(err["type"])
        return f"expected {kind}, got {repr(err['input'])[:60]}" if kind else err["msg"]

    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {words(err)}" for err in e.errors())


def parse(model: type[BaseModel], fields: dict, form: bool = False) -> Any:
    """`fields` checked against `model`, their types strictly (`true`, not `"yes"`; `10`, not `"10"`), but a
    form's text read as `FORM_TEXT` spells booleans and numbers; an `InputError` in words (`validation_message`)."""
    try:
        return model.model_validate(fields, strict=True, context={"form": form})
    except ValidationError as e:
        raise InputError("invalid_request", validation_message(e)) from None
