"""The synthetic world of issue 22, as the offline model's users meet it: seeded scenes, the three
instructions, and the app's example cases.

Exact so that anyone can generate fresh cases: a 128x128 RGB canvas with one solid background colour and
1 to 3 shapes of different kinds, each in one of six colours, bounding box 24-40 px, at least 4 px apart and
fully inside the canvas. An edit is one of ``make the {shape} {colour}``, ``remove the {shape}`` or
``make the background {background}``. ``make_case(seed)`` draws a scene and an edit from that seed alone,
so training (seeds below ``HELD_OUT_SEED_START``) and evaluation (seeds from it upward) never share a case.

The runtime needs only this much (the trained model's banner names its words and its three instruction forms,
the Edit tab shows `example_cases`, and `vocabulary_note` tells a user which words of an instruction the model
has never seen). What training and evaluation need besides, the held-out cases and the success metric, is
research code: hidream_ui/lab/world.py, which builds on this module.

Only numpy is imported here; images are ``uint8`` arrays of shape (128, 128, 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

SIZE = 128
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128)}
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 130, 30),
}
SHAPES = ("circle", "square", "triangle")
EDIT_KINDS = ("recolour", "remove", "background")
MIN_BOX, MAX_BOX, GAP = 24, 40, 4
# Training draws seeds below this; `bench quality` draws from here upward, so no held-out case was seen.
HELD_OUT_SEED_START = 1_000_000_000
# The app's offline examples start here: held out from training, and past any `bench quality --cases N`.
EXAMPLE_SEED_START = HELD_OUT_SEED_START + 500_000_000
# Every word an instruction can contain (the trained tokenizers must know each of them).
WORDS = ("make", "the", "remove", "background", *SHAPES, *COLOURS, *BACKGROUNDS)
# The three instructions, one per edit kind, with the slot each takes (the banner, the hints and the note say them).
INSTRUCTION_FORMS = ("make the {shape} {colour}", "remove the {shape}", "make the background {background}")


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    x: int  # left of the bounding box
    y: int  # top of the bounding box
    size: int  # the bounding box is size x size


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...]
    antialias: bool


@dataclass(frozen=True)
class Edit:
    kind: str  # one of EDIT_KINDS
    target: str  # shape kind, or "background"
    value: str  # new colour or background name; "" for remove

    @property
    def instruction(self) -> str:
        if self.kind == "recolour":
            return f"make the {self.target} {self.value}"
        if self.kind == "remove":
            return f"remove the {self.target}"
        return f"make the background {self.value}"


@dataclass(frozen=True)
class Case:
    seed: int
    scene: Scene
    edit: Edit
    source: np.ndarray
    target: np.ndarray  # the exact answer: the edited scene rendered

    @property
    def instruction(self) -> str:
        return self.edit.instruction


def _coverage(shape: Shape, supersample: int = 4) -> np.ndarray:
    """Fraction of each pixel covered by the shape (supersampled), float32 (SIZE, SIZE)."""
    n = SIZE * supersample
    c = (np.arange(n, dtype=np.float32) + 0.5) / supersample
    yy, xx = np.meshgrid(c, c, indexing="ij")
    s = float(shape.size)
    x0, y0 = float(shape.x), float(shape.y)
    if shape.kind == "square":
        inside = (xx >= x0) & (xx < x0 + s) & (yy >= y0) & (yy < y0 + s)
    elif shape.kind == "circle":
        r = s / 2
        inside = (xx - x0 - r) ** 2 + (yy - y0 - r) ** 2 <= r * r
    elif shape.kind == "triangle":
        # Upright isosceles: apex at the top middle, base along the bottom of the box.
        t = (yy - y0) / s  # 0 at the apex row, 1 at the base
        half = t * s / 2
        inside = (t >= 0) & (t <= 1) & (np.abs(xx - x0 - s / 2) <= half)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {SHAPES}")
    return inside.reshape(SIZE, supersample, SIZE, supersample).mean(axis=(1, 3)).astype(np.float32)


def shape_mask(shape: Shape) -> np.ndarray:
    """Boolean mask of the pixels that belong to the shape (coverage at least one half)."""
    return _coverage(shape) >= 0.5


def render(scene: Scene) -> np.ndarray:
    """The scene as a uint8 (128, 128, 3) image."""
    img = np.empty((SIZE, SIZE, 3), np.float32)
    img[:] = BACKGROUNDS[scene.background]
    for shape in scene.shapes:
        cov = _coverage(shape)
        if not scene.antialias:
            cov = (cov >= 0.5).astype(np.float32)
        img = img * (1 - cov[..., None]) + np.asarray(COLOURS[shape.colour], np.float32) * cov[..., None]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _boxes_apart(a: Shape, b: Shape) -> bool:
    return (
        a.x + a.size + GAP <= b.x or b.x + b.size + GAP <= a.x or a.y + a.size + GAP <= b.y or b.y + b.size + GAP <= a.y
    )


def sample_scene(rng: np.random.Generator) -> Scene:
    """1-3 shapes of different kinds, placed by rejection so boxes are GAP px apart and inside the canvas."""
    while True:
        n = int(rng.integers(1, 4))
        kinds = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:n]]
        shapes: list[Shape] = []
        for kind in kinds:
            for _ in range(100):
                size = int(rng.integers(MIN_BOX, MAX_BOX + 1))
                x = int(rng.integers(0, SIZE - size + 1))
                y = int(rng.integers(0, SIZE - size + 1))
                cand = Shape(kind, str(rng.choice(list(COLOURS))), x, y, size)
                if all(_boxes_apart(cand, other) for other in shapes):
                    shapes.append(cand)
                    break
        if len(shapes) == n:
            return Scene(str(rng.choice(list(BACKGROUNDS))), tuple(shapes), bool(rng.integers(0, 2)))


def sample_edit(scene: Scene, rng: np.random.Generator) -> Edit:
    """One of the three templates, uniformly by kind; the new colour/background always differs."""
    kind = EDIT_KINDS[int(rng.integers(0, len(EDIT_KINDS)))]
    if kind == "background":
        choices = [b for b in BACKGROUNDS if b != scene.background]
        return Edit("background", "background", str(rng.choice(choices)))
    shape = scene.shapes[int(rng.integers(0, len(scene.shapes)))]
    if kind == "remove":
        return Edit("remove", shape.kind, "")
    choices = [c for c in COLOURS if c != shape.colour]
    return Edit("recolour", shape.kind, str(rng.choice(choices)))


def apply_edit(scene: Scene, edit: Edit) -> Scene:
    """The scene the instruction asks for."""
    if edit.kind == "background":
        return replace(scene, background=edit.value)
    if edit.kind == "remove":
        return replace(scene, shapes=tuple(s for s in scene.shapes if s.kind != edit.target))
    if edit.kind == "recolour":
        return replace(
            scene, shapes=tuple(replace(s, colour=edit.value) if s.kind == edit.target else s for s in scene.shapes)
        )
    raise ValueError(f"unknown edit kind {edit.kind!r}; expected one of {EDIT_KINDS}")


def make_case(seed: int) -> Case:
    """The case of ``seed``: same seed, same scene, edit and images on every machine."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    scene = sample_scene(rng)
    edit = sample_edit(scene, rng)
    return Case(seed, scene, edit, render(scene), render(apply_edit(scene, edit)))


def example_cases(per_kind: int = 2, start: int = EXAMPLE_SEED_START) -> list[Case]:
    """The first ``per_kind`` cases of each edit kind from ``start`` on (the app's offline examples): every
    kind shown, none picked by how well a model does on it."""
    chosen: dict[str, list[Case]] = {kind: [] for kind in EDIT_KINDS}
    seed = start
    while any(len(cases) < per_kind for cases in chosen.values()):
        case = make_case(seed)
        if len(chosen[case.edit.kind]) < per_kind:
            chosen[case.edit.kind].append(case)
        seed += 1
    return [case for kind in EDIT_KINDS for case in chosen[kind]]


# ---------------------------------------------------------------------------------------------
# What the model knows, in words for its users
# ---------------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W\d_]+")  # runs of letters (any script): digits and punctuation are not words


def instruction_words(instruction: str) -> list[str]:
    """The words of an instruction as written, in order. Case counts: the model was trained on lower case only
    ("Make the Circle Red" came out a paler red than "make the circle red", all capitals barely red)."""
    return _WORD.findall(str(instruction))


def unknown_words(instruction: str) -> tuple[str, ...]:
    """The words of ``instruction`` that are not in WORDS, each once, in the order they come."""
    return tuple(dict.fromkeys(word for word in instruction_words(instruction) if word not in WORDS))


def is_known_instruction(instruction: str) -> bool:
    """Whether ``instruction`` is one of the three forms with words of the world, in lower case (spacing and
    punctuation aside)."""
    words = instruction_words(instruction)
    if len(words) == 3 and words[:2] == ["remove", "the"]:
        return words[2] in SHAPES
    if len(words) == 4 and words[:2] == ["make", "the"]:
        return (words[2] in SHAPES and words[3] in COLOURS) or (words[2] == "background" and words[3] in BACKGROUNDS)
    return False


def instruction_forms(markup: str = "*") -> str:
    """The three forms with the words each slot takes, e.g. "*make the {circle / square / triangle} {red / ...}*"
    (``markup`` wraps each form: "*" for Markdown emphasis, "" for plain text)."""
    slots = {
        "{shape}": "{" + " / ".join(SHAPES) + "}",
        "{colour}": "{" + " / ".join(COLOURS) + "}",
        "{background}": "{" + " / ".join(BACKGROUNDS) + "}",
    }
    forms = []
    for form in INSTRUCTION_FORMS:
        for slot, words in slots.items():
            form = form.replace(slot, words)
        forms.append(f"{markup}{form}{markup}")
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def example_instructions() -> tuple[str, ...]:
    """One instruction of each form, written out (placeholders and hints)."""
    return (
        f"make the {SHAPES[1]} {tuple(COLOURS)[2]}",
        f"remove the {SHAPES[0]}",
        f"make the background {tuple(BACKGROUNDS)[1]}",
    )


def vocabulary_note(instruction: str) -> str | None:
    """A friendly note when ``instruction`` leaves the world: the words the model has never seen, or (all words
    known) an order it was not trained on, and what it does know. None for an instruction of the world. Plain
    text: the app, the API and the CLI show it as it is. The edit runs either way; this only says why the
    result may be a guess."""
    instruction = " ".join(str(instruction).split())
    if not instruction or is_known_instruction(instruction):
        return None
    unknown = unknown_words(instruction)
    if unknown:
        shown = ", ".join(f"\u201c{word}\u201d" for word in unknown[:6]) + (", ..." if len(unknown) > 6 else "")
        lower = " (it learnt its words in lower case)" if any(word.lower() in WORDS for word in unknown) else ""
        what = f"The offline model has never seen {shown}{lower}."
    else:
        what = "The offline model knows each of these words, but not this instruction."
    return (
        f"{what} It knows three instructions: {', '.join(INSTRUCTION_FORMS)}; shapes {', '.join(SHAPES)}; colours "
        f"{', '.join(COLOURS)}; backgrounds {', '.join(BACKGROUNDS)}. It edited anyway, so the result is a guess."
    )
