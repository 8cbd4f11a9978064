"""Flux2Schedule against diffusers' FlowMatchEulerDiscreteScheduler as Flux2Pipeline drives it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu as diffusers_mu

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.tasks.flux2.scheduler import Flux2Schedule, compute_empirical_mu

CHECKPOINT = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny" / "checkpoint"
FLUX2_DEV_CONFIG = json.loads((CHECKPOINT / "scheduler" / "scheduler_config.json").read_text())


def reference(config: dict, num_steps: int, image_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """What Flux2Pipeline.__call__ step 6 does, with diffusers' own scheduler and mu."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    mu = diffusers_mu(image_seq_len=image_seq_len, num_steps=num_steps)
    scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
    return scheduler.sigmas.numpy(), scheduler.timesteps.numpy()


def assert_schedule_equal(ours, theirs):
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("num_steps", [1, 2, 4, 28, 50])
@pytest.mark.parametrize("image_seq_len", [15, 256, 1024, 4096, 4301, 16384])
def test_pipeline_schedule_matches_diffusers(num_steps, image_seq_len):
    ours = Flux2Schedule.from_config(FLUX2_DEV_CONFIG).timesteps(num_steps, image_seq_len)
    theirs = reference(FLUX2_DEV_CONFIG, num_steps, image_seq_len)
    assert_schedule_equal(ours, theirs)
    # Bit-identical, not merely close: the same float32 operations in the same order.
    assert ours[0].tobytes() == theirs[0].tobytes()


@pytest.mark.parametrize(
    "overrides",
    [
        {"time_shift_type": "linear"},
        {"shift_terminal": 0.1},
        {"invert_sigmas": True},
        {"use_karras_sigmas": True},
        {"use_exponential_sigmas": True},
        {"use_exponential_sigmas": True, "sigma_min": 0.02, "sigma_max": 0.9},
        {"use_dynamic_shifting": False, "shift": 3.0},
        {"use_flow_sigmas": True},
        {"use_flow_sigmas": True, "use_dynamic_shifting": False, "shift": 2.0},
    ],
)
def test_config_options_match_diffusers(overrides):
    config = {**FLUX2_DEV_CONFIG, **overrides}
    for num_steps, image_seq_len in [(3, 15), (28, 4096)]:
        ours = Flux2Schedule.from_config(config).timesteps(num_steps, image_seq_len)
        assert_schedule_equal(ours, reference(config, num_steps, image_seq_len))


def test_seed_test_vector():
    """The seed's vector (diffusers 0.36, FLUX.2-dev config, mu=1.15, 8 steps on the scheduler's own grid)."""
    sigmas, timesteps = Flux2Schedule.from_config(FLUX2_DEV_CONFIG).schedule(8, mu=1.15)
    expected_sigmas = [1.0, 0.9499281, 0.887723, 0.8083667, 0.7036315, 0.5590252, 0.3464282, 0.0031514, 0.0]
    expected_timesteps = [1000.0, 949.9281, 887.723, 808.3667, 703.6315, 559.0252, 346.4282, 3.1514]
    np.testing.assert_allclose(sigmas, expected_sigmas, rtol=0, atol=1e-6)
    np.testing.assert_allclose(timesteps, expected_timesteps, rtol=0, atol=1e-3)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX2_DEV_CONFIG)
    scheduler.set_timesteps(8, mu=1.15)
    assert_schedule_equal((sigmas, timesteps), (scheduler.sigmas.numpy(), scheduler.timesteps.numpy()))


def test_empirical_mu_matches_diffusers():
    for seq in [1, 15, 256, 1000, 4300, 4301, 65536]:
        for steps in [1, 10, 28, 50, 200]:
            assert compute_empirical_mu(seq, steps) == diffusers_mu(seq, steps)


@pytest.mark.parametrize("stochastic", [False, True])
def test_step_matches_diffusers(stochastic):
    config = {**FLUX2_DEV_CONFIG, "stochastic_sampling": stochastic}
    ours = Flux2Schedule.from_config(config)
    sigmas, timesteps = ours.timesteps(4, 15)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(4, sigmas=np.linspace(1.0, 1 / 4, 4), mu=diffusers_mu(15, 4))
    scheduler.set_begin_index(0)
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, 15, 128), dtype=np.float32)
    ref = torch.from_numpy(latents)
    for i, t in enumerate(scheduler.timesteps):
        velocity = rng.standard_normal(latents.shape, dtype=np.float32)
        generator = torch.Generator().manual_seed(i)
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(i)).numpy()
        ref = scheduler.step(torch.from_numpy(velocity), t, ref, generator=generator, return_dict=False)[0]
        latents = ours.step(velocity, sigmas[i], sigmas[i + 1], latents, noise=noise if stochastic else None)
        assert latents.dtype == np.float32
        assert latents.tobytes() == ref.numpy().tobytes()


def test_schedule_used_by_the_real_pipeline():
    """Run Flux2Pipeline itself (tiny checkpoint, given prompt embeddings); record its sigmas/timesteps."""
    pipe = Flux2Pipeline.from_pretrained(CHECKPOINT, text_encoder=None, tokenizer=None)
    seen = {}

    def record(pipeline, step, timestep, kwargs):
        seen.setdefault("sigmas", pipeline.scheduler.sigmas.numpy().copy())
        seen.setdefault("timesteps", pipeline.scheduler.timesteps.numpy().copy())
        return {}

    joint = pipe.transformer.config.joint_attention_dim
    pipe(
        prompt_embeds=torch.zeros(1, 8, joint),
        height=48,
        width=80,
        num_inference_steps=3,
        output_type="latent",
        callback_on_step_end=record,
        generator=torch.Generator().manual_seed(0),
    )
    ours = Flux2Schedule.from_config(CHECKPOINT / "scheduler").timesteps(3, (48 // 16) * (80 // 16))
    assert_schedule_equal(ours, (seen["sigmas"], seen["timesteps"]))


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, "4"])
def test_bad_step_counts(steps):
    with pytest.raises(PipelineError, match="steps must be a positive integer"):
        Flux2Schedule.from_config(FLUX2_DEV_CONFIG).timesteps(steps, 16)


def test_bad_configs(tmp_path):
    with pytest.raises(CheckpointError, match="scheduler_config.json: file not found"):
        Flux2Schedule.from_config(tmp_path)
    (tmp_path / "scheduler_config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match=r"scheduler_config.json:1:3: not valid JSON \(.*\); restore the file"):
        Flux2Schedule.from_config(tmp_path)
    with pytest.raises(CheckpointError, match="FlowMatchEulerDiscreteScheduler"):
        Flux2Schedule.from_config({"_class_name": "DDIMScheduler"})
    with pytest.raises(CheckpointError, match="time_shift_type"):
        Flux2Schedule.from_config({"time_shift_type": "cubic"})
    with pytest.raises(CheckpointError, match="only one of"):
        Flux2Schedule.from_config({"use_karras_sigmas": True, "use_exponential_sigmas": True})
    with pytest.raises(CheckpointError, match="use_beta_sigmas"):
        Flux2Schedule.from_config({"use_beta_sigmas": True})


def test_dynamic_shift_needs_mu_and_stochastic_needs_noise():
    schedule = Flux2Schedule.from_config(FLUX2_DEV_CONFIG)
    with pytest.raises(PipelineError, match="mu"):
        schedule.schedule(4)
    stochastic = Flux2Schedule.from_config({**FLUX2_DEV_CONFIG, "stochastic_sampling": True})
    x = np.zeros((1, 4, 128), np.float32)
    with pytest.raises(PipelineError, match="stochastic_sampling"):
        stochastic.step(x, 1.0, 0.5, x)


def test_recipe_scheduler_options_replace_config_values_as_diffusers_from_config(tmp_path):
    """`scheduler: {options: ...}` in a pipeline recipe: FlowMatchEulerDiscreteScheduler.from_config(config,
    **options), as the pipeline's schedule step runs it; unknown or ill-typed options are refused before any
    work, at the recipe's line."""
    import shutil

    from luminal_recipes.errors import CheckpointError
    from luminal_recipes.pipeline import plan
    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.tasks.flux2.steps import schedule_of

    recipes = CHECKPOINT.parents[1]
    shutil.copytree(recipes, tmp_path / "r", ignore=shutil.ignore_patterns("flux2-tiny", "flux2-dev-configs"))
    options = {"shift": 3.0, "use_dynamic_shifting": False, "shift_terminal": 0.2}
    (tmp_path / "r" / "shifted.yaml").write_text(
        "kind: pipeline\nextends: flux2-tiny.yaml\nname: shifted\n"
        f"scheduler:\n  options: {json.dumps(options)}\n")
    pipe = Pipeline(tmp_path / "r" / "shifted.yaml", weights=CHECKPOINT)
    ours = schedule_of(pipe.context).timesteps(4, 15)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX2_DEV_CONFIG, **options)
    scheduler.set_timesteps(4, sigmas=np.linspace(1.0, 1 / 4, 4), mu=diffusers_mu(15, 4))
    assert_schedule_equal(ours, (scheduler.sigmas.numpy(), scheduler.timesteps.numpy()))
    plain = Flux2Schedule.from_config(FLUX2_DEV_CONFIG).timesteps(4, 15)
    assert not np.allclose(plain[0], ours[0])  # the options changed the schedule

    def no_work(*args, **kwargs):
        raise AssertionError("a model was planned before the scheduler options were checked")

    for bad, words in (({"shfit": 2.0}, "'shfit' is not an option of the FLUX.2 flow-match schedule"),
                       ({"shift": "abc"}, "shift is 'abc'; it must be a finite number")):
        (tmp_path / "r" / "bad.yaml").write_text(
            f"kind: pipeline\nextends: flux2-tiny.yaml\nname: bad\nscheduler:\n  options: {json.dumps(bad)}\n")
        pipe = Pipeline(tmp_path / "r" / "bad.yaml", weights=CHECKPOINT)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(plan, "plan_model", no_work)
            with pytest.raises((PipelineError, CheckpointError), match=r"bad\.yaml:5:\d+: scheduler\.options"):
                pipe.prepare()
        with pytest.raises((PipelineError, CheckpointError)) as info:
            schedule_of(Pipeline(tmp_path / "r" / "bad.yaml", weights=CHECKPOINT).context)
        assert words in str(info.value)
