"""Deterministic test images: coloured shapes, stripes, a smooth background, and blocky letters
drawn from a built-in 3x5 bitmap font (no font files, so the pixels do not depend on FreeType).

`draw_scene(width, height, variant)` always returns the same RGB image for the same arguments.
variant 0 is the image written to disk; other variants are used as "different image" probes.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

# 3x5 glyphs, rows top to bottom, '#' = ink.
FONT = {
    "A": [".#.", "#.#", "###", "#.#", "#.#"],
    "B": ["##.", "#.#", "##.", "#.#", "##."],
    "C": [".##", "#..", "#..", "#..", ".##"],
    "E": ["###", "#..", "##.", "#..", "###"],
    "I": ["###", ".#.", ".#.", ".#.", "###"],
    "N": ["#.#", "###", "###", "###", "#.#"],
    "O": [".#.", "#.#", "#.#", "#.#", ".#."],
    "P": ["##.", "#.#", "##.", "#..", "#.."],
    "Q": [".#.", "#.#", "#.#", ".#.", "..#"],
    "R": ["##.", "#.#", "##.", "#.#", "#.#"],
    "S": [".##", "#..", ".#.", "..#", "##."],
    "T": ["###", ".#.", ".#.", ".#.", ".#."],
    "V": ["#.#", "#.#", "#.#", "#.#", ".#."],
    "W": ["#.#", "#.#", "###", "###", "#.#"],
    "X": ["#.#", "#.#", ".#.", "#.#", "#.#"],
    "0": ["###", "#.#", "#.#", "#.#", "###"],
    "1": [".#.", "##.", ".#.", ".#.", "###"],
    "2": ["##.", "..#", ".#.", "#..", "###"],
    "3": ["##.", "..#", ".#.", "..#", "##."],
    "4": ["#.#", "#.#", "###", "..#", "..#"],
    "5": ["###", "#..", "##.", "..#", "##."],
    "7": ["###", "..#", ".#.", ".#.", ".#."],
    "9": ["###", "#.#", "###", "..#", "##."],
    " ": ["...", "...", "...", "...", "..."],
}

PALETTE = [
    (220, 30, 40),  # red
    (30, 80, 220),  # blue
    (30, 170, 60),  # green
    (245, 200, 20),  # yellow
    (240, 120, 20),  # orange
    (140, 40, 170),  # purple
    (20, 20, 20),  # black
    (0, 190, 200),  # cyan
    (230, 90, 170),  # pink
]


def draw_text(draw: ImageDraw.ImageDraw, x: int, y: int, text: str, scale: int, fill) -> None:
    for ch in text:
        glyph = FONT.get(ch.upper(), FONT[" "])
        for r, row in enumerate(glyph):
            for c, bit in enumerate(row):
                if bit == "#":
                    draw.rectangle(
                        [x + c * scale, y + r * scale, x + (c + 1) * scale - 1, y + (r + 1) * scale - 1], fill=fill
                    )
        x += 4 * scale


def draw_scene(width: int, height: int, variant: int = 0) -> Image.Image:
    """A busy but deterministic scene. Coordinates are fractions of the size so every size gets
    the same layout; `variant` changes background, colours, shape placement and text."""
    rng = np.random.default_rng(1234 + 7919 * variant + 31 * width + height)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = xx / max(width - 1, 1), yy / max(height - 1, 1)
    base = np.stack(
        [
            200 + 50 * np.cos(3.0 * u + variant),
            180 + 60 * np.sin(2.0 * v + 0.5 * variant),
            160 + 80 * u * v,
        ],
        axis=-1,
    )
    # Vertical stripes on the left third, horizontal on the bottom band.
    stripes = ((xx // max(width // 16, 1)) % 2 == 0) & (u < 0.33)
    base[stripes] *= 0.6
    band = ((yy // max(height // 12, 1)) % 2 == 1) & (v > 0.8)
    base[band] = base[band][:, ::-1]
    base += rng.normal(0.0, 6.0, size=base.shape)  # mild texture
    img = Image.fromarray(np.clip(base, 0, 255).round().astype(np.uint8), "RGB")

    d = ImageDraw.Draw(img)
    w, h = width, height
    order = [(i + 3 * variant) % len(PALETTE) for i in range(len(PALETTE))]
    col = [PALETTE[i] for i in order]
    jitter = 0.08 * (variant % 3)

    # Square (rectangle), circle, triangle, diamond.
    d.rectangle([int((0.05 + jitter) * w), int(0.08 * h), int((0.35 + jitter) * w), int(0.45 * h)], fill=col[0])
    d.ellipse([int(0.55 * w), int((0.10 + jitter) * h), int(0.92 * w), int((0.55 + jitter) * h)], fill=col[1])
    d.polygon(
        [(int(0.10 * w), int(0.92 * h)), (int(0.30 * w), int(0.55 * h)), (int(0.50 * w), int(0.92 * h))],
        fill=col[2],
    )
    cx, cy, r = int(0.72 * w), int(0.78 * h), max(int(0.12 * min(w, h)), 2)
    d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=col[3])
    # A diagonal line and a small outlined star-like cross.
    d.line([(0, 0), (w - 1, h - 1)], fill=col[6], width=max(1, min(w, h) // 40))
    d.rectangle([int(0.42 * w), int(0.40 * h), int(0.58 * w), int(0.48 * h)], fill=col[4])
    d.rectangle([int(0.47 * w), int(0.30 * h), int(0.53 * w), int(0.60 * h)], fill=col[4])

    # Blocky text: scale so it fits the width.
    text = ["STOP 42", "QWEN VL", "EXIT 7", "SALE 19"][variant % 4]
    scale = max(1, min(w // (4 * len(text) + 2), h // 14))
    draw_text(d, 2, h // 2 - 3 * scale, text, scale, fill=(255, 255, 255) if variant % 2 else (10, 10, 10))
    return img


def with_transparency(img: Image.Image) -> Image.Image:
    """An RGBA copy of `img` as design tools export one: a fully transparent margin whose colour
    channels are black, and semi-transparent blocks over the picture. Transformers' processors
    composite it onto white; dropping the alpha would show the black."""
    rgb = np.asarray(img.convert("RGB")).copy()
    h, w = rgb.shape[:2]
    y, x = np.mgrid[0:h, 0:w]
    alpha = np.full((h, w), 255, np.uint8)
    alpha[(x // 8 + y // 8) % 3 == 0] = 96
    alpha[(x < w // 6) | (y < h // 6)] = 0
    rgb[alpha == 0] = 0
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
