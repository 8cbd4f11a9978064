"""Golden-image checks: regenerate the images a manifest lists and compare them with the committed PNGs.

A manifest (``goldens.yaml``) names a pipeline recipe (relative to the manifest) and, per image, the PNG file,
its prompt, and the pipeline parameters that made it (every other key: ``seed: 0, steps: 4, width: 80``...,
each set as with ``--set``). The image is the pipeline's one output of type ``image`` (or the one the manifest
names with ``output:``). ``check`` fails an image whose PSNR against its golden is below the threshold (writing
``<name>.diff.png`` next to it: the amplified absolute difference) or that is (nearly) constant; ``update``
rewrites the goldens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PipelineError
from ..files import MAX_JSON_BYTES, name_problem, present, read_regular_text
from ..image_io import read_png, to_uint8, write_png
from ..recipe.located import Origin
from ..recipe.paths import confined
from ..recipe.safe_eval import shorten
from ..recipe.yaml_source import YamlSource, parse_yaml
from .driver import Pipeline

MIN_PSNR_DB = 45.0
MIN_STD = 2.0  # 8-bit levels: below this an image is treated as constant


@dataclass
class GoldenCase:
    file: Path
    prompt: str | None
    params: dict[str, Any] = field(default_factory=dict)  # pipeline parameters, set as with --set
    output: str | None = None  # the pipeline output that is the image (None: its one image output)


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


def read_manifest(path: Path) -> YamlSource:
    """A golden manifest parsed with positions (and the recipe loader's YAML limits), for located errors."""
    path = Path(path)
    try:
        text = read_regular_text(path, "a golden manifest", MAX_JSON_BYTES, PipelineError)
    except FileNotFoundError:
        raise PipelineError(f"{path}: golden manifest not found") from None
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read the golden manifest ({exc.strerror or exc})") from None
    return parse_yaml(text, path)


def golden_file(source: YamlSource, at: tuple, text: Any, suffixes: tuple[str, ...] = ("",)) -> Path:
    """The golden file ``text`` names at ``at`` in the manifest: relative to the manifest's folder and, links
    resolved, inside it (each of ``suffixes`` applied too: the ``.diff.png`` written beside a PNG); a located
    error otherwise. Golden files are read and written, so none may lead elsewhere."""
    origin = Origin(source, at)
    if not isinstance(text, str) or not text.strip():
        raise origin.error(f"a golden file is a path relative to the manifest's folder, got {text!r}")
    folder = source.file.parent
    path = confined(origin, folder, text, "the manifest's folder", [folder])
    for suffix in suffixes:
        written = confined(origin, folder, str(Path(text).with_suffix(suffix)), "the manifest's folder",
                           [folder]) if suffix else path
        problem = name_problem(written)  # before any image is made, not as the file is written
        if problem is not None:
            raise origin.error(f"the golden file {shorten(str(written), 120)}: {problem}")
    return path


def load_manifest(path: Path) -> tuple[Path, list[GoldenCase]]:
    """The pipeline recipe and the cases of an image manifest; every golden file (and its ``.diff.png``) lies
    inside the manifest's folder, checked here, before any image is made."""
    source = read_manifest(path)
    data = source.data
    try:
        recipe = (path.parent / data["recipe"]).resolve()
        output = data.get("output")
        cases = []
        for index, item in enumerate(data["images"]):
            params = {k: v for k, v in item.items() if k not in ("file", "prompt")}
            prompt = item.get("prompt")
            file = golden_file(source, ("images", index, "file"), item["file"], ("", ".diff.png"))
            cases.append(GoldenCase(file, None if prompt is None else str(prompt), params, output))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PipelineError(f"{path}: invalid golden manifest ({exc}); it needs `recipe:` and `images:` entries "
                            f"with a file, the prompt and the pipeline parameters (seed, steps...)") from None
    return recipe, cases


def _image_output(pipe: Pipeline, case: GoldenCase) -> str:
    images = [name for name, out in pipe.doc.outputs.items() if out.type == "image"]
    if case.output is not None:
        if case.output not in pipe.doc.outputs:
            raise PipelineError(f"golden manifest: output '{case.output}' is not an output of pipeline "
                                f"'{pipe.doc.name}' ({', '.join(pipe.doc.outputs) or 'none'})")
        return case.output
    if len(images) != 1:
        raise PipelineError(f"golden manifest: pipeline '{pipe.doc.name}' has {len(images)} outputs of type image; "
                            f"name the one to compare with `output:`")
    return images[0]


def render(recipe: Path, case: GoldenCase, weights: str | None = None) -> np.ndarray:
    pipe = Pipeline(recipe, weights=weights, sets=[f"{k}={v}" for k, v in case.params.items()])
    name = _image_output(pipe, case)
    values = pipe.run({"prompt": case.prompt} if case.prompt is not None else {}).values
    return to_uint8(pipe.output_value(name, values))


def compare(case: GoldenCase, pixels: np.ndarray, min_psnr: float = MIN_PSNR_DB) -> GoldenResult:
    """Compare regenerated ``pixels`` with the case's golden PNG by PSNR, never byte for byte: two programs the
    search may pick for one graph can round an 8-bit pixel differently (see docs/determinism.md)."""
    diff_path = case.file.with_suffix(".diff.png")
    if is_near_constant(pixels):
        return GoldenResult(case, None, False, "the regenerated image is (nearly) constant")
    if not present(case.file):
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
    rendered = []  # every image made and checked before any golden is replaced: a bad case changes nothing
    for case in cases:
        pixels = render(recipe, case, weights)
        if is_near_constant(pixels):
            raise PipelineError(f"{case.file}: the regenerated image is (nearly) constant; not writing a golden")
        rendered.append((case, pixels))
    written = []
    for case, pixels in rendered:
        text = {"prompt": case.prompt} if case.prompt is not None else {}
        written.append(write_png(case.file, pixels, text | {k: str(v) for k, v in case.params.items()}))
    return written
