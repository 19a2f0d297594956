"""The browser visualizer: a static page (``unmask.clients.web`` package data) served at ``/``.

``mount_visualizer(app, root_path)`` adds ``GET /`` (the page), ``GET /visualizer/{file}`` (its script and
style sheet) and ``GET /favicon.ico`` (an SVG icon). The page uses relative URLs only (``v1/models``,
``v1/chat/completions``, ``visualizer/app.js``) resolved against a ``<base href>`` of the app's external prefix:
``root_path`` (``unmask serve --root-path``), else the request's ASGI ``root_path``, so the page works on the
server's own origin and behind a reverse proxy that serves it under a path prefix. The page itself needs no API key
(the open routes: :mod:`unmask.server.guard`); every ``/v1`` route still does.
"""
from __future__ import annotations

import html
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}

# the tab icon at /favicon.ico (browsers ask for it; an SVG, which they all draw): a masked cell beside a revealed one
ICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32"><rect x="2" y="8" width="13" height="16" rx="3" '
        'fill="#9aa5b1"/><rect x="17" y="8" width="13" height="16" rx="3" fill="#3b82f6"/></svg>')


def _read(name: str) -> str:
    return resources.files("unmask.clients.web").joinpath(name).read_text(encoding="utf-8")


def mount_visualizer(app: FastAPI, root_path: str = "") -> None:
    """Serve the visualizer page at ``/`` of ``app`` (``root_path``: the external path prefix, e.g. ``/unmask``)."""
    fixed = (root_path or "").rstrip("/")

    @app.get("/", include_in_schema=False)
    async def visualizer_page(request: Request):
        prefix = fixed or str(request.scope.get("root_path") or "").rstrip("/")
        page = _read("index.html").replace("{{BASE}}", html.escape(prefix + "/", quote=True))
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(ICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/visualizer/{name}", include_in_schema=False)
    async def visualizer_file(name: str):
        if name not in FILES:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(_read(name), media_type=FILES[name], headers={"Cache-Control": "no-cache"})
