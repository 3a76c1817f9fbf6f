"""Who may call the app's service routes (the OpenAI-compatible images API, MCP), and as whom.

* ``--api-keys FILE`` (one key per line; blank lines and ``#`` comments ignored): every call must
  carry ``Authorization: Bearer <key>``. A caller is charged per key (its label, ``key1``,
  ``key2``... by line, never the key itself), so one key's agents share that key's job and storage
  limits. Wrong keys count against the address like failed logins (``--max-login-failures`` per
  minute, then 429).
* No ``--api-keys``: the routes answer only where the app has no login (``--auth``/``--auth-file``):
  anyone who may open the page may call them, charged per address like a browser. An app with a
  login and no keys refuses them (403): a key file is how an operator lets programs in.

Where the app has a login, a key's calls act as the login ``api-<label>`` (never the operator:
`check_login_names` refuses, at start, an --auth user or an --operator of such a name): the
queue, the kiosk rules and the per-client storage see that user. A key is never logged,
printed or stored beyond this process's memory (only a hash of it is kept).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from hidream_ui.server.loopback import Caller, CallRefused

MIN_KEY_LENGTH = 16  # a key shorter than this is guessable within the login throttle's budget
MAX_KEYS = 1000


class ApiKeyFileError(ValueError):
    """The key file cannot be used (the message names the file and the line, never a key)."""


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys, as SHA-256 digests with their labels (``key<line>``)."""

    digests: tuple[tuple[bytes, str], ...] = field(repr=False)

    @classmethod
    def load(cls, path: Path | str) -> "ApiKeys":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyFileError(f"--api-keys {path}: cannot read it ({type(exc).__name__})") from None
        digests: list[tuple[bytes, str]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if len(key) < MIN_KEY_LENGTH or any(ch.isspace() for ch in key):
                raise ApiKeyFileError(
                    f"--api-keys {path}: line {number} is not a key of at least {MIN_KEY_LENGTH} characters "
                    "without spaces (make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
                )
            digests.append((_digest(key), f"key{number}"))
        if not digests:
            raise ApiKeyFileError(f"--api-keys {path}: the file holds no key (one per line)")
        if len(digests) > MAX_KEYS:
            raise ApiKeyFileError(f"--api-keys {path}: {len(digests)} keys, at most {MAX_KEYS}")
        return cls(tuple(digests))

    def label(self, presented: str) -> str | None:
        """The label of `presented` when it is one of the keys (compared in constant time), else None."""
        digest = _digest(presented)
        found = None
        for known, label in self.digests:  # every key is compared: the time does not say which matched
            if hmac.compare_digest(known, digest):
                found = label
        return found


def login_of(label: str) -> str:
    """The login a key's calls act as where the app has one (``api-key<line>``)."""
    return f"api-{label}"


# Every name a key's login may take, whatever the key file holds now: a key added to the file later
# must not turn out to be someone's login.
_KEY_LOGIN = re.compile(r"api-key\d+")


def check_login_names(names: Iterable[str]) -> None:
    """Refuses (ApiKeyFileError) an --auth / --auth-file user or the --operator named like a key's
    login (``api-key<N>``): gradio would see that person and the key's programs as one login, so
    the key's calls would share that user's storage or, for the operator's name, act as the operator
    (the engine-wide controls of --kiosk). The app calls this at start when it has --api-keys."""
    for name in names:
        if _KEY_LOGIN.fullmatch(name):
            raise ApiKeyFileError(
                f"the login {name!r} is the name the API key on line {name[7:]} of --api-keys acts as: "
                "give that user (or the operator) another name"
            )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer(scope: dict) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header (None without one)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def address_of(scope: dict) -> str:
    return str((scope.get("client") or ("?", 0))[0])


class ApiGate:
    """Turns a service request (ASGI `scope`) into the `Caller` it runs as, or refuses it.

    `keys`: the --api-keys (None: none given); `public`: the app has no login; `throttle`: a
    `guard.LoginThrottle` for wrong keys (None: not throttled).
    """

    def __init__(self, keys: ApiKeys | None, *, public: bool, throttle=None):
        self.keys = keys
        self.public = public
        self.throttle = throttle

    def caller(self, scope: dict, agent: Callable[[str], str] | None = None) -> Caller:
        """The caller of `scope`. `agent(base)` may narrow who is charged (MCP: per session);
        by default a key's calls are charged to the key and keyless ones to the address.
        Raises CallRefused: 401 (no or wrong key), 403 (a login app without --api-keys), 429
        (too many wrong keys from this address)."""
        address = address_of(scope)
        if self.keys is None:
            if not self.public:
                raise CallRefused(
                    403,
                    "api_disabled",
                    "This app has a login: programs call it with an API key (the operator starts it with "
                    "--api-keys FILE).",
                )
            base = f"address:{address}"
            return Caller(address=address, agent=agent(base) if agent else base, user=None)
        token = bearer(scope)
        if token is None:
            raise CallRefused(401, "missing_api_key", "No API key: send 'Authorization: Bearer <key>'.")
        attempt = None
        if self.throttle is not None:
            wait, attempt = self.throttle.begin(f"api-key@{address}")
            if attempt is None:
                raise CallRefused(
                    429, "too_many_attempts", f"Too many wrong API keys: try again in {wait:.0f} s.", retry_after=wait
                )
        label = self.keys.label(token)
        if label is None:
            raise CallRefused(401, "invalid_api_key", "Incorrect API key provided.")
        if self.throttle is not None and attempt is not None:
            self.throttle.succeeded(attempt, f"api-key@{address}")
        base = f"key:{label}"
        return Caller(
            address=address, agent=agent(base) if agent else base, user=None if self.public else login_of(label)
        )


__all__ = [
    "ApiKeys",
    "ApiKeyFileError",
    "ApiGate",
    "bearer",
    "address_of",
    "check_login_names",
    "login_of",
    "MIN_KEY_LENGTH",
]
