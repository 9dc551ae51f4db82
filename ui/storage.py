"""Local-filesystem storage client for Chainlit's data layer (persisted images).

Chainlit's ``SQLAlchemyDataLayer`` stores element *rows* in the database and element *bytes*
through a ``BaseStorageClient``; Chainlit ships S3, GCS and Azure clients but none for a local
disk. :class:`LocalStorageClient` is that client: files under ``PHI3V_UI_STORAGE_DIR``
(``ui/.data/files`` by default), one per element, at ``<user id>/<element id>/<file name>``
(the object key the data layer chooses, each segment percent-encoded on disk). Deleting a file
removes the directories it leaves empty.

The browser reads them back through ``GET /ui-files/<object key>``
(:func:`add_file_route`), which requires the Chainlit login cookie and serves a file only to
the author of the thread the element belongs to (looked up in the database: the user id the
data layer puts in the key can be ``unknown`` when an upload races the thread's creation).

Production with several UI replicas needs shared storage: swap this class for Chainlit's
``S3StorageClient`` (or GCS/Azure); nothing else changes. :meth:`read_file` is the one
addition to the base interface (rebuilding a conversation's images on resume).
"""

from __future__ import annotations

import asyncio
import mimetypes
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from chainlit.data.storage_clients.base import BaseStorageClient

#: URL prefix of the file route.
URL_PREFIX = "/ui-files"


class LocalStorageClient(BaseStorageClient):
    """Chainlit storage client writing to a local directory."""

    def __init__(self, root: Path, url_prefix: str = URL_PREFIX) -> None:
        self.root = Path(root).resolve()
        self.url_prefix = url_prefix

    def path(self, object_key: str) -> Path:
        """The file of ``object_key``; refuses keys that would leave :attr:`root`."""
        parts = object_key.split("/")
        if not object_key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid object key {object_key!r}")
        path = self.root.joinpath(*(quote(p, safe="") for p in parts))
        if not path.resolve().is_relative_to(self.root):
            raise ValueError(f"invalid object key {object_key!r}")
        return path

    async def upload_file(self, object_key: str, data: bytes | str,
                          mime: str = "application/octet-stream", overwrite: bool = True,
                          content_disposition: str | None = None) -> dict[str, Any]:
        path = self.path(object_key)
        if path.exists() and not overwrite:
            raise FileExistsError(object_key)
        raw = data.encode() if isinstance(data, str) else data

        def write() -> None:
            tmp = path.with_name(path.name + ".part")
            for attempt in range(2):
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    tmp.write_bytes(raw)
                    break
                except FileNotFoundError:  # a delete pruned the new directory: once more
                    if attempt:
                        raise
            tmp.replace(path)

        await asyncio.to_thread(write)
        return {"object_key": object_key, "url": await self.get_read_url(object_key)}

    def size(self, object_key: str) -> int:
        """Bytes of the file at ``object_key`` (0 when there is none)."""
        try:
            return self.path(object_key).stat().st_size
        except (FileNotFoundError, ValueError):
            return 0

    async def read_file(self, object_key: str) -> bytes:
        return await asyncio.to_thread(self.path(object_key).read_bytes)

    async def delete_file(self, object_key: str) -> bool:
        """Delete the file and the directories of its key that it leaves empty."""
        try:
            path = self.path(object_key)
            await asyncio.to_thread(path.unlink)
        except (FileNotFoundError, ValueError):
            return False
        await asyncio.to_thread(self._prune, path.parent)
        return True

    def _prune(self, directory: Path) -> None:
        """Remove ``directory`` and its parents below :attr:`root` while they are empty."""
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:  # not empty, or another delete removed it and goes on
                return
            directory = directory.parent

    async def get_read_url(self, object_key: str) -> str:
        return f"{self.url_prefix}/{quote(object_key, safe='/')}"

    async def close(self) -> None:
        return None


def add_file_route(app, storage: LocalStorageClient,
                   owner_of: Callable[[str], Awaitable[str | None]]) -> None:
    """Serve ``storage`` at ``GET {url_prefix}/{object_key}`` on Chainlit's FastAPI ``app``,
    only to the logged-in user whose identifier ``owner_of(object_key)`` returns (404 for
    anyone else: no hint that the file exists). Inserted first: Chainlit's SPA catch-all
    route is already registered and would answer every path otherwise."""
    from chainlit.auth import get_current_user
    from fastapi import Depends, HTTPException
    from fastapi.responses import FileResponse
    from fastapi.routing import APIRoute

    async def serve_file(object_key: str, user=Depends(get_current_user)):
        if user is None or await owner_of(object_key) != user.identifier:
            raise HTTPException(status_code=404, detail="Not found")
        try:
            path = storage.path(object_key)
        except ValueError:
            raise HTTPException(status_code=404, detail="Not found") from None
        if not path.is_file():
            raise HTTPException(status_code=404, detail="Not found")
        mime = mimetypes.guess_type(object_key)[0] or "application/octet-stream"
        return FileResponse(path, media_type=mime,
                            headers={"Cache-Control": "private, max-age=3600"})

    path = f"{storage.url_prefix}/{{object_key:path}}"
    if any(getattr(r, "path", None) == path for r in app.router.routes):
        return
    app.router.routes.insert(0, APIRoute(path, serve_file, methods=["GET"]))
