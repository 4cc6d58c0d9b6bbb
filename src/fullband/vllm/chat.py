"""`fullband serve`'s middleware on vLLM's server (its `--middleware` option): every JSON request checked before
vLLM reads it, and chat completions that read a conversation as it was generated (the server side of `fullband
chat`'s kept turns).

Checks (fullband.vllm.requests.http_request): what is wrong with a request's text, its vllm_xargs or a chat
request's messages is an HTTP 400 with fullband's sentence, before vLLM's schema and tokenizer see it; a
`fullband_states` key is refused (a server returns no fed states, so none may be kept).

Fed conversations: on POST /v1/chat/completions for a SOFT request to a model with feedback, it renders the messages
with fullband's template for the folder's tokenizer (fullband.fed_chat_prompt: the earlier replies' tokens before
their end markers are the positions SOFT decoding fed), checks that those ids are the prompt ids vLLM renders for
the request, and adds the spans as the request's `fed_spans` (vllm_xargs, flat); the worker then reads those
positions fed (fullband.vllm.model), and the scheduler reuses their cached blocks (fullband.vllm.scheduler). Where
the ids differ (a --chat-template other than the folder's, a tokenizer that renders a reply otherwise) the
conversation is read plainly, and the server says so once. A request that sets `fed_spans` itself keeps it
([] reads the conversation plainly); STANDARD and FUSED requests are left as they are (FUSED reads the whole
conversation with its 1 + k passes, as `fullband chat` does)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from vllm.logger import init_logger

from fullband.data.chat.templates import chat_template, fed_chat_prompt
from fullband.data.tokenizer import load_tokenizer
from fullband.errors import FullbandError
from fullband.vllm.requests import FED, http_request
from fullband.vllm.tracker import SERVED

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handlers print it


class ServedRequests:
    """The middleware (vLLM builds it with the app it wraps)."""

    def __init__(self, app) -> None:
        self.app = app
        self.template: Any = None  # fullband's template for the served folder's tokenizer, built at first use
        self.warned = False

    async def __call__(self, scope, receive, send) -> None:
        kind = dict(scope.get("headers") or []).get(b"content-type", b"") if scope["type"] == "http" else b""
        if scope.get("method") != "POST" or not kind.lower().startswith(b"application/json"):  # vLLM reads no other
            return await self.app(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope.get("path", "")
        try:
            data, changed = http_request(path, body, SERVED.default, has_feedback=SERVED.has_feedback,
                                         max_passes=SERVED.max_passes)
        except FullbandError as err:
            return await _refuse(send, str(err))
        if path.endswith("/chat/completions") and isinstance(data, dict):
            try:
                changed = await self._with_spans(scope, data) or changed
            except Exception as err:  # never fail a request here: vLLM answers it as it is (and reports its errors)
                logger.warning("fullband: chat request read plainly (%s: %s)", type(err).__name__, err)
        new = json.dumps(data).encode() if changed else body
        if changed:
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*kept, (b"content-length", str(len(new)).encode())]}
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # a disconnect, for streaming responses
            sent = True
            return {"type": "http.request", "body": new, "more_body": False}

        await self.app(scope, replay, send)

    async def _with_spans(self, scope, data: dict) -> bool:
        """Add the fed spans of the request's conversation to `data` (checked by http_request); whether it did."""
        xargs = data.get("vllm_xargs")
        if not isinstance(xargs or {}, dict) or FED in (xargs or {}):
            return False
        serving = getattr(scope["app"].state, "openai_serving_chat", None)
        if serving is None or not SERVED.has_feedback or not isinstance(data.get("messages"), list):
            return False
        try:
            if not SERVED.mode_of(SimpleNamespace(extra_args=xargs)).reads_fed_spans:
                return False
            if self.template is None:
                self.template = chat_template(load_tokenizer(serving.model_config.model))
            ids, spans = fed_chat_prompt(None, data["messages"], template=self.template)
        except FullbandError:  # messages fullband's template does not take: vLLM answers as it would
            return False
        if not spans:
            return False
        if ids != await _vllm_prompt(serving, data):
            if not self.warned:
                self.warned = True
                logger.warning("fullband: a chat prompt rendered by vLLM differs from fullband's template for this "
                               "folder (a --chat-template of its own?): such conversations are read plainly, not as "
                               "they were generated (said once)")
            return False
        data["vllm_xargs"] = {**(xargs or {}), FED: [p for span in spans for p in span]}
        return True


async def _refuse(send, message: str) -> None:
    """Answer HTTP 400 with fullband's sentence, in vLLM's error body (an OpenAI client raises BadRequestError)."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _vllm_prompt(serving, data: dict) -> list[int] | None:
    """The prompt ids vLLM's chat serving renders for the request `data` (None where it refuses it)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    result = await serving.render_chat_request(ChatCompletionRequest.model_validate(data))
    if not isinstance(result, tuple) or len(result[1]) != 1:
        return None
    return list(extract_prompt_components(serving.model_config, result[1][0]).token_ids)
