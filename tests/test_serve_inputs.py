"""The multipart/form-data reader of `vitkit serve`: the same file part as Starlette's own parser (python-
multipart) finds, for the bodies that httpx, curl-style clients and browsers send, and a 400 naming what is
wrong for the rest."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("starlette", reason="vitkit serve needs the serve extra: pip install 'vitkit[serve]'")
httpx = pytest.importorskip("httpx", reason="the serve tests build their bodies with httpx (the dev extra)")

from starlette.datastructures import UploadFile  # noqa: E402
from starlette.requests import Request  # noqa: E402

from vitkit.serve.errors import RequestError  # noqa: E402
from vitkit.serve.inputs import form_field  # noqa: E402

IMAGE = os.urandom(3000) + b"\r\n--notaboundary\r\n" + os.urandom(100)  # bytes a boundary search must skip


def encoded(**kwargs) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/predictions", **kwargs)
    return request.read(), request.headers["content-type"]


def starlettes(body: bytes, content_type: str) -> bytes | None:
    """What Starlette's form parser finds in the part named 'file' (None: no such file part)."""
    async def run():
        sent = False

        async def receive():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [
            (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]}
        form = await Request(scope, receive).form()
        upload = form.get("file")
        return await upload.read() if isinstance(upload, UploadFile) else None

    return asyncio.run(run())


BODIES = {
    "file alone": dict(files={"file": ("cat.jpg", IMAGE, "image/jpeg")}),
    "fields before and after": dict(data={"a": "1", "filename": "x"},
                                    files={"other": ("o.png", b"other bytes"), "file": ("c.png", IMAGE)}),
    "a file name holding name=": dict(files={"file": ('name="x"; name=file.png', IMAGE)}),
    "empty file": dict(files={"file": ("e.png", b"")}),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_the_file_part_is_the_one_starlette_finds(case):
    body, content_type = encoded(**BODIES[case])
    assert form_field(body, content_type) == starlettes(body, content_type)


def test_a_browsers_body_with_a_quoted_boundary_and_a_preamble():
    """As a browser sends it, with a quoted boundary and an unquoted name; and with a preamble before the
    first boundary, which RFC 2046 lets readers ignore (Starlette's parser refuses it)."""
    boundary = "----WebKitFormBoundary7MA4YWxkTrZu0gW"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhello\r\n".encode()
            + f"--{boundary}\r\ncontent-disposition: form-data; name=file; filename=\"cat.png\"\r\n"
              "Content-Type: image/png\r\n\r\n".encode() + IMAGE + f"\r\n--{boundary}--\r\n".encode())
    content_type = f'multipart/form-data; boundary="{boundary}"'
    assert form_field(body, content_type) == IMAGE == starlettes(body, content_type)
    assert form_field(b"a preamble\r\n" + body, content_type) == IMAGE


def test_what_is_wrong_is_a_400_saying_so():
    body, content_type = encoded(files={"image": ("cat.png", IMAGE)})
    with pytest.raises(RequestError, match="no file part named 'file'") as info:
        form_field(body, content_type)
    assert info.value.status == 400
    body, content_type = encoded(files={"file": ("cat.png", IMAGE)})
    with pytest.raises(RequestError, match="cut short"):
        form_field(body[:-100], content_type)
    with pytest.raises(RequestError, match="no boundary"):
        form_field(body, "multipart/form-data")
