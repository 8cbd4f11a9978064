"""Regressions from a sweep of models the other tests do not meet (GPT-2, BERT, Mistral, Phi, Gemma, T5, ViT, CLIP,
Whisper, Wav2Vec2 and modules of many ATen ops, tiny and random, against eager PyTorch): NaN in comparisons (a wrong
result before), and ops the sweep's models fell back on: ``cumsum`` (transformers' packed-sequence check in every
causal LM called without a cache or mask), ``gather`` (BERT's token types), 1-D convolutions (Whisper, Wav2Vec2)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from torch_twins import float64_twin  # noqa: E402  (tests/torch_backend/torch_twins.py)

from luminal_recipes.torch_backend.fallback import LuminalFallbackWarning  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _whole(fn, *args):
    """``torch.compile(fn, backend="luminal")(*args)`` with any fallback an error."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        return torch.compile(fn, backend="luminal")(*args)


def test_comparisons_with_nan_are_false_as_in_torch():
    """<=, >=, == were composed from "<" alone and read NaN as equal to everything (``nan_to_num`` put +inf's
    replacement where the NaN was)."""
    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1.5, -2.0, 3.0, NAN])
    y = torch.tensor([1.0, INF, NAN, -0.0, 0.0, 1.5, -1.0, NAN, NAN])

    def f(x, y):
        return (torch.stack([x < y, x <= y, x > y, x >= y, x == y, x != y, x == 1.5, x != 3.0, x >= 0, x <= 0,
                             x.isnan(), x != x]),
                torch.nan_to_num(x, 0.0, 5.0, -5.0), x.masked_fill(x != x, 0.0))

    for got, want in zip(_whole(f, x, y), f(x, y)):
        assert got.dtype == want.dtype
        assert torch.equal(got, want), (got, want)


def test_cumsum_is_exact_on_integers_and_close_on_floats(assert_close):
    def f(x, i):
        return torch.cumsum(x, 1), x.cumsum(-1), (x > 0).cumsum(0), i.cumsum(1), (i != 1).cumsum(-1)

    for n in (1, 2, 7, 33):
        torch._dynamo.reset()  # static lengths each (a second length would retrace it symbolic: next test)
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(n))
        i = torch.randint(-50, 50, (2, n), generator=torch.Generator().manual_seed(n))
        got = _whole(f, x, i)
        want = f(x.double(), i)
        for g, w in zip(got, want):
            if w.dtype.is_floating_point:
                assert_close("model", g, w)
            else:
                assert g.dtype == w.dtype and torch.equal(g, w)


def test_cumsum_over_a_symbolic_length_falls_back_with_a_notice():
    fn = torch.compile(lambda x: torch.cumsum(x, 1), backend="luminal", dynamic=True)
    x = torch.randn(2, 6)
    with torch.no_grad(), pytest.warns(LuminalFallbackWarning, match=r"aten\.cumsum\.default is not translated "
                                       r"\(a symbolic length"):
        got = fn(x)
    assert torch.equal(got, torch.cumsum(x, 1))


def test_gather_selects_the_same_values():
    def f(x, i, j, k):
        return torch.gather(x, 1, i), torch.gather(x, 0, j), torch.gather(x, -1, k), \
            torch.gather(x[:1].expand(3, 5, 4), 1, i)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=g)
    args = (x, torch.randint(0, 5, (3, 2, 4), generator=g), torch.randint(0, 3, (2, 5, 3), generator=g),
            torch.randint(0, 4, (3, 5, 7), generator=g))
    for got, want in zip(_whole(f, *args), f(*args)):
        assert torch.equal(got, want)


def test_conv1d_matches_eager_in_float64(assert_close):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 8, 3, padding=1), torch.nn.GELU(),
                                torch.nn.Conv1d(8, 6, 5, stride=2, padding=2), torch.nn.Conv1d(6, 3, 1)).eval()
    x = torch.randn(2, 4, 11)
    assert_close("model", _whole(model, x), float64_twin(model)(x.double()))


transformers = pytest.importorskip("transformers")


def test_causal_lm_without_cache_translates_whole(assert_close):
    """A tiny MistralForCausalLM called with ``use_cache=False`` and no mask: transformers' packed-sequence check
    (``cumsum`` over the position ids) used to split the graph."""
    torch.manual_seed(6)
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    got = _whole(lambda i: model(i, use_cache=False).logits, ids)
    assert_close("model", got, float64_twin(model)(ids, use_cache=False).logits)


def test_bert_and_whisper_encoder_translate_whole(assert_close):
    torch.manual_seed(7)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    got = _whole(lambda i, m: bert(i, m).last_hidden_state, ids, mask)
    assert_close("model", got, float64_twin(bert)(ids, mask).last_hidden_state)

    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    whisper = WhisperEncoder(transformers.WhisperConfig(
        num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        max_source_positions=16)).eval()
    mel = torch.randn(2, 8, 32)
    got = _whole(lambda m: whisper(m).last_hidden_state, mel)
    assert_close("model", got, float64_twin(whisper)(mel.double()).last_hidden_state)


def test_argmax_argmin_and_max_dim_pick_nan_first_as_torch():
    """``ops.argmax`` finds the maximum by equality, which no element meets when the maximum is NaN; torch counts
    a NaN as the maximum (and the minimum). Called 7 times: the CPU runtime records its chains at the fifth run."""
    x = torch.tensor([[1.0, NAN, 3.0, NAN], [2.0, INF, -INF, 2.0], [-1.0, -1.0, -3.0, -3.0]])

    def f(x):
        return (x.argmax(-1), x.argmin(-1), x.argmax(0), *x.max(-1), *x.min(0, keepdim=True), x.argmax(),
                *(x > 1).max(-1), *x.nan_to_num(0, 9, -9).long().min(-1))

    fn = torch.compile(f, backend="luminal")
    want = f(x)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LuminalFallbackWarning)
        for _ in range(7):
            got = fn(x)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), (g, w)
                assert torch.equal(g.isnan(), w.isnan()) if w.is_floating_point() else True


class Layers(torch.nn.Module):
    """Ops the sweep's models and modules fell back on, added to the table."""

    def forward(self, x, lo):
        n = torch.nn.functional
        return (x.norm(dim=-1), n.normalize(x, dim=-1), torch.linalg.vector_norm(x, 1, -1),
                torch.linalg.vector_norm(x, float("inf"), (0, 1)), n.leaky_relu(x, 0.2), n.relu6(x * 4),
                n.hardtanh(x, -0.5, 0.7), torch.clamp(x, min=lo),
                torch.clamp(x, lo, lo + 1), ((x > 0) ^ (x > 0.5)).float(), torch.empty_like(x).fill_(2.0) * x,
                n.avg_pool2d(x.view(1, 2, 3, 8), 3, 1, 1), n.avg_pool2d(x.view(1, 2, 3, 8), 2, 2, 1),
                torch.cumsum(x, -1), x.argmin(-1), x.max(0).values)


def test_added_ops_match_eager_in_float64(assert_close):
    x, lo = torch.randn(6, 8), torch.randn(8)
    for got, want in zip(_whole(Layers(), x, lo), Layers()(x.double(), lo.double())):
        if want.dtype.is_floating_point:
            assert_close("model", got, want)
        else:
            assert torch.equal(got, want)


def test_grouped_and_dilated_convolutions_match_eager_in_float64(assert_close):
    """Depthwise (MobileNet), grouped (Wav2Vec2's positional conv, 1-D) and dilated convolutions fell back."""
    torch.manual_seed(8)
    convs = [torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.Conv2d(8, 16, 3, stride=2, padding=1,
                                                                               groups=4, bias=False),
             torch.nn.Conv2d(16, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 3), groups=2)]
    image = torch.nn.Sequential(*convs).eval()
    x = torch.randn(2, 8, 9, 10)
    assert_close("model", _whole(image, x), float64_twin(image)(x.double()))
    x3 = torch.randn(3, 8, 9, 10)  # another batch size: Dynamo retraces with the batch symbolic
    assert_close("model", _whole(image, x3), float64_twin(image)(x3.double()))
    torch._dynamo.reset()
    signal = torch.nn.Sequential(torch.nn.Conv1d(16, 16, 8, padding=4, groups=4),
                                 torch.nn.Conv1d(16, 4, 3, stride=2, dilation=2)).eval()
    s = torch.randn(2, 16, 13)
    assert_close("model", _whole(signal, s), float64_twin(signal)(s.double()))


def test_a_query_with_every_key_masked_gets_zeros_as_in_torch():
    """The composition's softmax over no key gave NaN; a later layer read it through the masked keys (0 * NaN)
    into every row of that sequence."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    keep[1, :, :, :2] = False  # the first two queries of sequence 1 see no key
    bias = torch.zeros(2, 1, 5, 5).masked_fill(~keep, float("-inf"))

    def f(q, k, v, keep, bias):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return sdpa(q, k, v, attn_mask=keep, enable_gqa=True), sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    for got, want in zip(_whole(f, q, k, v, keep, bias), f(q, k, v, keep, bias)):
        assert not got.isnan().any() and torch.equal(got[1, :, :2], want[1, :, :2])
        assert torch.allclose(got, want, atol=1e-6)


def test_left_padded_batch_generates_eager_ids():
    """Greedy ``generate`` over a batch with left padding, the forward compiled: the padded sequence's ids were
    wrong (NaN logits) for Llama-family models."""
    torch.manual_seed(10)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="luminal")
        assert model.generate(prompt, **kwargs).tolist() == want.tolist()


def test_a_negative_slice_start_on_a_symbolic_axis_is_clamped_as_in_torch():
    """``full[:, :, -4095:]`` of an axis shorter than 4095 is the whole axis (torch clamps the start at 0); on a
    symbolic axis the start was ``size - 4095``, and the output (a KV cache's kept rows) came back wrong."""

    def f(cache, new):
        full = torch.cat([cache, new], dim=-2)
        return (full * 2).sum(-1), full[:, :, -4095:, :], full[:, :, -3:-1, :]

    compiled = torch.compile(f, backend="luminal")
    g = torch.Generator().manual_seed(0)
    for n in (5, 6, 7, 9):  # the second call on retraces with the length symbolic
        args = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g)
        (want_sum, *want), (got_sum, *got) = f(*args), compiled(*args)
        torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=1e-5)  # a sum: its order may differ
        for a, b in zip(got, want):  # the slices: the same elements
            assert a.shape == b.shape and torch.equal(a, b)
