"""Streaming /generate (SGLang's ``"stream": true``): server-sent events, one per new chunk of
tokens, ending with ``data: [DONE]``.

SGLang's default format (its ``incremental_streaming_output`` off): each event carries the
output so far, not a delta: ``text`` and ``output_ids`` are cumulative, and ``meta_info``
has ``id``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason`` (null until the last
event), ``weight_version`` (the newest token's) and ``weight_versions`` (the version spans
of every token so far, as in a whole output), plus ``output_token_logprobs`` (cumulative)
when asked for. The last event is the non-streaming output itself. A batch streams every
prompt's events, each with SGLang's ``index``. A failure of the engine loop mid-stream is
one ``data: {"error": {...}}`` event (the server's error shape), then ``[DONE]``.

Text: the byte tokenizer decodes an unfinished UTF-8 sequence at the end as U+FFFD, which
the next byte may turn into another character. Like SGLang's detokenizer, an event's text
leaves out a trailing U+FFFD until it is settled, so each event's text is a prefix of the
next one's and of the final text: a client may append the differences.

The engine thread hands events over through ``sink`` (``loop.call_soon_threadsafe``); all
the work here (decoding, JSON) runs on the event loop. The tokenizer is read there: it is a
stateless byte table, never changed after start-up.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    """One server-sent event holding ``obj`` as JSON (NaN and infinities already spelled out)."""
    return b"data: " + json.dumps(obj, allow_nan=False, separators=(",", ":")).encode() + b"\n\n"


def settled_prefix(text: str) -> str:
    """``text`` without its trailing U+FFFD characters (an unfinished sequence may still
    become another character; any character before them is complete and stays)."""
    return text.rstrip("\ufffd")


def restarts_decoding(token_id: int) -> bool:
    """A byte that is not a UTF-8 continuation byte (10xxxxxx): decoding the bytes before
    it and from it separately gives the same text as decoding them together. Ids that
    are not bytes decode to nothing, so the bytes on either side of one still join."""
    return 0 <= token_id < 0x80 or 0xC0 <= token_id < 0x100


class RequestStream:
    """One streamed request's output so far, grown by the engine thread's token events."""

    def __init__(self, index: int, decode: Callable[[list[int]], str], return_logprob: bool):
        self.index, self.decode, self.return_logprob = index, decode, return_logprob
        self.rid, self.prompt_tokens = None, None
        self.ids: list[int] = []
        self.spans: list[dict] = []
        self.logprobs: list = []
        self.settled_text, self.settled_ids = "", 0  # text of ids[:settled_ids], fixed for good
        self.finished = False

    def add(self, new: dict) -> None:
        self.rid, self.prompt_tokens = new["rid"], new["prompt_tokens"]
        start = len(self.ids)
        self.ids.extend(new["ids"])
        for i, v in enumerate(new["versions"], start):
            if self.spans and self.spans[-1]["version"] == v:
                self.spans[-1]["end"] = i + 1
            else:
                self.spans.append({"version": v, "start": i, "end": i + 1})
        if self.return_logprob:
            self.logprobs.extend([lp, tok, None] for lp, tok in zip(new["logprobs"], new["ids"]))
        # Everything before the last byte where decoding restarts is settled, so each event
        # decodes only a short tail.
        for j in range(len(self.ids) - 1, self.settled_ids, -1):
            if restarts_decoding(self.ids[j]):
                self.settled_text += self.decode(self.ids[self.settled_ids:j])
                self.settled_ids = j
                break

    def text(self) -> str:
        return self.settled_text + settled_prefix(self.decode(self.ids[self.settled_ids:]))

    def event(self, batched: bool) -> dict:
        meta = {"id": self.rid, "prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.ids),
                "finish_reason": None, "weight_version": self.spans[-1]["version"] if self.spans else None,
                "weight_versions": self.spans}
        if self.return_logprob:
            meta["output_token_logprobs"] = self.logprobs
        out = {"text": self.text(), "output_ids": self.ids, "meta_info": meta}
        return {**out, "index": self.index} if batched else out


async def events(queue: asyncio.Queue, streams: list[RequestStream], batched: bool, finite: Callable):
    """The response body: an event per request per chunk of new tokens (events that piled
    up while the client read slowly are merged into one), the final outputs, then [DONE]."""
    open_ = len(streams)
    while open_:
        batch = [await queue.get()]
        while not queue.empty():
            batch.append(queue.get_nowait())
        dirty: dict[int, RequestStream] = {}
        for kind, index, payload in batch:
            stream = streams[index]
            if kind == "tokens" and not stream.finished:
                stream.add(payload)
                dirty[index] = stream
            elif kind == "final":
                dirty.pop(index, None)  # the whole output supersedes its last chunk
                stream.finished, open_ = True, open_ - 1
                out = {k: v for k, v in payload.items() if k != "rid"}  # meta_info.id has it
                yield sse(finite({**out, "index": index} if batched else out))
            elif kind == "error":
                yield sse({**payload.body(), **({"index": index} if batched else {})})
                yield DONE
                return
        for stream in dirty.values():
            event = stream.event(batched)
            if stream.return_logprob:  # the only floats that may be infinite
                event["meta_info"]["output_token_logprobs"] = finite(stream.logprobs)
            yield sse(event)
    yield DONE


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that calls ``on_close()`` however the response ends: the
    client read it all, disconnected (Starlette cancels the body), or sending failed."""

    def __init__(self, body, on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
