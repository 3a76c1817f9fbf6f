"""Training data from the world: every prompt it can give, the training seeds (never a held-out case) and the pool
of encoded (source, target) latent pairs the transformer's steps draw from; the shape-token labels of the
grounding head."""

from __future__ import annotations

import numpy as np

from hidream_ui.lab import world
from hidream_ui.lab.scoring import pixels


def world_prompts() -> list[str]:
    """Every instruction the world can give, in a fixed order (index = prompt id)."""
    edits = [world.Edit("recolour", s, c) for s in world.SHAPES for c in world.COLOURS]
    edits += [world.Edit("remove", s, "") for s in world.SHAPES]
    edits += [world.Edit("background", "background", b) for b in world.BACKGROUNDS]
    return [e.instruction for e in edits]


class Seeds:
    """Training case seeds: a seeded stream below HELD_OUT_SEED_START (never an evaluation case)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([seed, 22])

    def next(self) -> int:
        return int(self.rng.integers(0, world.HELD_OUT_SEED_START))


class CasePool:
    """Latent pairs (source, target) and prompt ids of training cases; a few replaced by fresh cases each step.
    With `tokens` (tokens per image side): only cases that ask which shape (`asks_which_shape`), each with its
    target tokens' labels (`shape_tokens`), which `sample` returns fourth. With `background_share`: that share of
    the cases drawn are background edits, the rest recolours and removes."""

    def __init__(
        self,
        size: int,
        encode,
        seeds: Seeds,
        prompt_ids: dict[str, int],
        torch,
        tokens: int = 0,
        background_share: float | None = None,
    ):
        self.encode, self.seeds, self.prompt_ids, self.torch, self.tokens = encode, seeds, prompt_ids, torch, tokens
        # Its own stream, drawn only when asked: without a share the seeds (hence the default run) are unchanged.
        self.kind_rng = np.random.default_rng(seeds.next()) if background_share is not None else None
        self.background_share = background_share
        cases = [self._draw() for _ in range(size)]
        sources, targets = [], []
        for start in range(0, size, 32):  # encoded in chunks: one image at a time is slow, all at once is big
            chunk = cases[start : start + 32]
            sources.append(encode(pixels([c.source for c in chunk], torch)))
            targets.append(encode(pixels([c.target for c in chunk], torch)))
        self.source, self.target = torch.cat(sources), torch.cat(targets)
        self.prompt = torch.tensor([prompt_ids[c.instruction] for c in cases])
        if tokens:
            self.labels = torch.stack([self._labels(c) for c in cases])
        self.rng = np.random.default_rng(seeds.next())

    def _draw(self) -> world.Case:
        background = None if self.kind_rng is None else bool(self.kind_rng.random() < self.background_share)
        while True:
            case = world.make_case(self.seeds.next())
            if self.tokens and not asks_which_shape(case):
                continue
            if background is None or (case.edit.kind == "background") == background:
                return case

    def _labels(self, case: world.Case):
        return self.torch.from_numpy(shape_tokens(case, self.tokens))

    def refresh(self, count: int) -> None:
        for slot in self.rng.integers(0, len(self.prompt), size=count):
            case = self._draw()
            latents = self.encode(pixels([case.source, case.target], self.torch))
            self.source[slot], self.target[slot] = latents[0], latents[1]
            self.prompt[slot] = self.prompt_ids[case.instruction]
            if self.tokens:
                self.labels[slot] = self._labels(case)

    def sample(self, count: int):
        index = self.torch.from_numpy(self.rng.integers(0, len(self.prompt), size=count))
        picked = (self.source[index], self.target[index], self.prompt[index])
        return (*picked, self.labels[index]) if self.tokens else picked


# A token counts as a shape's when the shape covers at least this share of its pixels (docs/lab-notebook.md).
SHAPE_TOKEN_COVER = 0.3


def asks_which_shape(case: world.Case) -> bool:
    """Whether the case's edit must pick one shape among others: a recolour or remove with two or three shapes."""
    return case.edit.kind != "background" and len(case.scene.shapes) > 1


def shape_tokens(case: world.Case, tokens: int) -> np.ndarray:
    """float32 (2, tokens * tokens), row-major like the transformer's image tokens: [0] 1 on the tokens of the
    shape the instruction names, [1] 1 on the tokens of any shape (the ones the grounding loss scores)."""
    cell = world.SIZE // tokens
    named = np.zeros((tokens, tokens), bool)
    shapes = np.zeros((tokens, tokens), bool)
    for shape in case.scene.shapes:
        cover = world.shape_mask(shape).reshape(tokens, cell, tokens, cell).mean(axis=(1, 3)) >= SHAPE_TOKEN_COVER
        shapes |= cover
        if shape.kind == case.edit.target:
            named |= cover
    return np.stack([named.reshape(-1), shapes.reshape(-1)]).astype(np.float32)
