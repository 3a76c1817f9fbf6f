"""`bench quality`'s configurations: every way to run an edit that the benchmark measures against `exact` (step
caches, step counts, fp8 weights, memory plans, attention strategies, padding collapse), which of them this
device can run, and the `--only` / `--caches` / `--steps-grid` words that pick them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from hidream_ui.config import TINY_PROFILES, AppConfig
from hidream_ui.edits import EditParams
from hidream_ui.model.planner import plan_for
from hidream_ui.model.plans import PLANS
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME
from hidream_ui.pipeline.speed.settings import MAX_STEPS_RANGE, MEASURED_CACHES, cache_unavailable, parse_cache

# The trained offline model (issue 22) when this checkout has it, else the random one.
TRAINED_PROFILE = "trained"


# The step caches measured by default (`--caches` replaces the list with any `--cache` values).
CACHE_MODES = MEASURED_CACHES


GROUPS = ("exact", "cache", "steps", "weights", "memory", "attention", "padding")


def default_profile() -> str:
    return TRAINED_PROFILE if TRAINED_PROFILE in TINY_PROFILES else "tiny"


def profile_choices() -> list[str]:
    # `full` is the release's size with random weights: hours per case on a CPU and nothing to learn.
    return [p for p in TINY_PROFILES if p != FULL_PROFILE_NAME]


@dataclass(frozen=True)
class Configuration:
    """One way to run an edit. `memory` / `weights` decide the engine (a load each); `cache`, `attention`
    and `collapse_padding` switch per edit on a loaded engine."""

    name: str
    group: str  # one of GROUPS
    exact_mode: bool  # must give exact's success verdict on every case (no approximation involved)
    cache: str = "none"
    attention: str | None = None  # None: the strategy the engine picked at load (auto), as exact uses
    memory: str = "full"
    weights: str = "bf16"
    collapse_padding: bool = True
    steps: int | None = None  # None: the run's step count (exact's); a step count of `--steps-grid` otherwise

    @property
    def engine_key(self) -> tuple[str, str]:
        return (self.memory, self.weights)

    def settings(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "attention": self.attention or "auto",
            "memory": self.memory,
            "weights": self.weights,
            "collapse_padding": self.collapse_padding,
            "steps": self.steps,
        }


EXACT = Configuration("exact", "exact", True)


def cache_specs(values: Iterable[str]) -> list[str]:
    """Canonical `--cache` spellings of `values` (presets resolved, `none` dropped: that is exact), in order,
    once each. Raises ValueError naming a value that is not a step cache."""
    specs: list[str] = []
    for value in values:
        spec = str(parse_cache(value.strip(), "--caches"))
        if spec != "none" and spec not in specs:
            specs.append(spec)
    return specs


def steps_name(cache: str, steps: int) -> str:
    """The name of a step-count configuration: `steps:N` alone, `CACHE@N` crossed with a step cache."""
    return f"steps:{steps}" if cache == "none" else f"{cache}@{steps}"


def step_counts(values: Iterable[str | int], name: str = "--steps-grid") -> list[int]:
    """The step counts of `values`, in order, once each. Raises ValueError naming a value that is not a
    step count (MAX_STEPS_RANGE)."""
    low, high = MAX_STEPS_RANGE
    counts: list[int] = []
    for value in values:
        text = str(value).strip()
        try:
            n = int(text)
        except ValueError:
            n = 0
        if not low <= n <= high:
            raise ValueError(f"{name}: {text!r} is not a step count (an integer from {low} to {high})")
        if n not in counts:
            counts.append(n)
    return counts


def all_configurations(
    device,
    dtype,
    profile: str,
    caches: Iterable[str] = CACHE_MODES,
    steps_grid: Iterable[int] = (),
    cross: Iterable[str] = (),
    steps: int | None = None,
) -> tuple[list[Configuration], dict[Configuration, str]]:
    """Every configuration this device can run, exact first; and {configuration: reason} for those it cannot.
    `steps_grid`: step counts measured beside exact's `steps` (`steps:N`); `cross`: step caches also run at
    each of them (`CACHE@N`)."""
    from hidream_ui.pipeline.attention.registry import AUTO, list_strategies

    configs = [EXACT]
    unavailable: dict[Configuration, str] = {}
    exact_steps = steps or EditParams.defaults_for("e1.1").num_inference_steps
    grid = [n for n in step_counts(steps_grid) if n != exact_steps]
    crossed = cache_specs(cross)
    for spec in cache_specs(caches):  # an optional library that is not installed: listed with its hint
        config, missing = Configuration(spec, "cache", False, cache=spec), cache_unavailable(parse_cache(spec))
        if missing:
            unavailable[config] = missing
        else:
            configs.append(config)
    for n in grid:  # fewer (or more) steps alone, then each crossed cache at that count
        configs.append(Configuration(steps_name("none", n), "steps", False, steps=n))
        for spec in crossed:
            config = Configuration(steps_name(spec, n), "cache", False, cache=spec, steps=n)
            missing = cache_unavailable(parse_cache(spec))
            if missing:
                unavailable[config] = missing
            else:
                configs.append(config)
    rows = plan_for(AppConfig(tiny_profile=profile, device=device.torch_device), device, dtype).rows
    notes = {(r.plan, r.weights): r.note for r in rows}
    candidates = [Configuration("fp8", "weights", False, weights="fp8")]
    candidates += [Configuration(f"memory:{plan}", "memory", True, memory=plan) for plan in PLANS if plan != "full"]
    for config in candidates:
        note = notes.get(config.engine_key, "the planner does not list it")
        if note:
            unavailable[config] = note
        else:
            configs.append(config)
    # Every available strategy, the one `auto` resolves to included: run again, it is exact-against-exact.
    for status in list_strategies(device, dtype):
        if status.name == AUTO:
            continue
        config = Configuration(f"attention:{status.name}", "attention", True, attention=status.name)
        if status.available:
            configs.append(config)
        else:
            unavailable[config] = status.reason
    configs.append(Configuration("padded", "padding", True, collapse_padding=False))
    return configs, unavailable


def select(
    configs: list[Configuration], only: Iterable[str] | None, unavailable: dict[Configuration, str] | None = None
) -> tuple[list[Configuration], dict[str, str]]:
    """The configurations named (by name or group) in `only`, exact always (every figure is against
    it); and {name: reason} of the unavailable ones it names. Raises ValueError naming an unknown word."""
    unavailable = unavailable or {}
    words = [w.strip() for w in only or () if w.strip()]
    known = {c.name for c in (*configs, *unavailable)} | set(GROUPS)
    unknown = [w for w in words if w not in known]
    if unknown:
        raise ValueError(
            f"--only: unknown configuration(s) {', '.join(map(repr, unknown))}; "
            f"choose from: {', '.join(GROUPS)}, {', '.join(c.name for c in configs)}"
        )

    def chosen(c: Configuration) -> bool:
        return not words or c.name in words or c.group in words

    return (
        [c for c in configs if c is EXACT or chosen(c)],
        {c.name: why for c, why in unavailable.items() if chosen(c)},
    )
