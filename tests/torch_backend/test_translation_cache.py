"""A second compile of the same model (after ``torch._dynamo.reset()``, as in a new process) reads its
translation and its program from disk: no AOTAutograd lowering, no search; the results stay eager PyTorch's.
Graphs whose lowering AOTAutograd's runtime wrappers change (an input mutated, an output aliasing an input) are
never stored, and an edited entry is refused and rebuilt."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes import instrument  # noqa: E402
from luminal_recipes.torch_backend import translation_cache  # noqa: E402
from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402

HIT, STORE = translation_cache.HIT, translation_cache.STORE


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A plan cache folder per test: every first compile here is cold."""
    monkeypatch.setenv("LUMINAL_RECIPES_CACHE", str(tmp_path / "plans"))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 24)
        self.down = torch.nn.Linear(24, 8)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))), x.sum(-1)


def _compile_and_run(model, *inputs):
    """Compile ``model`` on a fresh Dynamo state, call it on each of ``inputs``; the counters it moved and the
    last outputs."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="luminal")
    before = instrument.snapshot()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        out = [compiled(x) for x in inputs][-1]
    return instrument.snapshot() - before, out


def test_a_second_compile_reads_translation_and_program(assert_close):
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(3, 8)
    twin = float64_twin(model)
    first, out = _compile_and_run(model, x)
    assert first[STORE] == 1 and first[instrument.SEARCH] == 1 and first[HIT] == 0
    second, again = _compile_and_run(model, x)
    assert second[HIT] == 1 and second[instrument.PLAN_CACHE_HIT] == 1
    assert second[instrument.SEARCH] == 0 and second[STORE] == 0
    for got, want in zip(again, twin(x.double())):
        assert_close("model", got, want)
    assert all(torch.equal(a, b) for a, b in zip(out, again))  # the same program on the same inputs


def test_the_symbolic_graph_of_a_new_length_is_cached_too(assert_close):
    torch.manual_seed(1)
    model = Mlp().eval()
    twin = float64_twin(model)
    lengths = [torch.randn(3, 8), torch.randn(5, 8), torch.randn(6, 8)]  # the second traces the length as a symbol
    first, _ = _compile_and_run(model, *lengths)
    assert first[STORE] == 2 and first[instrument.SEARCH] == 2
    second, out = _compile_and_run(model, *lengths)
    assert second[HIT] == 2 and second[instrument.SEARCH] == 0 and second[STORE] == 0
    for got, want in zip(out, twin(lengths[-1].double())):
        assert_close("model", got, want)


def test_a_changed_model_is_another_entry():
    torch.manual_seed(2)
    model = Mlp().eval()
    x = torch.randn(3, 8)
    _compile_and_run(model, x)
    model.down = torch.nn.Linear(24, 8, bias=False)  # another graph (no bias add)
    counts, out = _compile_and_run(model, x)
    assert counts[HIT] == 0 and counts[STORE] == 1
    with torch.no_grad():
        want = model(x)
    assert torch.allclose(out[0], want[0], atol=1e-5)
    counts, _ = _compile_and_run(model, torch.randn(4, 8))  # another static shape: another entry
    assert counts[HIT] == 0 and counts[STORE] == 1


class Mutates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, acc):
        acc.add_(self.lin(x))  # an input mutated: AOTAutograd's wrapper writes it back
        return acc * 2


class Aliases(torch.nn.Module):
    def forward(self, x):
        return x.view(-1), torch.relu(x)  # an output that is a view of the input


def test_mutations_and_aliases_are_not_stored():
    torch.manual_seed(3)
    model = Mutates().eval()
    x = torch.randn(2, 4)
    for _ in range(2):
        torch._dynamo.reset()
        acc = torch.ones(2, 4)
        before = instrument.snapshot()
        with torch.no_grad():
            got = torch.compile(model, backend="luminal")(x, acc)
            want_acc = torch.ones(2, 4) + model.lin(x)
        counts = instrument.snapshot() - before
        assert counts[STORE] == 0 and counts[HIT] == 0
        assert torch.allclose(acc, want_acc, atol=1e-6) and torch.allclose(got, 2 * want_acc, atol=1e-6)
    for _ in range(2):
        torch._dynamo.reset()
        before = instrument.snapshot()
        y = torch.randn(3, 2)
        flat, relu = torch.compile(Aliases(), backend="luminal")(y)
        counts = instrument.snapshot() - before
        assert counts[STORE] == 0 and counts[HIT] == 0
        assert flat.data_ptr() == y.data_ptr() and torch.equal(relu, torch.relu(y))


def test_an_edited_entry_is_refused_and_rebuilt():
    torch.manual_seed(4)
    model = Mlp().eval()
    x = torch.randn(3, 8)
    _, want = _compile_and_run(model, x)
    (entry,) = translation_cache.folder().glob("*.json")
    data = json.loads(entry.read_text())
    data["translation"]["single"] = not data["translation"]["single"]
    entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="untrusted"):
        counts, got = _compile_and_run(model, x)
    assert counts[HIT] == 0 and counts[STORE] == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    counts, _ = _compile_and_run(model, x)  # the rebuilt entry is this user's again
    assert counts[HIT] == 1


def test_qwen3_forward_after_a_reset_searches_nothing(assert_close):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(5))

    def run():
        torch._dynamo.reset()
        forward = torch.compile(model.forward, backend="luminal")
        before = instrument.snapshot()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LuminalFallbackWarning)
            logits = forward(input_ids=ids).logits
        return instrument.snapshot() - before, logits

    first, _ = run()
    assert first[STORE] >= 1
    second, logits = run()
    assert second[instrument.SEARCH] == 0 and second[HIT] == first[STORE]
    assert second[instrument.PLAN_CACHE_HIT] >= 1
    with torch.no_grad():
        assert_close("model", logits, float64_twin(model)(ids).logits)


def test_cache_clear_removes_the_translations():
    from luminal_recipes.compiler import cache

    torch.manual_seed(6)
    _compile_and_run(Mlp().eval(), torch.randn(3, 8))
    assert len(list(translation_cache.folder().glob("*.json"))) == 1
    removed, _ = cache.clear()
    assert removed == 2 and not list(translation_cache.folder().glob("*.json"))  # the plan and the translation


class Shifted(torch.nn.Module):
    """A symbolic length used as a number: its translation has a 0-dim input fed with the length's value."""

    def forward(self, x):
        return x + x.shape[0], torch.arange(x.shape[0]) + x.shape[0]


def test_a_stored_symbolic_size_operand_is_fed_after_a_read():
    lengths = [torch.randn(3, 4), torch.randn(5, 4), torch.randn(6, 4)]
    first, _ = _compile_and_run(Shifted(), *lengths)
    assert first[STORE] == 2
    second, out = _compile_and_run(Shifted(), *lengths)
    assert second[HIT] == 2 and second[STORE] == 0
    for got, want in zip(out, Shifted()(lengths[-1])):
        assert torch.equal(got, want)
