"""Flux2Tokenizer against the ids and mask diffusers' Flux2Pipeline feeds its text encoder, with the checkpoint's own
chat template (wherever transformers finds it), recipe overrides, and transformers' sandboxed Jinja environment."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as DIFFUSERS_SYSTEM_MESSAGE
from transformers import PreTrainedTokenizerFast

from luminal_recipes.errors import CheckpointError, PipelineError
from luminal_recipes.tasks.flux2.tokenize import SYSTEM_MESSAGE, Flux2Tokenizer

CHECKPOINT = Path(__file__).resolve().parents[2] / "recipes" / "flux2-tiny" / "checkpoint"

PROMPTS = [
    "a cat",
    "  A red fox in the snow,\n\tlooking left.  ",
    "Ein Fuchs 🦊 im Schnee — 雪の中の狐, 1234567 ünïcödé",
    "[IMG]a cat[IMG] wearing [INST]a hat[/INST] </s> <pad>",
    "x",
]
LONG_PROMPT = " ".join(f"word{i} and a fluffy purple cat number {i}" for i in range(120))


class RecordingTextEncoder:
    """Stands in for Mistral3ForConditionalGeneration: records what diffusers passes it."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __call__(self, input_ids, attention_mask, **kwargs):
        self.input_ids, self.attention_mask = input_ids, attention_mask
        hidden = torch.zeros(*input_ids.shape, 4)
        return SimpleNamespace(hidden_states=[hidden])


def diffusers_ids(tokenizer, prompt: str, max_sequence_length: int, system_message: str = SYSTEM_MESSAGE):
    encoder = RecordingTextEncoder()
    Flux2Pipeline._get_mistral_3_small_prompt_embeds(
        text_encoder=encoder,
        tokenizer=tokenizer,
        prompt=prompt,
        max_sequence_length=max_sequence_length,
        system_message=system_message,
        hidden_states_layers=(0,),
    )
    return encoder.input_ids.numpy(), encoder.attention_mask.numpy()


@pytest.fixture(scope="module")
def hf_tokenizer():
    # The class model_index.json names, loaded the way DiffusionPipeline.from_pretrained loads it.
    return PreTrainedTokenizerFast.from_pretrained(CHECKPOINT / "tokenizer")


@pytest.fixture(scope="module")
def ours():
    return Flux2Tokenizer.from_pretrained(CHECKPOINT / "tokenizer")


def assert_same(tokenized, reference):
    ids, mask = reference
    assert tokenized.input_ids.shape == ids.shape and tokenized.attention_mask.shape == mask.shape
    np.testing.assert_array_equal(tokenized.input_ids, ids)
    np.testing.assert_array_equal(tokenized.attention_mask, mask)
    assert tokenized.num_tokens == int(mask.sum())


def test_system_message_is_diffusers():
    assert SYSTEM_MESSAGE == DIFFUSERS_SYSTEM_MESSAGE


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("max_sequence_length", [512, 77])
def test_ids_and_mask_match_diffusers(ours, hf_tokenizer, prompt, max_sequence_length):
    tokenized = ours(prompt, max_sequence_length=max_sequence_length)
    assert_same(tokenized, diffusers_ids(hf_tokenizer, prompt, max_sequence_length))
    assert tokenized.input_ids.dtype == np.int32 and tokenized.input_ids[0, 0] == 1  # <s>
    if tokenized.num_tokens < max_sequence_length:
        assert tokenized.input_ids[0, -1] == ours.pad_token_id == 11


def test_template_rendering_matches_the_checkpoint_template(ours, hf_tokenizer):
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    for prompt in PROMPTS:
        rendered = hf_tokenizer.apply_chat_template(format_input([prompt])[0], tokenize=False)
        assert ours.format(prompt) == rendered


def test_long_prompt_is_truncated_with_a_warning(ours, hf_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="luminal_recipes.tasks.flux2.tokenize"):
        tokenized = ours(LONG_PROMPT, max_sequence_length=512)
    assert_same(tokenized, diffusers_ids(hf_tokenizer, LONG_PROMPT, 512))
    assert tokenized.num_tokens == 512 and tokenized.num_truncated > 0
    full = len(hf_tokenizer(ours.format(LONG_PROMPT), add_special_tokens=False)["input_ids"])
    assert tokenized.num_truncated == full - 512
    assert (
        "max_sequence_length=512" in caplog.text
        and f"{tokenized.num_truncated} tokens were cut off" in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="luminal_recipes.tasks.flux2.tokenize"):
        ours("a cat")
    assert caplog.text == ""


def test_tokenizer_config_sides_are_honoured(tmp_path, ours):
    folder = tmp_path / "tokenizer"
    shutil.copytree(CHECKPOINT / "tokenizer", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(padding_side="left", truncation_side="left")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    left = Flux2Tokenizer.from_pretrained(tmp_path)  # the checkpoint folder works too
    for prompt, length in [("a cat", 64), (LONG_PROMPT, 128)]:
        assert_same(left(prompt, length), diffusers_ids(hf, prompt, length))
    assert left("a cat", 64).input_ids[0, 0] == 11 and left("a cat", 64).attention_mask[0, 0] == 0
    assert left(LONG_PROMPT, 128).input_ids[0, -1] == 4  # [/INST] survives left truncation


@pytest.mark.parametrize("prompt", ["", "[IMG]", None, 3])
def test_bad_prompts(ours, prompt):
    with pytest.raises(PipelineError, match="prompt"):
        ours(prompt)


@pytest.mark.parametrize("length", [0, -1, 2.0, True])
def test_bad_lengths(ours, length):
    with pytest.raises(PipelineError, match="max_sequence_length"):
        ours("a cat", max_sequence_length=length)


def test_bad_tokenizer_folders(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json: file not found"):
        Flux2Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a valid tokenizers file"):
        Flux2Tokenizer.from_pretrained(tmp_path)
    shutil.copy(CHECKPOINT / "tokenizer" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(CheckpointError, match="no '<nope>' token"):
        Flux2Tokenizer.from_pretrained(tmp_path)


def test_checkpoint_tokenizer_is_mistral_tekken(ours):
    """The committed tokenizer.json against mistral-common's own Tekken code (an independent reference)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tekken = Tekkenizer.from_file(Path(mistral_common.__file__).parent / "data" / "tekken_240911.json")
    for text in [
        *PROMPTS[:3],
        LONG_PROMPT,
        SYSTEM_MESSAGE,
        "naïve café 東京 \u00a0tabs\tand\nnewlines 3.14159",
    ]:
        expected = tekken.encode(text, bos=False, eos=False)
        assert ours.backend.encode(text, add_special_tokens=False).ids == expected
    for token in ["<s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]:
        assert ours.backend.token_to_id(token) == tekken.get_special_token(token)
    assert ours.backend.get_vocab_size() == tekken.n_words == 131072


# ---- the checkpoint's own chat template ------------------------------------------------------------------------
TEKKEN_DEFAULT = None


def tekken_default_template() -> str:
    """The template transformers' convert_tekken_tokenizer gives tekken_240911.json when none is passed (made by
    mistral-common): the system prompt goes inside [INST], followed by a blank line."""
    global TEKKEN_DEFAULT
    if TEKKEN_DEFAULT is None:
        import mistral_common
        from transformers.integrations.mistral.tokenizer import _resolve_chat_template

        tekken = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
        TEKKEN_DEFAULT = _resolve_chat_template(str(tekken), None)
    return TEKKEN_DEFAULT


SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[IMG]",
                  "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]


def small_tokenizer_json(path: Path) -> None:
    """A word-level tokenizer with Tekken's special tokens: loads in milliseconds where Tekken takes a second, and
    finding, choosing and rendering templates does not depend on the vocabulary."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = " ".join([SYSTEM_MESSAGE, *PROMPTS, "a red fox in the snow cat"]).replace("\n", " ").split()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(str(path))


def tokenizer_folder(tmp_path, *, jinja=None, config_template=None, extra=None, config=None, drop_jinja=True,
                     tekken=False):
    """A tokenizer folder like the shipped one (Tekken itself with ``tekken``, else a small word-level
    vocabulary), with its chat template(s) replaced."""
    folder = tmp_path / "tokenizer"
    folder.mkdir(parents=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(CHECKPOINT / "tokenizer" / name, folder / name)
    if tekken:
        shutil.copy(CHECKPOINT / "tokenizer" / "tokenizer.json", folder / "tokenizer.json")
    else:
        small_tokenizer_json(folder / "tokenizer.json")
    if drop_jinja:
        (folder / "chat_template.jinja").unlink()
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    options = json.loads((folder / "tokenizer_config.json").read_text())
    if config_template is not None:
        options["chat_template"] = config_template
    options.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(options))
    for name, text in (extra or {}).items():
        (folder / "additional_chat_templates").mkdir(exist_ok=True)
        (folder / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return folder


def assert_matches_diffusers(folder, ours=None, prompts=("a red fox in the snow", PROMPTS[3]), hf=None):
    hf = hf or PreTrainedTokenizerFast.from_pretrained(folder)
    ours = ours or Flux2Tokenizer.from_pretrained(folder)
    for prompt in prompts:
        assert_same(ours(prompt, 96), diffusers_ids(hf, prompt, 96, ours.system_message))
    return ours


def test_convert_tekken_tokenizers_default_template(tmp_path):
    ours = assert_matches_diffusers(tokenizer_folder(tmp_path, jinja=tekken_default_template(), tekken=True))
    assert ours.format("a cat") == f"<s>[INST]{SYSTEM_MESSAGE}\n\na cat[/INST]"


def test_template_in_tokenizer_config(tmp_path):
    folder = tokenizer_folder(tmp_path, config_template=tekken_default_template())
    assert "[INST]You are" in assert_matches_diffusers(folder).format("a cat")


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    folder = tokenizer_folder(tmp_path, drop_jinja=False, config_template="{{ raise_exception('not this one') }}")
    assert "[SYSTEM_PROMPT]" in assert_matches_diffusers(folder).format("a cat")


def test_named_templates_from_tokenizer_config(tmp_path):
    templates = [{"name": "tool_use", "template": "{{ raise_exception('tools') }}"},
                 {"name": "default", "template": tekken_default_template()}]
    folder = tokenizer_folder(tmp_path, config_template=templates)
    assert "[INST]You are" in assert_matches_diffusers(folder).format("a cat")


def test_named_templates_from_files_and_override_by_name(tmp_path):
    plain = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'][0]['text'] }}{% endfor %}"
    folder = tokenizer_folder(tmp_path, drop_jinja=False, extra={"plain": plain})
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    assert isinstance(hf.chat_template, dict) and set(hf.chat_template) == {"default", "plain"}
    assert_matches_diffusers(folder, hf=hf)  # the default one
    hf.chat_template = hf.chat_template["plain"]  # what naming it in the recipe selects
    ours = Flux2Tokenizer.from_pretrained(folder, chat_template="plain")
    assert_matches_diffusers(folder, ours=ours, hf=hf)
    assert ours.format("a cat").startswith("<s><system>You are")


def test_several_templates_without_a_default_are_refused(tmp_path):
    templates = [{"name": "a", "template": "x"}, {"name": "b", "template": "y"}]
    folder = tokenizer_folder(tmp_path, config_template=templates)
    with pytest.raises(CheckpointError, match="several chat templates \\(a, b\\) and none is named 'default'"):
        Flux2Tokenizer.from_pretrained(folder)
    assert Flux2Tokenizer.from_pretrained(folder, chat_template="b").format("x") == "y"


def test_recipe_overrides_of_template_and_system_message(tmp_path):
    custom = (
        "{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'][0]['text'] | upper }}"
        "[/SYSTEM_PROMPT]{% else %}[INST]{{ m['content'][0]['text'] }}[/INST]{% endif %}{% endfor %}{{ eos_token }}"
    )
    folder = tokenizer_folder(tmp_path, drop_jinja=False)
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    hf.chat_template = custom  # diffusers: pipe.tokenizer.chat_template = ...; pipe.system_message = ...
    ours = Flux2Tokenizer.from_pretrained(folder, chat_template=custom, system_message="Draw it.")
    assert ours.system_message == "Draw it." and ours.format("a cat") == "[SYSTEM_PROMPT]DRAW IT.[/SYSTEM_PROMPT]" \
        "[INST]a cat[/INST]</s>"
    assert_matches_diffusers(folder, ours=ours, hf=hf)
    only_system = Flux2Tokenizer.from_pretrained(folder, system_message="Draw it.")
    assert "[SYSTEM_PROMPT]Draw it.[/SYSTEM_PROMPT]" in only_system.format("a cat")
    assert_matches_diffusers(folder, ours=only_system)


# Features of transformers' environment a plain Jinja environment lacks or renders differently.
SANDBOX_TEMPLATE = """{%- set ns = namespace(system='', n=0) -%}
{%- for m in messages -%}{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'][0]['text'] -%}{%- endif -%}
{%- endfor -%}
{{ bos_token }}[AVAILABLE_TOOLS]{{ {'system': ns.system[:20], 'note': '<&>\u00e9', 'd': dict(a=1)} | tojson }}
{% for m in messages if m['role'] != 'system' %}
    {% if loop.index > 1 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [INST]{{ m['content'] | map(attribute='text') | join(' ') | trim }}{% generation %}[/INST]{% endgeneration %}
{% endfor %}
{{ image_token }}{{ strftime_now('%Y') }}
{%- if add_generation_prompt %}{{ raise_exception('no generation prompt') }}{% endif -%}
"""


def test_sandboxed_environment_renders_as_transformers(tmp_path):
    extra = {"extra_special_tokens": {"image_token": "[IMG]"}}
    folder = tokenizer_folder(tmp_path, jinja=SANDBOX_TEMPLATE, config=extra)
    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    ours = Flux2Tokenizer.from_pretrained(folder)
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    for prompt in PROMPTS:
        assert ours.format(prompt) == hf.apply_chat_template(format_input([prompt])[0], tokenize=False)
    assert '"note": "<&>\u00e9"' in ours.format("a cat") and "[IMG]" in ours.format("a cat")
    assert_matches_diffusers(folder, ours=ours, hf=hf)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('only images please') }}", "refused the conversation \\(only images please\\)"),
        ("{{ ''.__class__.__mro__ }}", "refused the conversation"),  # the sandbox
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore-prefixed"),
        ("{% for m in messages %}", "not valid Jinja \\(line 1"),
    ],
)
def test_template_errors_name_the_template(tmp_path, template, message):
    folder = tokenizer_folder(tmp_path, jinja=template)
    with pytest.raises(CheckpointError, match=message) as info:
        Flux2Tokenizer.from_pretrained(folder)("a cat")
    assert str(folder / "chat_template.jinja") in str(info.value)


def test_no_template_falls_back_with_a_warning(tmp_path, caplog):
    folder = tokenizer_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="luminal_recipes.tasks.flux2.tokenize"):
        ours = Flux2Tokenizer.from_pretrained(folder)
    assert "has no chat template" in caplog.text and "FLUX.2-dev (Mistral-Small-3.2) format" in caplog.text
    assert ours.format("a [IMG]cat") == f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]a cat[/INST]"
    shipped = Flux2Tokenizer.from_pretrained(tokenizer_folder(tmp_path / "with", drop_jinja=False))
    for prompt in PROMPTS:
        assert ours.format(prompt) == shipped.format(prompt)  # FLUX.2-dev's template renders the same


def test_split_special_tokens_is_refused(tmp_path):
    folder = tokenizer_folder(tmp_path, drop_jinja=False, config={"split_special_tokens": True})
    with pytest.raises(CheckpointError, match="split_special_tokens is true"):
        Flux2Tokenizer.from_pretrained(folder)


def with_bos_post_processor(folder):
    """tokenizer.json whose post-processor adds <s> when special tokens are added (Tekken's does not)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize("starts_with_bos", [False, True])
def test_a_processor_adds_special_tokens_unless_the_text_starts_with_bos(tmp_path, starts_with_bos):
    from transformers import ProcessorMixin

    class TextProcessor(ProcessorMixin):  # a processor with a tokenizer only: ProcessorMixin.apply_chat_template
        attributes = ["tokenizer"]
        tokenizer_class = "PreTrainedTokenizerFast"

        def __init__(self, tokenizer=None, chat_template=None):
            super().__init__(tokenizer, chat_template=chat_template)

        def __call__(self, text=None, images=None, videos=None, audio=None, **kwargs):
            return self.tokenizer(text, **kwargs)

    template = ("{{ bos_token }}" if starts_with_bos else "") + "{% for m in messages %}[INST]{{ " \
        "m['content'][0]['text'] }}[/INST]{% endfor %}"
    folder = tokenizer_folder(tmp_path, jinja=template)
    with_bos_post_processor(folder)
    processor = TextProcessor(PreTrainedTokenizerFast.from_pretrained(folder), chat_template=template)
    ours = Flux2Tokenizer.from_pretrained(folder, processor=True)
    for prompt in ("a cat", LONG_PROMPT):
        assert_same(ours(prompt, 64), diffusers_ids(processor, prompt, 64))
    assert ours("a cat", 64).input_ids[0, 0] == 1 and ours("a cat", 64).input_ids[0, 1] != 1
    assert ours(LONG_PROMPT, 64).num_truncated > 0
    assert Flux2Tokenizer.from_pretrained(folder).add_special_tokens("[INST]") is False  # a plain tokenizer never


def test_processor_templates_and_model_index(tmp_path):
    checkpoint = tmp_path / "ckpt"
    folder = tokenizer_folder(checkpoint)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": tekken_default_template()}))
    (checkpoint / "model_index.json").write_text(json.dumps({"tokenizer": ["transformers", "PixtralProcessor"]}))
    ours = Flux2Tokenizer.from_pretrained(checkpoint)
    assert ours.processor and ours.template_source.endswith("chat_template.json chat_template")
    assert ours.format("a cat") == f"<s>[INST]{SYSTEM_MESSAGE}\n\na cat[/INST]"
    (checkpoint / "model_index.json").write_text(json.dumps({"tokenizer": ["transformers", "PreTrainedTokenizerFast"]}))
    assert not Flux2Tokenizer.from_pretrained(checkpoint).processor  # a tokenizer ignores chat_template.json


def test_pipeline_recipe_tokenizer_fields_reach_the_tokenizer(tmp_path):
    from luminal_recipes.pipeline.driver import Pipeline
    from luminal_recipes.tasks.flux2.steps import tokenizer

    recipes = CHECKPOINT.parents[1]
    for path in recipes.glob("*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    shutil.copytree(recipes / "lib", tmp_path / "lib")  # the module library the text encoder includes
    pipeline = tmp_path / "flux2-tiny.yaml"
    text = pipeline.read_text() + (  # flux2-tiny.yaml extends flux2.yaml: these keys merge into its tokenizer:
        "tokenizer:\n  system: Paint it.\n  chat_template: \"{{ bos_token }}{% for m in messages "
        "%}<{{ m['content'][0]['text'] }}>{% endfor %}\"\n"
    )
    pipeline.write_text(text)
    tok = tokenizer(Pipeline(pipeline, weights=CHECKPOINT).context)
    assert tok.system_message == "Paint it." and tok.format("a cat") == "<s><Paint it.><a cat>"
    assert tok.template_source == "the pipeline recipe's tokenizer.chat_template"
