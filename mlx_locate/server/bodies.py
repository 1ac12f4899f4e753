"""A request's body: JSON, or a form (multipart with the image as a file part, or urlencoded), checked against
its schema (`schemas.py`); every failure an `InputError`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request as HttpRequest
from pydantic import BaseModel
from starlette.datastructures import UploadFile

from .protocol import InputError
from .schemas import parse


def is_form(request: HttpRequest) -> bool:
    kind = request.headers.get("content-type", "")
    return kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))


async def json_body(request: HttpRequest) -> dict:
    raw = bytearray()  # read here, not with request.body(), which keeps the raw bytes as long as the request
    async for chunk in request.stream():
        raw += chunk
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError("invalid_json", f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InputError("invalid_json", "the body must be a JSON object")
    return body


async def form_body(request: HttpRequest) -> tuple[dict, bytes | None]:
    """Form fields as a dict (repeated `query`/`categories` fields become lists) and the image file."""
    form = await request.form(max_files=1, max_fields=64)
    fields: dict[str, Any] = {}
    data = None
    for key in set(form.keys()):
        values = form.getlist(key)
        if key == "image" and isinstance(values[0], UploadFile):
            data = await values[0].read()
        elif any(isinstance(v, UploadFile) for v in values):
            raise InputError("invalid_request", f"field {key!r}: only 'image' may be a file")
        elif key == "categories" or (key == "query" and len(values) > 1):
            fields[key] = values
        else:
            fields[key] = values[0]
    return fields, data


async def read_body(request: HttpRequest, model: type[BaseModel]) -> tuple[Any, bytes | None]:
    """The body as `model` and the image file of a form: a JSON body, or a form (multipart with the image as a
    file part, or urlencoded) whose text fields are read as the model's booleans and numbers."""
    if is_form(request):
        fields, data = await form_body(request)
        return parse(model, fields, form=True), data
    return parse(model, await json_body(request)), None
