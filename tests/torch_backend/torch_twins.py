"""Helpers of the torch backend's tests (imported by name: tests/torch_backend is on sys.path)."""

from __future__ import annotations

import copy

import torch


def float64_twin(model):
    """A float64 copy of ``model``: tests/TOLERANCES.md compares with the reference computed in float64."""
    return copy.deepcopy(model).to(torch.float64).eval()
