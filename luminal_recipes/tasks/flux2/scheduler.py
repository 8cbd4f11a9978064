"""FlowMatch Euler schedule for FLUX.2, as diffusers' Flux2Pipeline drives FlowMatchEulerDiscreteScheduler.

The pipeline starts from ``sigmas = linspace(1, 1/N, N)``, computes ``mu = compute_empirical_mu(image_seq_len,
N)`` and lets the scheduler shift the sigmas with its resolution-dependent time shift; the scheduler then
appends a final 0 and integrates with plain Euler steps. Every operation below is done in the same dtype and
order as diffusers (float32 numpy for given sigmas, float64 for the scheduler's own default grid), so the
schedule is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path

import numpy as np

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.files import MAX_JSON_BYTES, read_json

SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's empirical shift ``mu`` (diffusers' ``compute_empirical_mu``, from BFL's sampling.py)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


@dataclass(frozen=True)
class Flux2Schedule:
    """The options of a ``scheduler_config.json`` that change the sampled trajectory."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None
    invert_sigmas: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    stochastic_sampling: bool = False
    # Not constructor options, but the Karras/exponential conversions read them from the config if present.
    sigma_min: float | None = None
    sigma_max: float | None = None
    # Not a scheduler option: Flux2Pipeline checks it on the config and then lets the scheduler pick sigmas.
    use_flow_sigmas: bool = False

    @classmethod
    def options(cls) -> list[str]:
        """The config entries this schedule reads (what ``from_config``'s ``options`` may replace)."""
        return list(vars(cls()))

    @classmethod
    def from_config(cls, config: str | PathLike | Mapping, options: Mapping | None = None,
                    options_origin: str = "scheduler.options") -> Flux2Schedule:
        """Read a diffusers scheduler config: a ``scheduler_config.json`` path, its folder, or the dict.
        ``options`` replace its entries, as ``Scheduler.from_config(config, **options)`` does in diffusers;
        each must be one this schedule reads (``options_origin`` names where they were written)."""
        where = "scheduler config"
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "scheduler_config.json"
            where = str(path)
            try:
                config = read_json(path, "the scheduler config", MAX_JSON_BYTES, CheckpointError,
                                   fix="restore the file")
            except FileNotFoundError:
                raise CheckpointError(
                    f"{where}: file not found; a FLUX.2 checkpoint keeps its scheduler settings in "
                    "scheduler/scheduler_config.json (copy it from the original checkpoint)."
                ) from None
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot read it as JSON ({exc}); restore the file.") from None
            if not isinstance(config, Mapping):
                raise CheckpointError(f"{where}: expected a JSON object, found {type(config).__name__}.")
        if options:
            unknown = sorted(set(options) - set(cls.options()))
            if unknown:
                raise PipelineError(
                    f"{options_origin}: {', '.join(map(repr, unknown))} is not an option of the FLUX.2 flow-match "
                    f"schedule; it reads {', '.join(cls.options())}"
                )
            config = {**config, **options}
            where = f"{where} with {options_origin}"
        class_name = config.get("_class_name", SCHEDULER_CLASS)
        if class_name != SCHEDULER_CLASS:
            raise CheckpointError(
                f"{where}: _class_name is {class_name!r}, but FLUX.2 pipelines use {SCHEDULER_CLASS!r}; "
                "point the recipe at a FLUX.2 checkpoint's scheduler folder."
            )
        defaults = cls()
        values = {}
        for name, default in vars(defaults).items():
            value = config.get(name, default)
            values[name] = default if value is None else value
        schedule = cls(**values)
        schedule._validate(where)
        return schedule

    def _validate(self, where: str) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise CheckpointError(
                f"{where}: time_shift_type is {self.time_shift_type!r}; use 'exponential' or 'linear'."
            )
        if self.use_karras_sigmas + self.use_exponential_sigmas + self.use_beta_sigmas > 1:
            raise CheckpointError(
                f"{where}: only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas may be "
                "true."
            )
        if self.use_beta_sigmas:
            raise CheckpointError(
                f"{where}: use_beta_sigmas needs scipy's beta quantiles, which this numpy-only pipeline "
                "does not implement; set it to false."
            )
        if not (isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 0):
            raise CheckpointError(f"{where}: num_train_timesteps must be a positive integer.")
        for name, value in vars(self).items():  # the types diffusers' constructor arguments have
            default = getattr(type(self)(), name)
            if isinstance(default, bool) and not isinstance(value, bool):
                raise CheckpointError(f"{where}: {name} is {value!r}; it must be true or false.")
            if name in ("shift", "shift_terminal", "sigma_min", "sigma_max") and value is not None and (
                    isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
                raise CheckpointError(f"{where}: {name} is {value!r}; it must be a finite number.")

    # -- the grid before shifting ----------------------------------------------------------------------------
    def _train_sigma_range(self) -> tuple[float, float]:
        """``(sigma_min, sigma_max)`` as the scheduler's constructor leaves them (float32, static shift)."""
        n = self.num_train_timesteps
        ends = np.array([n, 1], dtype=np.float32) / np.float32(n)
        if not self.use_dynamic_shifting:
            ends = self.shift * ends / (1 + (self.shift - 1) * ends)
        return float(ends[1]), float(ends[0])

    def base_sigmas(self, num_steps: int) -> np.ndarray | None:
        """Sigmas Flux2Pipeline hands the scheduler: ``linspace(1, 1/N, N)``; None with use_flow_sigmas."""
        _check_steps(num_steps)
        if self.use_flow_sigmas:
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps)

    # -- set_timesteps ---------------------------------------------------------------------------------------
    def schedule(
        self, num_steps: int, mu: float | None = None, base_sigmas: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps, sigmas=base_sigmas, mu=mu)``.

        Returns ``(sigmas, timesteps)`` as float32 arrays of length ``N + 1`` and ``N``. With
        ``base_sigmas=None`` the scheduler's own grid ``linspace(t_max, t_min, N) / num_train_timesteps`` is
        shifted instead.
        """
        _check_steps(num_steps)
        if self.use_dynamic_shifting and mu is None:
            raise PipelineError(
                "the scheduler config enables use_dynamic_shifting, so a shift `mu` is required."
            )
        if base_sigmas is None:
            sigma_min, sigma_max = self._train_sigma_range()
            n = self.num_train_timesteps
            timesteps = np.linspace(sigma_max * n, sigma_min * n, num_steps)
            sigmas = timesteps / n
        else:
            sigmas = np.asarray(base_sigmas).astype(np.float32)
            if sigmas.shape != (num_steps,):
                raise PipelineError(
                    f"scheduler: {sigmas.shape[0] if sigmas.ndim == 1 else sigmas.shape} custom sigmas given "
                    f"for {num_steps} steps; pass exactly one sigma per step."
                )

        if self.use_dynamic_shifting:
            sigmas = self._time_shift(mu, sigmas)
        else:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        if self.shift_terminal:
            one_minus_z = 1 - sigmas
            scale_factor = one_minus_z[-1] / (1 - self.shift_terminal)
            sigmas = 1 - (one_minus_z / scale_factor)
        if self.use_karras_sigmas or self.use_exponential_sigmas:
            sigma_min = self.sigma_min if self.sigma_min is not None else sigmas[-1].item()
            sigma_max = self.sigma_max if self.sigma_max is not None else sigmas[0].item()
            convert = _karras if self.use_karras_sigmas else _exponential
            sigmas = convert(sigma_min, sigma_max, num_steps)

        sigmas = sigmas.astype(np.float32)
        n = np.float32(self.num_train_timesteps)
        if self.invert_sigmas:
            sigmas = np.float32(1.0) - sigmas
            return np.append(sigmas, np.float32(1.0)), sigmas * n
        return np.append(sigmas, np.float32(0.0)), sigmas * n

    def _time_shift(self, mu: float, t: np.ndarray) -> np.ndarray:
        # Written exactly as diffusers does it: with float32 ``t`` the Python floats are applied in float32.
        if self.time_shift_type == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
        return mu / (mu + (1 / t - 1) ** 1.0)

    def timesteps(self, num_steps: int, image_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """The schedule Flux2Pipeline runs for ``num_steps`` steps over ``image_seq_len`` latent tokens.

        ``image_seq_len`` is ``(H / 16) * (W / 16)``. Returns float32 ``sigmas[N + 1]`` (ending in 0) and
        ``timesteps[N]`` (``sigmas * 1000``; the transformer receives ``timesteps / 1000``).
        """
        if (
            isinstance(image_seq_len, bool)
            or not isinstance(image_seq_len, int | np.integer)
            or image_seq_len < 1
        ):
            raise PipelineError(
                f"scheduler: image_seq_len must be a positive integer, got {image_seq_len!r}."
            )
        _check_steps(num_steps)
        mu = compute_empirical_mu(int(image_seq_len), num_steps)
        return self.schedule(num_steps, mu=mu, base_sigmas=self.base_sigmas(num_steps))

    # -- step ------------------------------------------------------------------------------------------------
    def step(
        self,
        velocity: np.ndarray,
        sigma: float,
        sigma_next: float,
        latents: np.ndarray,
        noise: np.ndarray | None = None,
    ) -> np.ndarray:
        """One Euler step ``latents + (sigma_next - sigma) * velocity`` in float32, as the scheduler's
        ``step``.

        With ``stochastic_sampling`` the config asks for fresh Gaussian ``noise`` (same shape) at every step:
        ``(1 - sigma_next) * (latents - sigma * velocity) + sigma_next * noise``.
        """
        velocity = np.asarray(velocity)
        latents = np.asarray(latents).astype(np.float32, copy=False)
        if velocity.shape != latents.shape:
            raise PipelineError(
                f"scheduler step: velocity shape {velocity.shape} differs from latents shape {latents.shape}."
            )
        sigma, sigma_next = np.float32(sigma), np.float32(sigma_next)
        if self.stochastic_sampling:
            if noise is None or np.shape(noise) != latents.shape:
                raise PipelineError(
                    "the scheduler config enables stochastic_sampling: each step needs Gaussian noise of the "
                    f"latents' shape {latents.shape}."
                )
            x0 = latents - sigma * velocity
            out = (np.float32(1.0) - sigma_next) * x0 + sigma_next * np.asarray(noise, dtype=np.float32)
        else:
            out = latents + (sigma_next - sigma) * velocity
        return out.astype(np.float32, copy=False)


MAX_STEPS = 10_000  # denoising steps; FLUX.2-dev's default is 50: more is a typo, not a schedule


def check_steps(num_steps: int, given: str = "steps") -> None:
    """``num_steps`` is a whole number in [1, MAX_STEPS]; ``given`` says where it came from ("--steps 0")."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer) or not 1 <= num_steps <= MAX_STEPS:
        raise PipelineError(
            f"{given}: the number of denoising steps must be a positive integer of at most {MAX_STEPS}, got "
            f"{num_steps!r}; pass e.g. --steps 28 (FLUX.2-dev's default is 50)."
        )


def _check_steps(num_steps: int) -> None:
    check_steps(num_steps)


def _karras(sigma_min: float, sigma_max: float, num_steps: int) -> np.ndarray:
    rho = 7.0
    ramp = np.linspace(0, 1, num_steps)
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def _exponential(sigma_min: float, sigma_max: float, num_steps: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), num_steps))
