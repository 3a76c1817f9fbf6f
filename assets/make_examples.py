"""Draws the example images in this folder (CC0: they are made here, from nothing but shapes).

Run from the repository root to regenerate them byte for byte::

    python assets/make_examples.py

Only PIL is used and nothing is random, so the same Pillow version writes the same files. The
scenes are deliberately simple (flat shapes, gradients) but each has an obvious object for an
editing instruction to act on; `examples.json` pairs every image with its instruction and a target description
(used for E1-Full).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).resolve().parent


def _vertical_gradient(size: tuple[int, int], top: tuple[int, int, int], bottom: tuple[int, int, int]) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size)
    draw = ImageDraw.Draw(image)
    for y in range(height):
        t = y / max(1, height - 1)
        colour = tuple(round(a + (b - a) * t) for a, b in zip(top, bottom))
        draw.line([(0, y), (width, y)], fill=colour)
    return image


def cottage() -> Image.Image:
    """A cottage with a red roof on a summer meadow under a blue sky (384 x 288)."""
    image = _vertical_gradient((384, 288), (92, 154, 224), (196, 226, 250))
    draw = ImageDraw.Draw(image)
    draw.ellipse([300, 28, 348, 76], fill=(255, 221, 87))  # sun
    draw.rectangle([0, 200, 384, 288], fill=(96, 170, 72))  # meadow
    draw.ellipse([-60, 180, 200, 240], fill=(110, 182, 84))  # hill
    draw.rectangle([120, 140, 260, 230], fill=(236, 222, 196))  # walls
    draw.polygon([(104, 142), (190, 82), (276, 142)], fill=(186, 52, 44))  # roof
    draw.rectangle([176, 180, 204, 230], fill=(120, 78, 46))  # door
    draw.rectangle([136, 160, 162, 184], fill=(140, 196, 236))  # windows
    draw.rectangle([218, 160, 244, 184], fill=(140, 196, 236))
    draw.rectangle([40, 150, 52, 212], fill=(110, 74, 40))  # tree trunk
    draw.ellipse([14, 104, 78, 168], fill=(46, 124, 58))  # tree crown
    return image


def apple() -> Image.Image:
    """A red apple on a wooden table against a plain wall (288 x 288)."""
    image = _vertical_gradient((288, 288), (238, 232, 220), (214, 204, 188))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 200, 288, 288], fill=(150, 100, 60))  # table
    for y in range(208, 288, 14):  # wood grain
        draw.line([(0, y), (288, y + 4)], fill=(134, 88, 52), width=2)
    shadow = Image.new("L", image.size, 0)
    ImageDraw.Draw(shadow).ellipse([86, 206, 210, 230], fill=120)
    image.paste((90, 58, 34), mask=shadow.filter(ImageFilter.GaussianBlur(6)))
    draw.ellipse([84, 100, 204, 218], fill=(196, 30, 40))  # apple
    draw.ellipse([108, 118, 140, 150], fill=(236, 110, 110))  # highlight
    draw.line([(144, 104), (150, 76)], fill=(92, 60, 30), width=5)  # stem
    draw.ellipse([150, 72, 186, 92], fill=(70, 150, 60))  # leaf
    return image


def sailboat() -> Image.Image:
    """A white sailboat on a calm sea at noon (384 x 256)."""
    image = _vertical_gradient((384, 256), (120, 180, 235), (210, 232, 248))
    draw = ImageDraw.Draw(image)
    sea = _vertical_gradient((384, 106), (40, 110, 170), (20, 70, 120))
    image.paste(sea, (0, 150))
    for x0, y0 in ((30, 170), (250, 200), (120, 225), (300, 175)):  # wave glints
        draw.arc([x0, y0, x0 + 40, y0 + 10], 200, 340, fill=(200, 225, 245), width=2)
    draw.polygon([(140, 170), (250, 170), (232, 192), (158, 192)], fill=(250, 250, 250))  # hull
    draw.line([(196, 60), (196, 170)], fill=(80, 60, 40), width=4)  # mast
    draw.polygon([(200, 66), (200, 164), (262, 164)], fill=(244, 244, 236))  # sails
    draw.polygon([(192, 80), (192, 164), (146, 164)], fill=(232, 232, 224))
    draw.ellipse([40, 40, 120, 66], fill=(250, 250, 252))  # cloud
    draw.ellipse([70, 28, 140, 62], fill=(250, 250, 252))
    return image


def mug() -> Image.Image:
    """A yellow mug of coffee on a desk, portrait format (256 x 320)."""
    image = _vertical_gradient((256, 320), (70, 84, 102), (40, 48, 60))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 236, 256, 320], fill=(182, 150, 112))  # desk
    draw.rounded_rectangle([70, 140, 170, 260], radius=14, fill=(240, 196, 40))  # body
    draw.ellipse([70, 128, 170, 152], fill=(250, 214, 72))  # rim
    draw.ellipse([78, 132, 162, 148], fill=(92, 56, 30))  # coffee
    draw.arc([150, 164, 204, 226], 270, 90, fill=(240, 196, 40), width=12)  # handle
    for x in (100, 122, 144):  # steam
        draw.arc([x - 10, 80, x + 10, 110], 90, 270, fill=(200, 206, 214), width=3)
        draw.arc([x - 10, 56, x + 10, 86], 270, 90, fill=(200, 206, 214), width=3)
    return image


# file name -> (drawing function, instruction, target description). The instruction is what E1.1
# takes; for E1-Full the app combines both as "Editing Instruction: ... Target Image Description: ...".
EXAMPLES = {
    "cottage.png": (
        cottage,
        "Turn the scene into a snowy winter evening",
        "A cottage with a snow-covered roof and a snowy tree under a dark blue evening sky.",
    ),
    "apple.png": (
        apple,
        "Replace the red apple with a green pear",
        "A green pear on a wooden table against a plain cream wall.",
    ),
    "sailboat.png": (
        sailboat,
        "Add a rainbow over the sea",
        "A white sailboat on a calm blue sea with a rainbow arching across the sky.",
    ),
    "mug.png": (
        mug,
        "Make the mug blue with white polka dots",
        "A blue mug with white polka dots, full of steaming coffee, on a wooden desk.",
    ),
}


def main() -> None:
    listing = []
    for name, (draw_fn, instruction, target) in EXAMPLES.items():
        # optimize=True keeps them a few KB; no metadata chunks, so the bytes only depend on pixels.
        draw_fn().save(HERE / name, format="PNG", optimize=True)
        listing.append({"image": name, "instruction": instruction, "target": target})
    (HERE / "examples.json").write_text(json.dumps(listing, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(listing)} examples to {HERE}")


if __name__ == "__main__":
    main()
