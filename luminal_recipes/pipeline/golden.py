"""Golden-image checks: regenerate the images a manifest lists and compare them with the committed PNGs.

A manifest (``goldens.yaml``) names a pipeline recipe (relative to the manifest) and, per image, the PNG file
and the settings that made it. ``check`` fails an image whose PSNR against its golden is below the threshold
(writing ``<name>.diff.png`` next to it: the amplified absolute difference) or that is (nearly) constant;
``update`` rewrites the goldens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ..errors import PipelineError
from ..files import MAX_JSON_BYTES, read_regular_text
from .driver import Pipeline
from .image_io import read_png, to_uint8, write_png
from .latents import initial_noise

MIN_PSNR_DB = 45.0
MIN_STD = 2.0  # 8-bit levels: below this an image is treated as constant


@dataclass
class GoldenCase:
    file: Path
    prompt: str
    seed: int
    steps: int
    width: int
    height: int
    guidance: float = 4.0


@dataclass
class GoldenResult:
    case: GoldenCase
    psnr: float | None
    ok: bool
    message: str


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


def is_near_constant(pixels: np.ndarray) -> bool:
    return float(pixels.astype(np.float64).std()) < MIN_STD


def load_manifest(path: Path) -> tuple[Path, list[GoldenCase]]:
    try:
        data = yaml.safe_load(read_regular_text(path, "a golden manifest", MAX_JSON_BYTES, PipelineError))
        recipe = (path.parent / data["recipe"]).resolve()
        cases = [GoldenCase(path.parent / item["file"], str(item["prompt"]), int(item["seed"]),
                            int(item["steps"]), int(item["width"]), int(item["height"]),
                            float(item.get("guidance", 4.0))) for item in data["images"]]
    except FileNotFoundError:
        raise PipelineError(f"{path}: golden manifest not found") from None
    except (yaml.YAMLError, KeyError, TypeError, ValueError, OSError) as exc:
        raise PipelineError(f"{path}: invalid golden manifest ({exc}); it needs `recipe:` and `images:` entries "
                            f"with file, prompt, seed, steps, width, height") from None
    return recipe, cases


def render(recipe: Path, case: GoldenCase, weights: str | None = None) -> np.ndarray:
    sets = [f"seed={case.seed}", f"steps={case.steps}", f"width={case.width}", f"height={case.height}",
            f"guidance={case.guidance}"]
    pipe = Pipeline(recipe, weights=weights, sets=sets)
    latents = initial_noise(case.seed, case.height, case.width)
    return to_uint8(pipe.run({"prompt": case.prompt, "init_latents": latents}).values["image"])


def compare(case: GoldenCase, pixels: np.ndarray, min_psnr: float = MIN_PSNR_DB) -> GoldenResult:
    """Compare regenerated ``pixels`` with the case's golden PNG by PSNR, never byte for byte: two programs the
    search may pick for one graph can round an 8-bit pixel differently (see README, determinism)."""
    diff_path = case.file.with_suffix(".diff.png")
    if is_near_constant(pixels):
        return GoldenResult(case, None, False, "the regenerated image is (nearly) constant")
    if not case.file.exists():
        return GoldenResult(case, None, False, "golden missing; run `luminal-recipe golden update`")
    golden, _ = read_png(case.file)
    if golden.shape != pixels.shape:
        return GoldenResult(case, None, False, f"size {pixels.shape} differs from the golden's {golden.shape}")
    value = psnr(pixels, golden)
    ok = value >= min_psnr
    if not ok:
        diff = np.abs(pixels.astype(np.int16) - golden.astype(np.int16))
        write_png(diff_path, np.clip(diff * 8, 0, 255).astype(np.uint8))
    elif diff_path.exists():
        diff_path.unlink()
    return GoldenResult(case, value, ok, f"PSNR {value:.1f} dB" + ("" if ok else
                                                                   f" < {min_psnr} dB; diff: {diff_path}"))


def check(manifest: Path, min_psnr: float = MIN_PSNR_DB, weights: str | None = None) -> list[GoldenResult]:
    recipe, cases = load_manifest(manifest)
    return [compare(case, render(recipe, case, weights), min_psnr) for case in cases]


def update(manifest: Path, weights: str | None = None) -> list[Path]:
    recipe, cases = load_manifest(manifest)
    written = []
    for case in cases:
        pixels = render(recipe, case, weights)
        if is_near_constant(pixels):
            raise PipelineError(f"{case.file}: the regenerated image is (nearly) constant; not writing a golden")
        written.append(write_png(case.file, pixels, {"prompt": case.prompt, "seed": str(case.seed)}))
    return written
