"""Latent plumbing against diffusers' Flux2Pipeline: its static helpers and a real (tiny) pipeline run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from safetensors.torch import save_file

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.tasks.flux2 import latents as L

CHECKPOINT = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny" / "checkpoint"


@pytest.mark.parametrize("shape", [(1, 128, 3, 5), (2, 8, 1, 7), (1, 4, 6, 1)])
def test_pack_unpack_and_ids_match_diffusers(shape):
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    b, c, h, w = shape
    packed = Flux2Pipeline._pack_latents(torch.from_numpy(x))
    np.testing.assert_array_equal(L.pack_latents(x), packed.numpy())
    ids = Flux2Pipeline._prepare_latent_ids(torch.from_numpy(x))
    np.testing.assert_array_equal(L.latent_ids(h, w), ids[0].numpy())
    unpacked = Flux2Pipeline._unpack_latents_with_ids(packed, ids)
    np.testing.assert_array_equal(L.unpack_latents(L.pack_latents(x), h, w), unpacked.numpy())
    np.testing.assert_array_equal(L.unpack_latents(L.pack_latents(x), h, w), x)


@pytest.mark.parametrize("seq_len", [1, 7, 512])
def test_text_ids_match_diffusers(seq_len):
    np.testing.assert_array_equal(
        L.text_ids(seq_len), Flux2Pipeline._prepare_text_ids(torch.zeros(1, seq_len, 3))[0]
    )


def test_unpatchify_matches_diffusers_and_inverts_patchify():
    x = np.random.default_rng(2).standard_normal((1, 32, 6, 10), dtype=np.float32)
    patched = Flux2Pipeline._patchify_latents(torch.from_numpy(x))
    ours = L.unpatchify_latents(patched.numpy())
    np.testing.assert_array_equal(ours, Flux2Pipeline._unpatchify_latents(patched).numpy())
    np.testing.assert_array_equal(ours, x)


def test_decode_input_of_the_real_pipeline():
    """Drive Flux2Pipeline (tiny checkpoint, given latents); check what its transformer and VAE receive."""
    pipe = Flux2Pipeline.from_pretrained(CHECKPOINT, text_encoder=None, tokenizer=None)
    height, width = 48, 80
    h, w = L.latent_grid(height, width)
    init = L.initial_noise(5, height, width)
    seen = {}

    transformer_forward = pipe.transformer.forward

    def spy_transformer(*args, **kwargs):
        seen.setdefault("hidden_states", kwargs["hidden_states"].numpy().copy())
        seen.setdefault("img_ids", kwargs["img_ids"].numpy().copy())
        seen.setdefault("txt_ids", kwargs["txt_ids"].numpy().copy())
        return transformer_forward(*args, **kwargs)

    def record_latents(pipeline, step, timestep, kwargs):
        seen["final_tokens"] = kwargs["latents"].numpy().copy()
        return {}

    vae_decode = pipe.vae.decode

    def spy_decode(z, *args, **kwargs):
        seen["vae_input"] = z.numpy().copy()
        return vae_decode(z, *args, **kwargs)

    pipe.transformer.forward = spy_transformer
    pipe.vae.decode = spy_decode
    joint = pipe.transformer.config.joint_attention_dim
    pipe(
        prompt_embeds=torch.randn(1, 9, joint, generator=torch.Generator().manual_seed(0)),
        height=height,
        width=width,
        num_inference_steps=2,
        latents=torch.from_numpy(init),
        output_type="np",
        callback_on_step_end=record_latents,
    )

    np.testing.assert_array_equal(L.pack_latents(init), seen["hidden_states"])
    np.testing.assert_array_equal(L.latent_ids(h, w), seen["img_ids"][0])
    np.testing.assert_array_equal(L.text_ids(9), seen["txt_ids"][0])
    mean, var, eps = L.load_vae_batch_norm(CHECKPOINT / "vae")
    assert not np.allclose(mean, 0) and not np.allclose(
        var, 1
    )  # the checkpoint exercises the de-normalisation
    ours = L.tokens_to_vae_latents(seen["final_tokens"], h, w, mean, var, eps)
    assert ours.shape == (1, 32, height // 8, width // 8)
    # Not bit-identical: torch's float32 sqrt is off by one ulp for some inputs, numpy's is correctly rounded.
    np.testing.assert_allclose(ours, seen["vae_input"], rtol=1e-5, atol=1e-6)


def test_load_vae_batch_norm_reads_bf16(tmp_path):
    mean, var = torch.randn(128).bfloat16(), (torch.rand(128) + 0.5).bfloat16()
    save_file(
        {"bn.running_mean": mean, "bn.running_var": var, "other": torch.zeros(2)},
        str(tmp_path / "diffusion_pytorch_model.safetensors"),
    )
    (tmp_path / "config.json").write_text(json.dumps({"batch_norm_eps": 0.001}))
    got_mean, got_var, eps = L.load_vae_batch_norm(tmp_path)
    np.testing.assert_array_equal(got_mean, mean.float().numpy())
    np.testing.assert_array_equal(got_var, var.float().numpy())
    assert eps == 0.001 and got_mean.dtype == np.float32


def test_load_vae_batch_norm_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        L.load_vae_batch_norm(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    save_file(
        {"decoder.conv_in.weight": torch.zeros(2)}, str(tmp_path / "diffusion_pytorch_model.safetensors")
    )
    with pytest.raises(CheckpointError, match="bn.running_mean, bn.running_var"):
        L.load_vae_batch_norm(tmp_path)


def test_initial_noise_is_seeded_standard_normal():
    a = L.initial_noise(42, 256, 512)
    assert a.shape == (1, 128, 16, 32) and a.dtype == np.float32
    np.testing.assert_array_equal(a, L.initial_noise(42, 256, 512))
    assert not np.array_equal(a, L.initial_noise(43, 256, 512))
    assert abs(a.mean()) < 0.03 and abs(a.std() - 1) < 0.03


@pytest.mark.parametrize(("height", "width"), [(50, 80), (48, 0), (8, 16), (48.0, 80), (-16, 16)])
def test_bad_sizes(height, width):
    with pytest.raises(PipelineError, match="--height|--width"):
        L.latent_grid(height, width)


def test_non_multiple_of_16_suggests_sizes():
    with pytest.raises(
        PipelineError, match=r"--width 1000 is not a positive multiple of 16.*--width 992 or 1008"
    ):
        L.latent_grid(1024, 1000)


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True])
def test_bad_seeds(seed):
    with pytest.raises(PipelineError, match="--seed"):
        L.initial_noise(seed, 32, 32)


def test_init_latents_file(tmp_path):
    good = np.random.default_rng(0).standard_normal((1, 128, 3, 5)).astype(np.float16)
    np.save(tmp_path / "good.npy", good)
    loaded = L.load_init_latents(tmp_path / "good.npy", 48, 80)
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, good.astype(np.float32))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (np.zeros((1, 128, 5, 3), np.float32), r"shape \(1, 128, 5, 3\).*needs \(1, 128, 3, 5\)"),
        (np.zeros((128, 3, 5), np.float32), r"needs \(1, 128, 3, 5\)"),
        (np.zeros((1, 32, 6, 10), np.float32), "128 channels"),
        (np.zeros((1, 128, 3, 5), np.int32), "dtype int32"),
        (np.full((1, 128, 3, 5), np.nan, np.float32), "NaN"),
    ],
)
def test_bad_init_latents(tmp_path, content, message):
    np.save(tmp_path / "bad.npy", content)
    with pytest.raises(PipelineError, match=message) as info:
        L.load_init_latents(tmp_path / "bad.npy", 48, 80)
    assert "--init-latents" in str(info.value) and "bad.npy" in str(info.value)


def test_unreadable_init_latents(tmp_path):
    with pytest.raises(PipelineError, match="file not found"):
        L.load_init_latents(tmp_path / "missing.npy", 48, 80)
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(PipelineError, match="not a readable .npy array"):
        L.load_init_latents(tmp_path / "junk.npy", 48, 80)
    np.savez(tmp_path / "arch.npz", a=np.zeros((1, 128, 3, 5), np.float32))
    with pytest.raises(PipelineError, match="npz"):
        L.load_init_latents(tmp_path / "arch.npz", 48, 80)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PipelineError, match="not a readable .npy array"):
        L.load_init_latents(tmp_path / "obj.npy", 48, 80)
