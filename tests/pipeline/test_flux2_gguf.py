"""FLUX.2 with its transformer from a GGUF file in city96's ComfyUI-GGUF layout (recipes/flux2-gguf.yaml).

The file (tests/fixtures/gguf/tiny-flux2-q3_k_m.gguf, made by make_flux2_gguf.py beside it) is a random tiny
diffusers ``Flux2Transformer2DModel`` in Black Forest Labs' names, typed as ComfyUI-GGUF's converter and patched
llama-quantize leave a Q3_K_M file: Q3_K and Q4_K blocks written by llama.cpp's own quantizer, BF16 for what the
quantizer keeps, F32 norms. The reference is diffusers' own GGUF path,
``Flux2Transformer2DModel.from_single_file(path, quantization_config=GGUFQuantizationConfig(compute_dtype=f32))``:

* the transformer's velocity (every quantized weight kept packed, QKV split as rows of blocks) within 1e-4 of
  diffusers' (relative to the largest magnitude, tests/TOLERANCES.md), with the compiled program;
* the whole tiny pipeline (text encoder and VAE of recipes/flux2-tiny) against ``Flux2Pipeline`` holding that
  transformer: PSNR >= 40 dB;
* ``inspect`` plans FLUX.2-dev with a Q4_K transformer under 24 GiB from shapes alone, the transformer's weights
  exactly the Q4_K/BF16 bytes of FLUX.2-dev's matrices;
* bad input (another architecture, FLUX.1, a wrong shape, unknown and unimplemented types, no config.json): one
  located message, exit 2, before any model is planned or a weight read.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from cli_checks import cli, forbid_work, refused  # noqa: E402
from diffusers import Flux2Pipeline, Flux2Transformer2DModel, GGUFQuantizationConfig  # noqa: E402

from luminal_recipes.image_io import to_uint8  # noqa: E402
from luminal_recipes.pipeline.driver import Pipeline  # noqa: E402
from luminal_recipes.pipeline.engine import ModelEngine  # noqa: E402
from luminal_recipes.tasks.flux2.latents import initial_noise, latent_ids, text_ids  # noqa: E402
from luminal_recipes.tasks.flux2.steps import rope_tables  # noqa: E402
from luminal_recipes.weights.gguf_io import GgufCheckpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
RECIPE = RECIPES / "flux2-gguf.yaml"
TINY = RECIPES / "flux2-tiny" / "checkpoint"
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
GGUF = FIXTURES / "tiny-flux2-q3_k_m.gguf"
SETS = ["steps=3", "width=80", "height=48", "seed=0", "max_sequence_length=64"]
PROMPT = "a red fox in the snow"

sys.path.insert(0, str(FIXTURES))
import make_flux2_gguf as maker  # noqa: E402

sys.path.remove(str(FIXTURES))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def checkpoint_folder(root: Path, gguf_file: Path = GGUF, config: dict | None = None) -> Path:
    """A FLUX.2 pipeline folder: the tiny checkpoint's text encoder, VAE, tokenizer and scheduler, and a
    transformer/ holding the GGUF file and the config.json of the model in it."""
    root.mkdir(parents=True)
    for item in TINY.iterdir():
        if item.name != "transformer":
            (root / item.name).symlink_to(item)
    (root / "transformer").mkdir()
    shutil.copy(gguf_file, root / "transformer" / gguf_file.name)
    if config is not False:
        text = json.dumps({"_class_name": "Flux2Transformer2DModel", **(config or maker.CONFIG)})
        (root / "transformer" / "config.json").write_text(text)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return checkpoint_folder(tmp_path_factory.mktemp("flux2-gguf") / "ckpt")


@pytest.fixture(scope="module")
def reference(folder) -> Flux2Transformer2DModel:
    """diffusers' GGUF transformer over the same file (its own BFL -> diffusers conversion, GGUF dequantization)."""
    transformer = folder / "transformer"
    return Flux2Transformer2DModel.from_single_file(
        str(transformer / GGUF.name), config=str(transformer), torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))


def test_fixture_is_city96_layout_with_k_quants(tmp_path):
    """The committed file is what ComfyUI-GGUF's tools leave: arch flux, BFL names, K-quant blocks."""
    checkpoint = GgufCheckpoint.open(checkpoint_folder(tmp_path / "c") / "transformer" / GGUF.name)
    types = {r.gguf_name: r.type_name for r in checkpoint.records.values()}
    assert checkpoint.architecture == "flux"
    assert types["double_blocks.0.img_attn.qkv.weight"] == "Q4_K"
    assert types["single_blocks.0.linear1.weight"] == "Q3_K"
    assert types["img_in.weight"] == "BF16" and types["single_blocks.0.norm.query_norm.scale"] == "F32"


def test_quantized_weights_stay_packed(folder):
    """Every Q3_K/Q4_K tensor is a u8 graph weight of its stored blocks, the packed QKV's thirds included."""
    model = Pipeline(RECIPE, weights=folder, sets=SETS).model("transformer")
    checkpoint = GgufCheckpoint.open(folder / "transformer" / GGUF.name)
    for name, binding in model.weights.items():
        source = checkpoint.records[binding.sources[0]] if binding.sources else None
        if source is not None and source.quantized:
            assert str(binding.dtype) == "u8", name
    q = model.weights["transformer_blocks.0.attn.to_q.weight"]
    assert str(q.dtype) == "u8" and q.shape == (256, 144)  # a third of the Q4_K QKV's rows
    qkv = checkpoint.packed("double_blocks.0.img_attn.qkv.weight")
    v = model.weights["transformer_blocks.0.attn.to_v.weight"].load()
    assert np.shares_memory(v, np.asarray(qkv.raw))  # a view of the map, not a copy
    assert np.array_equal(v, np.asarray(qkv.raw).reshape(768, 144)[512:])
    qtypes = {n.attr("qtype") for n in model.graph.nodes if n.op == "Dequant"}
    assert {"Q3_K", "Q4_K", "BF16"} <= qtypes


def velocity_inputs(cfg) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    h, w, t = 3, 4, 9
    ids = np.concatenate([text_ids(t), latent_ids(h, w)]).astype(np.float64)
    rope = rope_tables(None, ids, list(cfg["axes_dims_rope"]), cfg["rope_theta"])
    return {"hidden_states": rng.standard_normal((1, h * w, cfg["in_channels"])).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((1, t, cfg["joint_attention_dim"])).astype(np.float32),
            "timestep": np.float32([0.73]), "guidance": np.float32([4.0]),
            "rope_cos": rope["cos"], "rope_sin": rope["sin"]}


def test_velocity_matches_diffusers_gguf(folder, reference):
    x = velocity_inputs(maker.CONFIG)
    model = Pipeline(RECIPE, weights=folder, sets=SETS).model("transformer")
    engine = ModelEngine(model)
    got = engine(x)["velocity"]
    # the cost model's program decodes every matrix inside its product (the QKV thirds, Q3_K, Q4_K and BF16
    # alike); timing the candidates, as the engine's search does, may pick decode + MatMul for a tiny matrix on a
    # loaded machine, so the packed choice is checked as the cost model ranks the rules' candidates
    from luminal_recipes.compiler import SearchOptions, compile_graph
    from luminal_recipes.runtimes.registry import get_runtime

    dims = dict(engine.stats.plan.dims)
    ranked = compile_graph(model.graph, get_runtime("numpy"), dims,
                           options=SearchOptions(time_top=0, use_cache=False)).program
    kernels = [node.op for node in ranked.nodes]
    matrices = [n for n, b in model.weights.items() if len(b.shape) == 2]
    assert kernels.count("DequantMatMulGGUF") == len(matrices) == 25 and "Dequant" not in kernels
    h, w, t = 3, 4, 9
    with torch.no_grad():
        want = reference(hidden_states=torch.tensor(x["hidden_states"]),
                         encoder_hidden_states=torch.tensor(x["encoder_hidden_states"]),
                         timestep=torch.tensor(x["timestep"]), guidance=torch.tensor(x["guidance"]),
                         img_ids=torch.tensor(latent_ids(h, w)).float(), txt_ids=torch.tensor(text_ids(t)).float(),
                         return_dict=False)[0].numpy()
    error = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"velocity relative error vs diffusers' GGUF path: {error:.2e}")
    assert got.shape == want.shape and error <= 1e-4


def test_whole_pipeline_image_matches_diffusers(folder, reference):
    latents = initial_noise(0, 48, 80)
    # the naive program (the compiled transformer is checked above): a cold compiler search of every stage would
    # take minutes here, and what this checks is the weights path end to end
    image = Pipeline(RECIPE, weights=folder, sets=SETS, compile=False).run({"prompt": PROMPT, "init_latents": latents})
    got = to_uint8(image.values["image"])
    assert got.std() > 5, "the image is (nearly) constant"
    ref = Flux2Pipeline.from_pretrained(TINY, transformer=reference)
    want = ref(prompt=PROMPT, height=48, width=80, num_inference_steps=3, guidance_scale=4.0,
               latents=torch.tensor(latents), max_sequence_length=64, text_encoder_out_layers=(10, 20, 30),
               output_type="np").images[0]
    want = (want * 255).round().astype(np.uint8)
    assert got.shape == want.shape == (48, 80, 3)
    value = psnr(got, want)
    print(f"image PSNR vs diffusers with the GGUF transformer: {value:.2f} dB")
    assert value >= 40.0


# ---- planning FLUX.2-dev without the file ---------------------------------------------------------------------
def expected_q4_k_bytes() -> int:
    """FLUX.2-dev's transformer weights as the recipe plans them, counted from diffusers' own module list (meta
    tensors from flux2-dev-configs/transformer/config.json): the matrices ComfyUI-GGUF's quantizer quantizes as
    Q4_K (144 bytes per 256 values), the ones it keeps and every 1-D tensor as BF16."""
    config = json.loads((RECIPES / "flux2-dev-configs" / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = Flux2Transformer2DModel(**config)
    kept = re.compile(r"^(x_embedder|context_embedder|time_guidance_embed\..*|norm_out\..*|proj_out)\.weight$")
    total = 0
    for name, param in model.named_parameters():
        if param.ndim == 2 and not kept.match(name) and param.shape[1] % 256 == 0:
            total += param.shape[0] * param.shape[1] // 256 * 144
        else:
            total += param.numel() * 2
    return total


def test_inspect_plans_flux2_dev_q4_k_under_24_gib():
    """From shapes alone: the transformer's weights are FLUX.2-dev's in Q4_K (17.2 GiB; 60 GiB in BF16), resident
    under --max-memory 24GiB, and every stage fits."""
    result = cli("inspect", RECIPE, "--max-memory", "24GiB")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.startswith("transformer "))
    weights = row.split()[1:3]
    assert " ".join(weights) == f"{expected_q4_k_bytes() / 2**30:.2f} GiB", row
    assert "weights resident" in row and "DOES NOT FIT" not in result.stdout, result.stdout
    print(row)


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch, tmp_path):
    forbid_work(monkeypatch)

    def work(*args, **kwargs):
        raise AssertionError("a GGUF weight was read before the input was checked")

    monkeypatch.setattr(GgufCheckpoint, "load", work)
    monkeypatch.chdir(tmp_path)


def run(weights: Path):
    sets = [arg for s in SETS for arg in ("--set", s)]
    return cli("run", RECIPE, "--weights", weights, "--prompt", "a fox", "--quiet", *sets)


def small_state() -> dict[str, np.ndarray]:
    """The fixture's tensors as f32 values (BF16/F32 as stored, blocks decoded), BFL names."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(GGUF)
    return {t.name: dequantize(np.asarray(t.data), t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            for t in reader.tensors}


@pytest.mark.usefixtures("no_work")
def test_gguf_of_another_architecture_is_refused(tmp_path):
    weights = checkpoint_folder(tmp_path / "llama", FIXTURES / "tiny-llama.gguf")
    refused(run(weights), "flux2-gguf.yaml:", "models.transformer.quantization", "general.architecture 'llama'",
            "reads 'flux' files")


@pytest.mark.usefixtures("no_work")
def test_flux1_transformer_is_refused(tmp_path):
    state = small_state()
    state["vector_in.in_layer.weight"] = np.zeros((256, 768), np.float32)
    odd = maker.write_gguf(tmp_path / "flux1.gguf", state, {k: "F32" for k in state})
    refused(run(checkpoint_folder(tmp_path / "c", odd)), "tensor 'vector_in.in_layer.weight'", "FLUX.1")


@pytest.mark.usefixtures("no_work")
def test_wrong_shape_is_located_at_the_recipe(tmp_path):
    state = small_state()
    state["double_blocks.0.img_mlp.2.weight"] = state["double_blocks.0.img_mlp.2.weight"][:, :128]
    types = {k: "F32" if v.ndim == 1 else "BF16" for k, v in state.items()}
    odd = maker.write_gguf(tmp_path / "shape.gguf", state, types)
    message = refused(run(checkpoint_folder(tmp_path / "c", odd)), "linear_out", "flux2-transformer-modules.yaml:")
    assert "[256, 128]" in message and "[256, 256]" in message


@pytest.mark.usefixtures("no_work")
def test_unknown_and_unimplemented_quant_types_are_refused(tmp_path):
    reader = gguf.GGUFReader(GGUF)
    tensor = next(t for t in reader.tensors if t.name == "double_blocks.0.img_mlp.0.weight")
    parts = tensor.field.parts
    at = tensor.field.offset + sum(p.nbytes for p in parts[:-2])  # the type: the part before the data offset
    data = bytearray(GGUF.read_bytes())
    assert int(np.frombuffer(bytes(data[at:at + 4]), "<u4")[0]) == int(tensor.tensor_type)
    data[at:at + 4] = np.uint32(gguf.GGMLQuantizationType.IQ3_S).tobytes()
    iq = tmp_path / "iq.gguf"
    iq.write_bytes(bytes(data))
    refused(run(checkpoint_folder(tmp_path / "a", iq)), "'double_blocks.0.img_mlp.0.weight' (IQ3_S)", "Q4_K")
    data[at:at + 4] = np.uint32(250).tobytes()
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(data))
    refused(run(checkpoint_folder(tmp_path / "b", unknown)),
            "tensor 'double_blocks.0.img_mlp.0.weight' is stored in ggml type 250")


@pytest.mark.usefixtures("no_work")
def test_no_config_beside_the_file_and_safetensors_transformer(tmp_path):
    weights = checkpoint_folder(tmp_path / "noconfig", config=False)
    refused(run(weights), "states no model sizes", "config.json")
    plain = tmp_path / "plain"
    plain.mkdir()
    for item in TINY.iterdir():
        (plain / item.name).symlink_to(item)
    refused(run(plain), "models.transformer.quantization", "needs a GGUF file")


def test_gguf_quantization_block_must_say_what_it_reads():
    from pydantic import ValidationError

    from luminal_recipes.recipe.schema import QuantizationSpec

    assert QuantizationSpec(format="gguf", architecture="flux", type="Q4_K").type == "Q4_K"
    for bad in ({"format": "gguf", "type": "Q4_K"}, {"format": "gguf", "architecture": "flux"},
                {"format": "gguf", "architecture": "flux", "type": "IQ2_XS"},
                {"format": "gguf", "architecture": "flux", "type": "BF16"},
                {"format": "fp8", "type": "Q4_K"}):
        with pytest.raises(ValidationError, match="gguf"):
            QuantizationSpec(**bad)
