"""The OpenAI adapter: `/v1/chat/completions`' message read as a task, a query and an image; the answer as a
`chat.completion` or as `chat.completion.chunk`s (text as it is decoded), optionally the parsed answer as JSON
content (`response_format`).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from ..engine import EventKind
from ..prompts import GRAMMAR_TOKENS, TASK_TEMPLATES
from ..request import Result
from .errors import error_body
from .protocol import ANSWER_FIELDS, InputError, answer_json, result_json
from .schemas import MAX_TEXT
from .streaming import start_stream
from .worker import Job

ANSWER_END = "<|im_end|>"  # how `Result.text` ends when the model closed its answer


# A text that starts like one of the task prompts, or holds a grammar token or an image placeholder, is the
# model's own prompt (task "raw"); any other text is the phrase to detect.
_PROMPT_STARTS = tuple(t.partition("{}")[0] for t in TASK_TEMPLATES.values())
_GRAMMAR = re.compile("|".join([*map(re.escape, GRAMMAR_TOKENS), r"<image-\d+>", r"<\d{1,4}>"]))


def chat_task(text: str, task: str | None) -> tuple[str, str | None]:
    """The (task, query) of a chat message: `task` when the client names one (extra_body), `raw` when the
    text already is a prompt in the model's grammar, else `detect` with the text as the phrase."""
    if task is not None:
        return task, text or None
    if text.startswith(_PROMPT_STARTS) or _GRAMMAR.search(text):
        return "raw", text
    phrase = text.strip().rstrip(".!?").strip()
    if not phrase:
        raise InputError("invalid_request", "the user message has no text: say what to find (e.g. 'red car')")
    return "detect", phrase


def answer_format(response_format: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The answer fields a `response_format` asks for as JSON content; None for the model's text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return ANSWER_FIELDS
    if kind != "json_schema":
        raise InputError("invalid_request", f"response_format type {kind!r}: use text, json_object or json_schema")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if properties is None:
        return ANSWER_FIELDS
    unknown = sorted(set(properties) - set(ANSWER_FIELDS)) if isinstance(properties, dict) else [repr(properties)]
    if unknown:
        raise InputError(
            "invalid_request",
            f"response_format: the answer has the fields {', '.join(ANSWER_FIELDS)} (objects with label, box, "
            f"point in pixels and confidence); the schema asks for {', '.join(map(str, unknown))}",
        )
    return tuple(properties)


def chat_input(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """The text and the one image of the last user message (content parts `text` and `image_url`)."""
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise InputError("invalid_request", "messages has no user message")
    content = users[-1].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise InputError("invalid_request", "a message's content must be a string or a list of parts")
    texts, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                got = "it is missing" if url is None else f"got {json.dumps(url)[:60]}"
                raise InputError("invalid_request", f"image_url.url must be a string (a data URL); {got}")
            images.append(url)
        else:
            raise InputError("invalid_request", f"unsupported content part {kind!r}; use 'text' and 'image_url'")
    if len(images) != 1:
        raise InputError("invalid_request", f"the user message needs exactly one image_url, got {len(images)}")
    text = "\n".join(texts).strip()
    if len(text) > MAX_TEXT:
        raise InputError("invalid_request", f"the text has {len(text)} characters; at most {MAX_TEXT}")
    return text, images[0]


def finish_reason(result: Result) -> str:
    return "length" if result.stats.get("stop_reason") == "length_cap" else "stop"


def usage_of(result: Result) -> dict:
    prompt, answer = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}


def content_of(result: Result, fields: tuple[str, ...] | None) -> str:
    """The message content: the model's answer text, or with `response_format` the parsed answer as JSON."""
    if fields is None:
        return result.text.removesuffix(ANSWER_END)
    answer = answer_json(result)
    return json.dumps({k: answer[k] for k in fields})


def chat_completion(completion_id: str, created: int, model: str, result: Result, fields=None) -> dict:
    """An OpenAI `chat.completion`: the answer as content (`content_of`); the parsed answer (`objects`,
    `empty_labels`, `truncated`, `image`, `orientation`, `warnings`, `stats`) also as extra top-level fields."""
    width, height = result.image_size
    parsed = result_json(result)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content_of(result, fields)},
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage_of(result),
        "image": {"width": width, "height": height},
        **{k: parsed[k] for k in ("objects", "empty_labels", "truncated", "orientation", "warnings", "stats")},
    }


async def chat_stream(request, worker, job_requests, settings, ids, include_usage, fields, observe, holding):
    """`chat.completion.chunk`s: the role first; the answer's text as it is decoded, item by item (TEXT
    events), each committed box or point also in an extra `objects` field; then the rest of the text, the
    finish reason, `[DONE]`. With `response_format`, the JSON answer comes in one chunk at the end."""
    completion_id, created, model = ids

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return f"data: {json.dumps({**body, 'choices': [choice], **extra})}\n\n"

    async def frames(job: Job) -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        sent, results = "", []
        try:
            async for _, event in job:
                if event.kind is EventKind.TEXT:
                    piece = event.text.removesuffix(ANSWER_END)
                    sent += piece
                    if piece:
                        yield chunk({"content": piece})
                elif event.kind is EventKind.OBJECT:
                    yield chunk({"content": ""}, objects=[event.object.to_dict()])
                elif event.kind is EventKind.ERROR:
                    yield f"data: {json.dumps(error_body('invalid_request', str(event.error)))}\n\n"
                    return
                elif event.kind is EventKind.DONE:
                    result = event.result
                    results.append(result)
                    content = content_of(result, fields)
                    if content.startswith(sent) and len(content) > len(sent):
                        yield chunk({"content": content[len(sent) :]})
                    yield chunk({}, finish_reason(result), empty_labels=result.empty_labels)
                    if include_usage:
                        body = {"id": completion_id, "object": "chat.completion.chunk", "created": created}
                        usage = {"model": model, "choices": [], "usage": usage_of(result)}
                        yield f"data: {json.dumps({**body, **usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            observe(request, job, results)

    def error(code: str, message: str) -> str:
        return f"data: {json.dumps(error_body(code, message))}\n\n"

    return await start_stream(worker, job_requests, settings, frames, error, holding, text=fields is None)
