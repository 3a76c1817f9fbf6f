"""A real OpenAI-compatible chat-completions server on 127.0.0.1 that answers like a vision-language
model (import as `from fake_vlm import FakeVLM`; pytest puts tests/ on sys.path).

What it answers depends on a tag in the user's instruction, so one server (and one app) serves
every case and the rewriter's cache never mixes them up:

    (no tag)          SOURCE / INSTRUCTION / TARGET lines that echo the instruction
    [slow]            the same after SLOW_SECONDS (past the app's timeout in the tests)
    [http500]         HTTP 500 with an OpenAI-style error body
    [garbage]         a chatty one-liner instead of three lines
    [refuse]          "I'm sorry, ..." (a refusal in the text)
    [refusal-field]   an empty content with `message.refusal` set
    [length]          finish_reason "length" (cut off)
    [swapped]         three lines with the TARGET label on line 2
    [notjson]         HTTP 200 with an HTML body

Every request is recorded (path, headers with lower-case names, JSON body) in `requests`.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_SECONDS = 2.5


def canned_lines(instruction: str) -> tuple[str, str, str]:
    return (
        "A small picture of coloured noise on a plain background.",
        f"Apply this change to the noise picture: {instruction}",
        f"The noise picture after the change ({instruction}).",
    )


def user_text(body: dict) -> str:
    for message in body.get("messages", []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return " ".join(part.get("text", "") for part in content if part.get("type") == "text")
    return ""


def user_images(body: dict) -> list:
    """The images of the user turn, decoded (PIL)."""
    from PIL import Image

    images = []
    for message in body.get("messages", []):
        content = message.get("content")
        if message.get("role") != "user" or isinstance(content, str):
            continue
        for part in content:
            if part.get("type") == "image_url":
                url = part["image_url"]["url"]
                header, _, data = url.partition(",")
                assert header.startswith("data:image/") and header.endswith(";base64"), header
                images.append(Image.open(io.BytesIO(base64.b64decode(data))))
    return images


def completion(content: str | None, finish: str = "stop", refusal: str | None = None) -> dict:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "fake-vlm",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
    }


class FakeVLM:
    def __init__(self):
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload, content_type="application/json") -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                headers = {name.lower(): value for name, value in self.headers.items()}
                fake.requests.append({"path": self.path, "headers": headers, "body": body})
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                text = user_text(body)
                instruction = text.split("Editing request:", 1)[-1].strip()
                if "[slow]" in text:
                    time.sleep(SLOW_SECONDS)
                if "[http500]" in text:
                    return self._send(500, {"error": {"message": "model overloaded", "type": "server_error"}})
                if "[notjson]" in text:
                    return self._send(200, b"<html><body>proxy error</body></html>", "text/html")
                if "[garbage]" in text:
                    return self._send(200, completion("Sure! What a lovely picture, I would make it pop."))
                if "[refuse]" in text:
                    return self._send(200, completion("I'm sorry, but I can't help with that request."))
                if "[refusal-field]" in text:
                    return self._send(200, completion(None, refusal="This request violates the policy."))
                source, refined, target = canned_lines(instruction)
                if "[length]" in text:
                    return self._send(200, completion(f"SOURCE: {source}\nINSTRUCTION: {refined[:10]}", "length"))
                if "[swapped]" in text:
                    return self._send(200, completion(f"SOURCE: {source}\nTARGET: {target}\nINSTRUCTION: {refined}"))
                return self._send(200, completion(f"SOURCE: {source}\nINSTRUCTION: {refined}\nTARGET: {target}"))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-vlm", daemon=True)
        self.thread.start()

    def chat_requests(self) -> list[dict]:
        return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
