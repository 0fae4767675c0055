"""Regenerates the Pillow and torchvision reference images `pil_exactness.rs` checks against.

Run with the project venv (Pillow 13, transformers 5.24, torchvision 0.28): `.venv/bin/python generate.py`.
"""

from pathlib import Path

import numpy as np
from PIL import Image
from transformers.image_utils import load_image

HERE = Path(__file__).parent
# Target sizes covering each pass order Pillow picks: both axes down (horizontal first), rows
# down while columns grow (vertical first), one axis only, both up.
RESIZES = [(56, 28), (140, 28), (28, 84), (73, 20), (30, 41), (97, 60), (112, 39)]


def source(width: int, height: int, seed: int) -> np.ndarray:
    rng = np.random.RandomState(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] + 0.7 * np.linspace(0, 255, height)[:, None, None]
    return ((ramp + rng.randint(0, 60, (height, width, 3))) % 256).astype(np.uint8)


def main() -> None:
    src = Image.fromarray(source(73, 41, seed=0))
    src.save(HERE / "src.png")
    for width, height in RESIZES:
        src.resize((width, height), Image.BICUBIC).save(HERE / f"src_to_{width}x{height}.png")

    # A progressive 4:2:0 JPEG stored sideways (EXIF orientation 6), and what HF's load_image
    # (PIL decode + exif_transpose + convert RGB) makes of it.
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = HERE / "photo.jpg"
    Image.fromarray(source(53, 37, seed=1)).save(photo, quality=85, subsampling=2, progressive=True, exif=exif)
    load_image(str(photo)).save(HERE / "photo.pil.png")


ALPHA_BACKGROUND = (18, 140, 77)


def alpha_images() -> None:
    """Transparent images of each kind PNG and WebP carry, and what becomes of them: transformers'
    `convert_to_rgb` (composited onto white), Pillow's `alpha_composite` onto another colour, and
    `load_image`'s `convert("RGB")` (alpha dropped)."""
    from transformers.image_transforms import convert_to_rgb

    rng = np.random.RandomState(2)
    rgb = source(29, 19, seed=3)
    alpha = rng.randint(0, 256, (19, 29)).astype(np.uint8)
    alpha[0], alpha[1] = 0, 255
    rgba = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    images = {
        "alpha_rgba.png": rgba,
        "alpha_la.png": rgba.convert("LA"),
        "alpha_rgba.webp": rgba,
    }
    palette = Image.fromarray(rgb).quantize(16)
    palette.info["transparency"] = 3
    images["alpha_p_trns.png"] = palette
    keyed = Image.fromarray(rgb)
    keyed.info["transparency"] = tuple(int(v) for v in rgb[5, 7])
    images["alpha_rgb_trns.png"] = keyed
    for name, image in images.items():
        path = HERE / name
        if name.endswith(".webp"):
            image.save(path, lossless=True, exact=True)
        elif "transparency" in image.info:
            image.save(path, transparency=image.info["transparency"])
        else:
            image.save(path)
        write_expectations(name, convert_to_rgb)
    # 16 bits per channel (Pillow cannot write these): random low bytes, which Pillow drops.
    wide = np.random.RandomState(4)
    write_png16(HERE / "alpha_rgba16.png", wide.randint(0, 65536, (19, 29, 4)).astype(np.uint16), color_type=6)
    write_png16(HERE / "alpha_la16.png", wide.randint(0, 65536, (19, 29, 2)).astype(np.uint16), color_type=4)
    for name in ["alpha_rgba16.png", "alpha_la16.png"]:
        write_expectations(name, convert_to_rgb)


def write_expectations(name: str, convert_to_rgb) -> None:
    path = HERE / name
    opened = Image.open(path)
    stem = name.replace(".", "_")
    convert_to_rgb(opened).save(HERE / f"{stem}.white.png")
    background = Image.new("RGBA", opened.size, ALPHA_BACKGROUND + (255,))
    Image.alpha_composite(background, opened.convert("RGBA")).convert("RGB").save(HERE / f"{stem}.green.png")
    Image.open(path).convert("RGB").save(HERE / f"{stem}.drop.png")


def write_png16(path: Path, array: np.ndarray, color_type: int) -> None:
    """A 16-bit PNG (color type 6 = RGBA, 4 = grey + alpha), written chunk by chunk."""
    import struct
    import zlib

    height, width = array.shape[:2]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    path.write_bytes(png)


# Extra sizes for torchvision: a strong downscale, a 4x upscale, a single row.
TORCHVISION_RESIZES = RESIZES + [(9, 5), (292, 164), (73, 1)]


def torchvision_resizes() -> None:
    """What torchvision's `resize(BICUBIC, antialias=True)` makes of src.png as a uint8 CHW tensor:
    the resize of transformers' torchvision image processor (torch's native uint8 kernel on CPU)."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    src = torch.from_numpy(np.array(Image.open(HERE / "src.png").convert("RGB"))).permute(2, 0, 1)
    for width, height in TORCHVISION_RESIZES:
        out = F.resize(src, [height, width], interpolation=InterpolationMode.BICUBIC, antialias=True)
        assert out.dtype == torch.uint8
        Image.fromarray(out.permute(1, 2, 0).numpy()).save(HERE / f"src_tv_to_{width}x{height}.png")


if __name__ == "__main__":
    main()
    alpha_images()
    torchvision_resizes()
