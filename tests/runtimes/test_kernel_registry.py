"""The kernel registry is the one place a kernel is described: the primitives come from graph.core's list, every
egglog constructor maps to one kernel, and the compiler, the cost model, the memory planner and the contract text
are derived from it. Rule families are found by listing compiler/rules/."""

from __future__ import annotations

import shutil

import pytest

from luminal_recipes.compiler import rules
from luminal_recipes.compiler.saturate import new_egraph
from luminal_recipes.graph.core import PRIMITIVE_OPS
from luminal_recipes.runtimes import memory
from luminal_recipes.runtimes.kernels import (
    ALIASING_KERNELS,
    CONSTRUCTORS,
    PRIMITIVE_KERNELS,
    REGISTRY,
    Ctor,
    egglog_declarations,
    fingerprint,
)
from luminal_recipes.runtimes.program import KERNELS


def test_primitives_are_the_graphs_primitives():
    assert set(PRIMITIVE_OPS) == PRIMITIVE_KERNELS
    assert set(PRIMITIVE_OPS) <= set(REGISTRY)


def test_every_constructor_is_declared_once_from_the_registry():
    schema = rules.rule_text(rules.SCHEMA)
    text = rules.program_text()
    for name, (spec, ctor) in CONSTRUCTORS.items():
        assert f"(constructor {name} " not in schema, f"{name} is declared by hand in schema.egg"
        assert text.count(f"(constructor {name} (") == 1, name
        assert spec.constructors[name] is ctor
    new_egraph()  # the generated declarations parse, with every rule family


def test_contract_text_memory_planner_and_cache_key_derive_from_the_registry():
    assert set(KERNELS) == set(REGISTRY)
    assert all(KERNELS[name].startswith(spec.doc) for name, spec in REGISTRY.items())
    assert memory.ALIASING_OPS == ALIASING_KERNELS == {"ScatterInPlace": 0}
    assert {"Add", "Exp2", "Elementwise"} <= memory.INPLACE_OPS and "MatMul" not in memory.INPLACE_OPS
    assert len(fingerprint()) == 64 and fingerprint() == fingerprint()


def test_constructor_arguments_become_operands_and_attributes():
    ctor = Ctor("layout:String x:Ld w:Ld n:i64", fixed={"format": "demo"})
    assert ctor.declaration("Demo") == "(constructor Demo (String Ld Ld i64) IR)"
    assert ctor.to_attrs(("comfy", None, None, 7), []) == {"format": "demo", "layout": "comfy", "n": 7}
    with pytest.raises(ValueError, match="sort must be one of"):
        _ = Ctor("x:Tensor").params
    assert "(constructor Softmax (Ld) IR)" in egglog_declarations()


def test_rule_families_are_found_by_listing_the_folder(tmp_path, monkeypatch):
    folder = tmp_path / "rules"
    shutil.copytree(rules.rules_dir(), folder)
    (folder / "zz_extra.egg").write_text("; a new family is used without being listed anywhere\n")
    monkeypatch.setattr(rules, "rules_dir", lambda: folder)
    assert rules.families()[-1] == "zz_extra"
    assert "a new family is used" in rules.program_text(rules.families())
    (folder / "schema.egg").write_text((folder / "schema.egg").read_text().replace(rules.MARKER, ""))
    with pytest.raises(Exception, match="KERNEL-CONSTRUCTORS"):
        rules.program_text()
