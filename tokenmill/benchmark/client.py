"""An async streaming client for OpenAI-compatible servers (tokenmill, llama.cpp's llama-server, vLLM).

Two backends: ``completions`` (POST /v1/completions, text in ``choices[0].text``) and ``chat``
(POST /v1/chat/completions, text in ``choices[0].delta.content``). Every request streams with
``stream_options.include_usage`` so the server's token counts come back in a final chunk.

Server-sent events are read line by line: ``data: {json}`` lines, ``data: [DONE]`` ends the
stream. A chunk with choices is timestamped as it arrives; only chunks that carry text become
content chunks (TTFT, ITL). A usage-only chunk (empty choices) sets the usage and no time.
Failures are recorded, not raised: a non-200 status becomes ``status="429"`` etc. with the body
as the error, an error event inside the stream ``stream_error``, a transport problem its
exception class name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from tokenmill.benchmark.metrics import RequestRecord
from tokenmill.errors import InvalidParameterError

BACKENDS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""
    model: str
    """The served model name sent as ``model``."""
    backend: str = "completions"
    ignore_eos: bool = True
    """Send ``ignore_eos`` (vLLM, llama.cpp) so every reply has exactly max_tokens tokens."""
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    """Merged into every request body."""
    timeout_s: float = 6 * 3600
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise InvalidParameterError(f"unknown backend {self.backend!r}; use {' or '.join(BACKENDS)}")

    @property
    def root(self) -> str:
        root = self.base_url.rstrip("/")
        return root.removesuffix("/v1")

    @property
    def url(self) -> str:
        return self.root + BACKENDS[self.backend]


class OpenAIClient:
    """``async with OpenAIClient(config) as client: record = await client.send(messages, max_tokens, prompt_len)``."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.timeout_s), headers=headers,
            # a fresh connection per request, as vLLM's benchmark does: reusing a kept-alive one races
            # the server closing it (llama-server after 5 s idle), and the request fails unsent
            connector=aiohttp.TCPConnector(limit=0, force_close=True), read_bufsize=1 << 20)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    def body(self, messages: list[dict], max_tokens: int) -> dict:
        """The request body: chat sends the messages; completions sends them joined as one prompt."""
        cfg = self.config
        body = {"model": cfg.model, "max_tokens": max_tokens, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if cfg.backend == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = completion_prompt(messages)
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **cfg.extra_body}

    async def send(self, messages: list[dict], max_tokens: int, prompt_len: int) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter(), prompt_len=prompt_len)
        try:
            async with self.session.post(self.config.url, json=self.body(messages, max_tokens)) as resp:
                if resp.status != 200:
                    record.status, record.error = str(resp.status), (await resp.text())[:500]
                    return record
                async for line in resp.content:
                    if self._on_line(record, line):
                        break
        except Exception as exc:  # noqa: BLE001 (any transport error is a failed request, not a crash)
            record.status, record.error = type(exc).__name__, str(exc)[:500]
            return record
        if record.success and record.end is None:
            record.status, record.error = "empty_stream", "the stream carried no choices"
        return record

    def _on_line(self, record: RequestRecord, line: bytes) -> bool:
        """Apply one SSE line; True when the stream is over."""
        event = parse_sse_line(line)
        if event is None:
            return False
        if event == DONE:
            return True
        now = time.perf_counter()
        if "error" in event:
            record.status, record.error = "stream_error", json.dumps(event["error"])[:500]
            return True
        if event.get("usage"):
            record.usage = event["usage"]
        choices = event.get("choices")
        if choices:
            text = chunk_text(choices[0])
            if text:
                record.chunk_times.append(now)
                record.text += text
            record.end = now
        return False

    async def metrics_text(self) -> str:
        """The server's Prometheus exposition (GET /metrics), sent with ``Authorization: Bearer
        --api-key`` like every request of the session: tokenmill's /metrics needs an admin or
        metrics key when the server has keys."""
        async with self.session.get(self.config.root + "/metrics") as resp:
            resp.raise_for_status()
            return await resp.text()

    async def served_models(self) -> list[str]:
        async with self.session.get(self.config.root + "/v1/models") as resp:
            resp.raise_for_status()
            return [m["id"] for m in (await resp.json()).get("data", [])]


DONE = "[DONE]"


def parse_sse_line(line: bytes | str) -> dict | str | None:
    """A ``data:`` line's JSON object, DONE, or None for blank lines, comments and other fields."""
    text = (line.decode("utf-8") if isinstance(line, bytes) else line).strip()
    if not text.startswith("data:"):
        return None
    payload = text[5:].strip()
    if payload == DONE:
        return DONE
    if not payload:
        return None
    return json.loads(payload)


def chunk_text(choice: dict) -> str:
    """The generated text of one streamed choice, completions or chat (reasoning counts as output)."""
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "")


def completion_prompt(messages: list[dict]) -> str:
    """Messages as one completions prompt: the contents in order, separated by blank lines."""
    return "\n\n".join(m["content"] for m in messages)
