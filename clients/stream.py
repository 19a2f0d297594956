"""An HTTP client for the denoising stream of any OpenAI-compatible server, and the canvas it fills.

:class:`Client` posts a streamed chat completion with ``stream_options.include_denoising`` and yields typed events
(:class:`Delta`, :class:`Step`, :class:`Usage`, :class:`Finish`). A server that rejects the unknown option with a
400 (OpenAI itself does) is asked once more without it (:class:`Notice` says so), so a plain OpenAI-compatible
server works too. Failures are :class:`ClientError` with one line for the user: unreachable server, wrong key,
server error.

:class:`Canvas` turns the ``denoising`` objects (docs/design.md#decisions) into the state that both views draw:
each position's text or ``None`` (still masked), the step and block that revealed it, and the counters.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


class ClientError(Exception):
    """A failure the user can act on; ``str()`` is one line."""


@dataclass
class Delta:
    text: str


@dataclass
class Step:
    denoising: dict


@dataclass
class Usage:
    usage: dict


@dataclass
class Finish:
    reason: str | None


@dataclass
class Notice:
    message: str


_C1_START, _C1_END = 0x80, 0x9F
# C0 controls (0x00-0x1F) and DEL as their Unicode Control Pictures (U+2400-U+241F, U+2421); newline and tab stay.
_CONTROL_PICTURES = {c: chr(0x2400 + c) for c in range(0x20) if chr(c) not in "\n\t"}
_CONTROL_PICTURES[0x7F] = "\u2421"
_CONTROL_PICTURES.update({c: f"\\x{c:02x}" for c in range(_C1_START, _C1_END + 1)})


def printable(text: str) -> str:
    """``text`` safe to write to a terminal: every C0 control character but newline and tab, DEL and every C1
    control (U+0080-U+009F, which include the 8-bit CSI) shown as a visible stand-in (``\\x1b`` -> ``\u241b``,
    ``\\x9b`` -> the four characters ``\\x9b``), so model text cannot move the cursor, recolour, retitle or clear
    the user's terminal (ECMA-48 escape and control sequences). The conversation keeps the exact text."""
    return text.translate(_CONTROL_PICTURES)


def resolve_api_key(explicit: str | None = None, env=os.environ) -> str | None:
    """``--api-key``, else ``$UNMASK_API_KEY``, else ``$OPENAI_API_KEY``, else None."""
    return explicit or env.get("UNMASK_API_KEY") or env.get("OPENAI_API_KEY") or None


def _error_message(resp: httpx.Response) -> str:
    try:
        body = json.loads(resp.read() if not resp.is_closed else resp.content)
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    except Exception:
        text = (resp.text if resp.is_closed else "").strip()
        return text[:200] or resp.reason_phrase


def _rejects_denoising(status: int, message: str) -> bool:
    m = message.lower()
    return status in (400, 422) and ("include_denoising" in m or "stream_options" in m)


class Client:
    """Chat completions over SSE with the denoising stream.

    Args:
        base_url: the server's ``/v1`` URL (``http://host:port/v1``; a URL without ``/v1`` gets it appended).
        api_key: sent as ``Authorization: Bearer``; None = no header.
        timeout: seconds to connect / between reads.
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: str | None = None, timeout: float = 60.0,
                 transport: httpx.BaseTransport | None = None):
        base = base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.base_url = base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(timeout, connect=5.0),
                                 transport=transport)
        self.denoising = True   # False once the server rejected include_denoising

    def close(self) -> None:
        self.http.close()

    def _fail(self, resp: httpx.Response) -> ClientError:
        msg = _error_message(resp)
        if resp.status_code == 401:
            return ClientError(f"the server at {self.base_url} refused the API key (401): {msg} "
                               f"(set --api-key, UNMASK_API_KEY or OPENAI_API_KEY)")
        if resp.status_code >= 500:
            return ClientError(f"server error {resp.status_code}: {msg}")
        return ClientError(f"request rejected ({resp.status_code}): {msg}")

    def _unreachable(self, exc: Exception) -> ClientError:
        return ClientError(f"cannot reach the server at {self.base_url} ({type(exc).__name__}: {exc or 'no reply'}); "
                           f"is `unmask serve` running? (--base-url sets another)")

    def models(self) -> list[str]:
        """The served model ids (``GET /v1/models``)."""
        try:
            resp = self.http.get("/models")
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if resp.status_code != 200:
            raise self._fail(resp)
        try:
            return [m["id"] for m in resp.json()["data"]]
        except Exception:
            raise ClientError(f"{self.base_url}/models: not an OpenAI model list") from None

    def chat(self, model: str, messages: list[dict], options: dict | None = None) -> Iterator:
        """Stream one chat completion; yields :class:`Delta`, :class:`Step`, :class:`Usage`, :class:`Finish` and
        :class:`Notice` objects. Closing the generator (or Ctrl-C inside it) closes the connection, which makes an
        unmask server abort the request and free its slot.

        Raises:
            ClientError: unreachable server, 401, 4xx/5xx, or an error event in the stream.
        """
        body = {"model": model, "messages": messages, "stream": True, **(options or {})}
        for attempt in (0, 1):
            stream_options = {"include_usage": True}
            if self.denoising:
                stream_options["include_denoising"] = True
            body["stream_options"] = stream_options
            try:
                with self.http.stream("POST", "/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        msg = _error_message(resp)
                        if attempt == 0 and self.denoising and _rejects_denoising(resp.status_code, msg):
                            self.denoising = False
                            yield Notice("the server does not stream denoising steps "
                                         f"({msg}); retrying without include_denoising")
                            continue
                        raise self._fail(resp)
                    yield from self._events(resp)
                    return
            except httpx.TimeoutException as exc:
                raise ClientError(f"the server at {self.base_url} stopped answering ({type(exc).__name__})") from None
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from None

    @staticmethod
    def _events(resp: httpx.Response) -> Iterator:
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                continue
            if "error" in chunk and "choices" not in chunk:
                err = chunk["error"]
                raise ClientError(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
            if chunk.get("denoising"):
                yield Step(chunk["denoising"])
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield Delta(text)
                if choice.get("finish_reason"):
                    yield Finish(choice["finish_reason"])
            if chunk.get("usage"):
                yield Usage(chunk["usage"])


@dataclass
class Canvas:
    """The generation region of choice 0 as the denoising stream fills it.

    ``cells[p]``: text at position ``p`` or None (masked); ``step_of[p]`` / ``block_of[p]``: the step / block that
    revealed it. ``block_size``: the request's, else inferred from completed blocks (None while unknown).
    ``final``: the last chunk's ``final`` (revisable canvases: positions from there on may still change), None when
    every shown token is final.
    """

    block_size: int | None = None
    cells: list = field(default_factory=list)
    step_of: list = field(default_factory=list)
    block_of: list = field(default_factory=list)
    step: int = -1
    block: int = 0
    nfe: int = 0
    revealed: int = 0
    started: float = field(default_factory=time.monotonic)
    last_revealed: list = field(default_factory=list)
    final: int | None = None

    def provisional(self, p: int) -> bool:
        """Whether the token shown at ``p`` may still change (docs/design.md#http-contract, "Revisable canvases")."""
        return self.final is not None and p >= self.final and self.cells[p] is not None

    def update(self, d: dict) -> None:
        canvas = d.get("canvas") or []
        n = len(canvas)
        if n > len(self.cells):
            extra = n - len(self.cells)
            self.cells += [None] * extra
            self.step_of += [None] * extra
            self.block_of += [None] * extra
        self.step = int(d.get("step", self.step + 1))
        self.block = int(d.get("block", self.block))
        self.nfe = int(d.get("nfe", self.nfe))
        final = d.get("final")
        self.final = int(final) if isinstance(final, int) and not isinstance(final, bool) else None
        self.last_revealed = []
        for r in d.get("revealed") or []:
            p = r["position"]
            if 0 <= p < len(self.cells) and self.step_of[p] is None:
                self.step_of[p] = self.step
                self.block_of[p] = self.block
                self.revealed += 1
            self.last_revealed.append(p)
        for p, t in enumerate(canvas):  # the canvas is the truth (texts of revealed positions)
            self.cells[p] = t
            if t is not None and self.step_of[p] is None:
                self.step_of[p], self.block_of[p] = self.step, self.block
                self.revealed += 1

    def drop_unrevealed_tail(self) -> None:
        """Forget the positions after the last revealed one: a finished answer (an EOS before ``max_tokens``)
        never decodes them, so they are not placeholders any more."""
        n = len(self.cells)
        while n and self.cells[n - 1] is None:
            n -= 1
        del self.cells[n:], self.step_of[n:], self.block_of[n:]

    def block_span(self) -> tuple[int, int] | None:
        """``(start, end)`` positions of the current block, or None when not known."""
        earlier = [p for p, b in enumerate(self.block_of) if b is not None and b < self.block]
        start = max(earlier) + 1 if earlier else 0
        size = self.block_size
        if size is None:
            ends = [p for p, b in enumerate(self.block_of) if b is not None and b == self.block - 1]
            if self.block > 0 and ends:
                size = max(ends) + 1 - min(ends)
        if size is None:
            mine = [p for p, b in enumerate(self.block_of) if b == self.block]
            return (start, max(mine) + 1) if mine else None
        return start, min(len(self.cells), start + size)

    def boundaries(self) -> set[int]:
        """Positions where a new block starts (from the blocks that revealed them)."""
        out = set()
        for b in sorted({b for b in self.block_of if b is not None})[1:]:
            earlier = [p for p, x in enumerate(self.block_of) if x is not None and x < b]
            if earlier:
                out.add(max(earlier) + 1)
        return out

    @property
    def seconds(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def status(self) -> str:
        tpf = self.revealed / self.nfe if self.nfe else 0.0
        # step and block both counted from 1 (the engine's are 0-based)
        return (f"step {self.step + 1}  block {self.block + 1}  NFE {self.nfe}  TPF {tpf:.2f}  "
                f"{self.revealed / self.seconds:.1f} tok/s  {self.revealed}/{len(self.cells)} revealed")
