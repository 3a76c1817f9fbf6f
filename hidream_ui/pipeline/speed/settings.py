"""The speed settings as plain values: parsing and checks, no torch (config validation imports this).

One home for the grammar of `--cache` / the Speed setting and for the rule tying `--compile blocks`
to the sync-free MoE.
"""

from __future__ import annotations

from dataclasses import dataclass

# The UI's "Speed" setting (and `--cache` accepts these names too).
SPEED_PRESETS = {"exact": "none", "fast": "interval:2", "faster": "interval:3"}
INTERVAL_RANGE = (1, 100)
# --moe and --compile: their one home (config's flags and help read these).
MOE_CHOICES = ("auto", "diffusers", "sync-free")  # auto: sync-free with --compile blocks, else diffusers
COMPILE_CHOICES = ("none", "blocks")
THRESHOLD_RANGE = (0.0, 10.0)  # T must be > 0 (0 would never skip: use none)


@dataclass(frozen=True)
class CacheSpec:
    """A parsed step-cache mode; `str()` is its canonical spelling (what metadata records)."""

    kind: str = "none"
    interval: int = 1
    threshold: float = 0.0

    def __str__(self) -> str:
        if self.kind == "interval":
            return f"interval:{self.interval}"
        if self.kind == "first-block":
            return f"first-block:{self.threshold:g}"
        return "none"

    @property
    def active(self) -> bool:
        return self.kind != "none"


def parse_cache(text: object, name: str = "cache") -> CacheSpec:
    """`none` | `interval:K` | `first-block:T` | a Speed preset (`exact`, `fast`, `faster`).

    Raises ValueError naming `name` and the value."""
    raw = str(text).strip().lower()
    raw = SPEED_PRESETS.get(raw, raw)
    allowed = (f"none, interval:K (K {INTERVAL_RANGE[0]}..{INTERVAL_RANGE[1]}), "
               f"first-block:T (0 < T <= {THRESHOLD_RANGE[1]:g}), or {', '.join(SPEED_PRESETS)}")
    if raw == "none":
        return CacheSpec()
    kind, sep, value = raw.partition(":")
    try:
        if sep and kind == "interval":
            k = int(value)
            if INTERVAL_RANGE[0] <= k <= INTERVAL_RANGE[1]:
                return CacheSpec("interval", interval=k)
        elif sep and kind == "first-block":
            t = float(value)
            if THRESHOLD_RANGE[0] < t <= THRESHOLD_RANGE[1]:
                return CacheSpec("first-block", threshold=t)
    except ValueError:
        pass
    raise ValueError(f"{name}={text!r} is not valid: use {allowed}")


def effective_moe(moe: str, compile_mode: str) -> str:
    """`--moe auto` resolved: graph capture needs a MoE without host syncs."""
    if moe == "auto":
        return "sync-free" if compile_mode == "blocks" else "diffusers"
    return moe


class SpeedSettingError(ValueError):
    """A --moe / --compile / --cache value (or pair) that cannot be used; the message names it
    (config.validate turns it into a ConfigError)."""


def check_speed(moe: str, compile_mode: str, cache: str) -> None:
    """Checks --moe / --compile / --cache; raises SpeedSettingError naming the value."""
    if moe not in MOE_CHOICES:
        raise SpeedSettingError(f"moe={moe!r} is not one of: {', '.join(MOE_CHOICES)}")
    if compile_mode not in COMPILE_CHOICES:
        raise SpeedSettingError(f"compile={compile_mode!r} is not one of: {', '.join(COMPILE_CHOICES)}")
    if compile_mode == "blocks" and moe == "diffusers":
        raise SpeedSettingError("compile='blocks' needs moe 'sync-free' (or 'auto'): diffusers' MoE reads expert "
                                "counts on the host in every block, which breaks the graph at every block")
    try:
        parse_cache(cache)
    except ValueError as exc:
        raise SpeedSettingError(str(exc)) from None
