"""Quiet by default: the libraries' chatter off unless `--verbose`, and one progress bar of our own.

transformers prints a "LOAD REPORT" table for the Llama's unused `lm_head.weight` (we load
`LlamaModel` on purpose, see model/loading.py) and diffusers, transformers and the hub draw a tqdm
bar per loaded part: to a user that reads like a failure. Only environment variables are set here
(each library reads its own when it is first imported), so `--help` and a refused flag stay
instant; `model/loading.py` turns diffusers' bars off at load time under the same variable
(`HF_HUB_DISABLE_PROGRESS_BARS`), because diffusers has no variable of its own for them. A user's own
setting of any of these variables wins.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, Mapping, MutableMapping

# variable -> value while quiet. The hub's variable also stands for diffusers' bars (model/loading.py).
QUIET_ENVIRONMENT: Mapping[str, str] = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "CACHE_DIT_LOG_LEVEL": "error",  # the optional cache-dit (`--cache dbcache:T`) logs every setup at INFO
}
# Loggers that report every HTTP request of gradio's own start-up checks at INFO.
CHATTY_LOGGERS = ("httpx", "httpcore")


def add_verbose_argument(parser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the libraries' own logs and progress bars (transformers, diffusers, the hub, httpx, cache-dit)",
    )


def quiet_libraries(verbose: bool, environ: MutableMapping[str, str] | None = None) -> None:
    """Unless `verbose`: the quiet settings above, each where the user has not set it already."""
    if verbose:
        return
    environ = os.environ if environ is None else environ
    for name, value in QUIET_ENVIRONMENT.items():
        environ.setdefault(name, value)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class LineBar:
    """One progress line on `stream` (stderr): drawn in place on a terminal; written once at the end
    elsewhere (a log file or a pipe gets one line instead of a wall of carriage returns)."""

    WIDTH = 24

    def __init__(self, label: str, stream: IO[str] | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.perf_counter()
        self.last = ""

    def bar(self, done: int, total: int) -> str:
        filled = min(self.WIDTH, round(self.WIDTH * done / max(1, total)))
        return f"{self.label} {'█' * filled}{'░' * (self.WIDTH - filled)}"

    def show(self, line: str) -> None:
        self.last = line
        if self.live:
            self.stream.write("\r" + self.last)
            self.stream.flush()

    def close(self) -> None:
        if not self.last:
            return
        self.stream.write(("\r" + self.last + "\n") if self.live else self.last + "\n")
        self.stream.flush()


class StepBar(LineBar):
    """The denoising steps: `edit ██████░░░░ 12/28 steps · 3.1 s`."""

    def render(self, step: int, total: int, stage: str = "") -> str:
        total = max(1, int(total))
        stage = f" ({stage})" if stage and stage != "edit" else ""
        return f"{self.bar(step, total)} {step}/{total} steps{stage} · {time.perf_counter() - self.started:.1f} s"

    def update(self, info) -> None:
        """`info`: a StepInfo (step, total, stage)."""
        self.show(self.render(info.step, info.total, info.stage))
