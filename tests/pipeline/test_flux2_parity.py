"""FLUX.2 parity with diffusers, stage by stage and end to end, on tiny configurations.

The references are diffusers' own ``Flux2Pipeline`` and models loaded from the same checkpoint folders (saved by
diffusers/transformers from seeded random initialisation, recipes/flux2-tiny/make_checkpoint.py). Errors are
relative to the reference's largest magnitude (see tests/TOLERANCES.md).

Besides the shipped checkpoint (a) and its variant (b), three checkpoints are built differently, in the test: with
the chat template transformers' ``convert_tekken_tokenizer`` gives Tekken by itself (system prompt inside
``[INST]``), with a custom template (namespace, loop controls, ``tojson``, ``{% generation %}``), tapping the last
hidden state (after the final norm) and negative indices, a sliding window, non-default RoPE theta / axes /
timestep-guidance channels / MLP ratio, no quant or post-quant conv or mid attention, and an untied last hidden
state. Every VAE has random BatchNorm running statistics. These must also agree within 1e-4 in absolute terms.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline

from luminal_recipes.image_io import to_uint8
from luminal_recipes.pipeline.driver import Pipeline
from luminal_recipes.pipeline.engine import ModelEngine
from luminal_recipes.tasks.flux2.latents import initial_noise, latent_ids, text_ids

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "flux2-tiny.yaml"
CHECKPOINT_A = ROOT / "recipes" / "flux2-tiny" / "checkpoint"


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint", CHECKPOINT_A.parent / "make_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# A chat template nothing else uses: a namespace, a filtered loop with `break`, tojson (not HTML-escaped: '<&>'),
# trim_blocks/lstrip_blocks whitespace, the `generation` tag, raise_exception and special-token variables.
CUSTOM_TEMPLATE = """{%- set ns = namespace(system='') -%}
{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'][0]['text'] -%}{%- endif -%}
{%- endfor -%}
{{ bos_token }}[AVAILABLE_TOOLS]{{ {'system': ns.system, 'note': '<&>'} | tojson }}[/AVAILABLE_TOOLS]
{% for m in messages if m['role'] != 'system' %}
  {% if loop.index > 1 %}{% break %}{% endif %}
  [INST]{{ m['content'] | map(attribute='text') | join(' ') | trim }}{% generation %}[/INST]{% endgeneration %}
{% endfor %}
{%- if add_generation_prompt %}{{ raise_exception('no generation prompt here') }}{% endif -%}
"""
# Tiny sizes for the checkpoints built here: 4 text layers, 1 + 1 transformer blocks, a 4-block VAE.
SMALL = dict(
    text_hidden=16, text_layers=4, text_heads=2, text_kv_heads=1, text_head_dim=8, text_intermediate=32,
    num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 4, 4, 4),
    mlp_ratio=3.0, vae_block_out_channels=(8, 8, 16, 16), vae_decoder_block_out_channels=None,
    vae_layers_per_block=1, vae_norm_num_groups=4,
)
BUILT_HERE = {
    # transformers' own conversion of Tekken, with its default template; taps include the last layer (normed)
    "tekken-default": dict(SMALL, seed=11, chat_template="tekken-default", text_encoder_out_layers=(1, 3, 4)),
    # a custom template; negative taps (-1 = after the final norm, -5 = embeddings); RoPE theta 1e4; window 8
    "custom-template": dict(SMALL, seed=12, chat_template=CUSTOM_TEMPLATE, text_encoder_out_layers=(-1, -3, -5),
                            text_rope_theta=1.0e4, text_sliding_window=8),
    # transformer and VAE settings off FLUX.2-dev's values; an untied last hidden state (raw output of layer 4)
    "transformer-knobs": dict(SMALL, seed=13, text_tie_last_hidden_states=False, text_encoder_out_layers=(4, 2, 0),
                              rope_theta=500, axes_dims_rope=(2, 6, 4, 4), timestep_guidance_channels=64,
                              mlp_ratio=2.5, vae_use_quant_conv=False, vae_use_post_quant_conv=False,
                              vae_mid_block_add_attention=False,
                              vae_layers_per_block=2),
}

# checkpoint -> (text_encoder_out_layers, seed, width, height, steps, absolute tolerance as well)
CONFIGS = {
    "a": ((10, 20, 30), 0, 80, 48, 3, False),
    "b": ((2, 5, 8), 3, 48, 64, 3, False),
    **{name: (spec["text_encoder_out_layers"], 5, 48, 32, 2, True) for name, spec in BUILT_HERE.items()},
}


def checkpoint(name: str, make_checkpoint, tmp_path_factory) -> Path:
    if name == "a":
        return CHECKPOINT_A
    variant = make_checkpoint.VARIANTS["b"] if name == "b" else make_checkpoint.Variant(**BUILT_HERE[name])
    return make_checkpoint.build(tmp_path_factory.mktemp("flux2") / name, variant, tokenizer_from=CHECKPOINT_A)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, make_checkpoint, tmp_path_factory):
    layers, seed, width, height, steps, absolute = CONFIGS[request.param]
    folder = checkpoint(request.param, make_checkpoint, tmp_path_factory)
    sets = [f"text_encoder_out_layers=[{','.join(map(str, layers))}]", f"seed={seed}", f"width={width}",
            f"height={height}", f"steps={steps}", "max_sequence_length=64"]
    ours = Pipeline(RECIPE, weights=folder, sets=sets)
    ref = Flux2Pipeline.from_pretrained(folder)
    return Case(request.param, ours, ref, layers, seed, width, height, steps, absolute)


@dataclass
class Case:
    name: str
    ours: Pipeline
    ref: Flux2Pipeline
    layers: tuple[int, ...]
    seed: int
    width: int
    height: int
    steps: int
    absolute: bool  # also within 1e-4 in absolute terms

    def check(self, got: np.ndarray, want: np.ndarray) -> None:
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-4
        if self.absolute:
            assert float(np.abs(got - want).max()) <= 1e-4


def test_text_features_match_encode_prompt(case):
    prompt = "a lighthouse on a cliff at dusk, oil painting"
    from luminal_recipes.tasks.flux2.steps import tokenizer

    tok = tokenizer(case.ours.context)(prompt, 64)
    engine = ModelEngine(case.ours.model("text_encoder"))
    got = engine({"tokens": tok.input_ids, "attention_mask": tok.attention_mask})["prompt_embeds"]
    with torch.no_grad():
        want, _ = case.ref.encode_prompt(prompt, max_sequence_length=64, text_encoder_out_layers=case.layers)
    case.check(got, want.numpy())


def test_transformer_velocity_matches_diffusers(case):
    ours, ref = case.ours, case.ref
    cfg = ref.transformer.config
    rng = np.random.default_rng(1)
    h, w, t = 3, 4, 9
    x = rng.standard_normal((1, h * w, cfg.in_channels)).astype(np.float32)
    c = rng.standard_normal((1, t, cfg.joint_attention_dim)).astype(np.float32)
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    from luminal_recipes.tasks.flux2.steps import rope_tables

    rope = rope_tables(None, ids, list(cfg.axes_dims_rope), cfg.rope_theta)
    timestep, guidance = np.float32([0.73]), np.float32([4.0])
    engine = ModelEngine(ours.model("transformer"))
    got = engine({"hidden_states": x, "encoder_hidden_states": c, "timestep": timestep, "guidance": guidance,
                  "rope_cos": rope["cos"], "rope_sin": rope["sin"]})["velocity"]
    with torch.no_grad():
        want = ref.transformer(hidden_states=torch.tensor(x), encoder_hidden_states=torch.tensor(c),
                               timestep=torch.tensor(timestep), guidance=torch.tensor(guidance),
                               img_ids=torch.tensor(latent_ids(h, w)).float(),
                               txt_ids=torch.tensor(text_ids(t)).float(), return_dict=False)[0]
    case.check(got, want.numpy())


def test_vae_decode_matches_diffusers(case):
    ours, ref = case.ours, case.ref
    rng = np.random.default_rng(2)
    latents = rng.standard_normal((1, 128, 3, 5)).astype(np.float32)
    engine = ModelEngine(ours.model("vae"))
    got = engine({"latents": latents})["image"]
    vae = ref.vae
    with torch.no_grad():
        lat = torch.tensor(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        want = vae.decode(Flux2Pipeline._unpatchify_latents(lat * std + mean), return_dict=False)[0]
    case.check(got, want.numpy())


def test_vae_encode_matches_diffusers(case):
    """The VAE encoder recipe against Flux2Pipeline._encode_vae_image: the posterior's mode, patchified and
    batch-normalised, for an image of 48x80 pixels (a 3x5 latent grid)."""
    rng = np.random.default_rng(3)
    image = rng.uniform(-1.0, 1.0, (1, 3, 48, 80)).astype(np.float32)
    # the compiled program once (the shipped checkpoint); the other configurations' recipe with the naive one
    got = ModelEngine(case.ours.model("vae_encoder"), compile=case.name == "a")({"image": image})["latents"]
    with torch.no_grad():
        want = case.ref._encode_vae_image(torch.tensor(image), generator=None)
    case.check(got, want.numpy())


def test_whole_pipeline_image_matches_diffusers(case):
    prompt = "a red fox in the snow"
    latents = initial_noise(case.seed, case.height, case.width)
    image = case.ours.run({"prompt": prompt, "init_latents": latents}).values["image"]
    got = to_uint8(image)
    assert got.std() > 5, "the image is (nearly) constant"
    want = case.ref(prompt=prompt, height=case.height, width=case.width, num_inference_steps=case.steps,
                    guidance_scale=4.0, latents=torch.tensor(latents), max_sequence_length=64,
                    text_encoder_out_layers=case.layers, output_type="np").images[0]
    want = (want * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (case.height, case.width, 3)
    assert psnr(got, want) >= 40.0
