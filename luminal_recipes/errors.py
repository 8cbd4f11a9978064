"""Exception classes.

Every error a user can cause derives from ``LuminalError``: the CLI prints its message (one paragraph naming the
place and the fix) and exits with code 2, without a traceback. Anything else escaping is a bug in this package.
"""

from __future__ import annotations


class LuminalError(Exception):
    """A user-facing error: bad input, not a bug. The message says where and what to do."""


# --- graph construction -------------------------------------------------------------------------------------------
class GraphError(LuminalError):
    """An op was called with arguments the graph cannot represent."""


class ShapeError(GraphError):
    """Shapes are invalid for an op (wrong rank, non-positive size, incompatible reshape...)."""


class BroadcastError(ShapeError):
    """A binary op got operands of different shapes; HLIR never broadcasts implicitly."""


class DTypeError(GraphError):
    """Operand dtypes disagree or a dtype is not accepted by an op; HLIR never promotes implicitly."""


class SliceError(ShapeError):
    """A slice or index lies outside the dimension it applies to."""


# --- running ------------------------------------------------------------------------------------------------------
class UnboundDimError(LuminalError):
    """A symbolic dimension has no value at run time."""


class InputError(LuminalError):
    """A runtime input is missing or does not match its declared shape/dtype."""


class NonFiniteError(LuminalError):
    """A model computed NaN or infinity where its result is used (a language model's logits); the message names
    the model, its checkpoint, the step and the likely cause (``--allow-nonfinite`` goes on anyway)."""


# --- recipes, checkpoints, pipelines ------------------------------------------------------------------------------
class RecipeError(LuminalError):
    """A recipe file is invalid; the message starts with ``file:line:col``."""


class CheckpointError(LuminalError):
    """A checkpoint does not match its recipe, or is corrupt; the message names the tensor or file."""


class LoraError(CheckpointError):
    """A LoRA file cannot be read, or does not fit the model it is applied to; the message names the file."""


class QuantizationError(LuminalError):
    """A quantized tensor is in a layout other than the one the recipe declares."""


class BudgetError(LuminalError):
    """No plan fits the memory budget; the message says what the smallest one needs."""


class PipelineError(LuminalError):
    """A pipeline run got bad arguments (size, steps, prompt file, output path...)."""


class PluginError(LuminalError):
    """A task plug-in (``luminal_recipes/tasks/``) is malformed, or two plug-ins define the same step."""
