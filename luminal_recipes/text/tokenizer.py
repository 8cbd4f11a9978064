"""A checkpoint's tokenizer as transformers loads it: ``tokenizer.json`` (with the ``tokenizers`` package), the
options of ``tokenizer_config.json`` (padding and truncation sides, special tokens, ``split_special_tokens``), the
chat templates wherever transformers finds them (``chat_template.py``), and whether the pipeline loads the folder
as a processor (``model_index.json``), which changes when special tokens are added.

The one tokenizer module, shared by the tasks that turn text into token ids and back: ``Tokenizer`` for FLUX.2's
text encoder (``tasks/flux2/tokenize.py`` builds diffusers' conversation on it), ``TextTokenizer`` (at the end) for
text generation and sentence embeddings (prompts, chat templates, decoding, the EOS ids). ``Tokenizer.encode`` pads
and truncates the way transformers' ``TokenizersBackend.__call__`` does, with the backend's own padding and
truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import processors

from luminal_recipes import heap
from luminal_recipes.errors import CheckpointError, InputError, PipelineError
from luminal_recipes.files import MAX_JSON_BYTES, fence_of, present, read_json, read_regular_text

from .check import check_text


def _templates():
    """``chat_template`` (jinja2 and the bounded sandbox), imported when a template is found or rendered: a
    process that never renders one (a GGUF model's prompt given as ids, or ``chat=False``) does not pay jinja2's
    ~2.4 MiB resident."""
    from . import chat_template

    return chat_template


@dataclass(frozen=True)
class Encoded:
    """One text's token ids and attention mask (1 on real tokens), and its ids before truncation and padding."""

    ids: list[int]
    attention_mask: list[int]
    untruncated: list[int]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.attention_mask))


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer folder holds, read as transformers reads it (``read_tokenizer``)."""

    tokenizer: tokenizers.Tokenizer
    chat_template: str | None  # None: the folder has none and no override was given
    template_source: str | None
    special_tokens: dict[str, str]
    padding_side: str
    truncation_side: str
    processor: bool
    source: str


def read_tokenizer(folder: str | PathLike, chat_template: str | None = None,
                   processor: bool | None = None) -> TokenizerFiles:
    """Read a checkpoint's ``tokenizer/`` folder (or the checkpoint folder that contains it).

    ``chat_template`` replaces the checkpoint's template (a Jinja template, or the name of one of its named
    templates). ``processor``: whether the pipeline loads this folder as a processor (default: as
    model_index.json next to it says).
    """
    folder, tokenizer = load_tokenizer_json(
        folder, "a checkpoint keeps its tokenizer in tokenizer/tokenizer.json (download the checkpoint's tokenizer "
        "folder, e.g. huggingface-cli download REPO --include 'tokenizer/*').")
    options = read_tokenizer_config(folder / "tokenizer_config.json")
    if options.get("split_special_tokens"):
        raise CheckpointError(
            f"{folder / 'tokenizer_config.json'}: split_special_tokens is true (special tokens in the text are "
            "encoded as plain text), which this pipeline does not implement; set it to false."
        )
    if processor is None:
        processor = _loaded_as_processor(folder)
    # tokenizer.json's own padding/truncation settings are defaults that tokenizer_config.json overrides
    padding = tokenizer.padding or {}
    truncation = tokenizer.truncation or {}
    special = special_tokens(folder, options)
    if "pad_token" not in special and padding.get("pad_token"):
        special["pad_token"] = padding["pad_token"]
    templates = _templates().find_chat_templates(folder, options, processor)
    if chat_template is None and templates.templates is None:
        template, template_source = None, None
    else:
        template, template_source = templates.choose(chat_template)
    return TokenizerFiles(
        tokenizer=tokenizer,
        chat_template=template,
        template_source=template_source,
        special_tokens=special,
        padding_side=options.get("padding_side") or padding.get("direction") or "right",
        truncation_side=options.get("truncation_side") or truncation.get("direction") or "right",
        processor=processor,
        source=str(folder),
    )


class Tokenizer:
    """A checkpoint's tokenizer: its chat template, special tokens, padding and truncation sides."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        padding_side: str = "right",
        truncation_side: str = "right",
        processor: bool = False,
        source: str = "tokenizer",
        template_source: str | None = None,
    ):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source
        self.template_source = template_source or source
        self.special_tokens = dict(special_tokens or {})
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.processor = processor
        for side, value in (("padding_side", padding_side), ("truncation_side", truncation_side)):
            if value not in ("left", "right"):
                raise CheckpointError(f"{source}: {side} is {value!r}; it must be 'left' or 'right'.")
        self.pad_token = self.special_tokens.get("pad_token")
        self.pad_token_id = None if self.pad_token is None else tokenizer.token_to_id(self.pad_token)
        self.bos_token = self.special_tokens.get("bos_token")

    @classmethod
    def from_pretrained(cls, folder: str | PathLike, chat_template: str | None = None,
                        processor: bool | None = None) -> Tokenizer:
        """Load from a checkpoint's ``tokenizer/`` folder (see ``read_tokenizer``)."""
        files = read_tokenizer(folder, chat_template, processor)
        return cls(files.tokenizer, chat_template=files.chat_template, special_tokens=files.special_tokens,
                   padding_side=files.padding_side, truncation_side=files.truncation_side,
                   processor=files.processor, source=files.source, template_source=files.template_source)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               template_args: dict | None = None) -> str:
        """The chat template rendered for ``messages``, as ``apply_chat_template(..., tokenize=False,
        **template_args)``."""
        if self.chat_template is None:
            raise CheckpointError(
                f"{self.source}: the tokenizer has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json); add the checkpoint's template, or set tokenizer.chat_template in the "
                "pipeline recipe."
            )
        return _templates().render_chat(self.chat_template, messages, self.special_tokens, self.template_source,
                           add_generation_prompt, variables=template_args)

    def add_special_tokens(self, text: str) -> bool:
        """A tokenizer's apply_chat_template never adds special tokens; a processor's adds them unless the
        rendered text already starts with the BOS token (transformers' ProcessorMixin.apply_chat_template)."""
        return self.processor and not (self.bos_token is not None and text.startswith(self.bos_token))

    def encode(self, text: str, length: int | None = None, add_special_tokens: bool = False) -> Encoded:
        """Token ids of ``text``; with ``length``, truncated and padded to it on the configured sides (padding
        needs a pad token)."""
        check_text(text, f"{self.template_source or self.source}: the text to encode", CheckpointError)
        backend = self._tokenizer
        backend.no_padding()
        backend.no_truncation()
        full = backend.encode(text, add_special_tokens=add_special_tokens)
        if length is None:
            return Encoded(list(full.ids), list(full.attention_mask), list(full.ids))
        if self.pad_token_id is None:
            raise CheckpointError(f"{self.source}: the tokenizer names no pad token, so it cannot pad to {length} "
                                  "tokens.")
        # transformers pads and truncates with the backend's own settings (TokenizersBackend.__call__)
        backend.enable_truncation(length, stride=0, strategy="longest_first", direction=self.truncation_side)
        backend.enable_padding(direction=self.padding_side, pad_id=self.pad_token_id, pad_token=self.pad_token,
                               length=length)
        try:
            encoding = backend.encode(text, add_special_tokens=add_special_tokens)
        finally:
            backend.no_padding()
            backend.no_truncation()
        return Encoded(list(encoding.ids), list(encoding.attention_mask), list(full.ids))

    def dropped(self, encoded: Encoded, length: int) -> list[int]:
        """The ids that truncating to ``length`` tokens cut off ``encoded`` (on the truncation side)."""
        full = encoded.untruncated
        return full[length:] if self.truncation_side == "right" else full[:-length]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                      skip_special_tokens=bool(skip_special_tokens))


def check_length(value, name: str) -> int:
    """A token count (``max_sequence_length``...) is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise PipelineError(f"{name} must be an integer, got {value!r}.")
    if value < 1:
        raise PipelineError(f"{name} must be positive, got {value}.")
    return int(value)


def _loaded_as_processor(folder: Path) -> bool:
    """Whether the pipeline's model_index.json loads this folder as a processor (e.g. ``PixtralProcessor``)."""
    index = folder.parent / "model_index.json"
    if not present(index) or fence_of(index) is not fence_of(folder):
        return False  # a tokenizer at a fenced checkpoint's root: the folder above is no pipeline of it
    try:
        data = read_json(index, "model_index.json", MAX_JSON_BYTES, CheckpointError)
    except OSError:
        return False
    entry = data.get(folder.name) if isinstance(data, dict) else None
    return isinstance(entry, list) and len(entry) == 2 and str(entry[1]).endswith("Processor")


def special_tokens(folder: Path, options: dict) -> dict[str, str]:
    """The special tokens transformers passes to the template as variables: the named ones, other ``*_token``
    entries and a dict of ``extra_special_tokens``, from tokenizer_config.json (and the legacy
    special_tokens_map.json, which transformers merges over it when the config lists no added tokens)."""
    merged = dict(options)
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in options and present(legacy):
        merged.update(read_tokenizer_config(legacy))
    out: dict[str, str] = {}
    for key, value in merged.items():
        if key in _templates().SPECIAL_TOKEN_NAMES or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                out[key] = text
    extra = merged.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return out


def read_tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json (or special_tokens_map.json) as a dict; {} when nothing is at that path."""
    if not present(path):
        return {}
    try:
        options = read_json(path, "the tokenizer config", MAX_JSON_BYTES, CheckpointError,
                            fix="restore it from the checkpoint")
    except OSError as exc:
        raise CheckpointError(
            f"{path}: cannot read it as JSON ({exc}); restore it from the checkpoint."
        ) from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: expected a JSON object.")
    return options


def _token_text(value) -> str | None:
    """transformers writes special tokens as plain strings or as AddedToken dicts with a ``content`` key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json: the largest published are ~35 MB; parsing takes several times this


def load_tokenizer_json(folder: str | Path, missing_hint: str) -> tuple[Path, tokenizers.Tokenizer]:
    """The ``tokenizer.json`` of ``folder`` (or of its ``tokenizer/`` subfolder) and the folder it is in;
    ``missing_hint`` says where a missing file should come from."""
    folder = Path(folder)
    if not present(folder / "tokenizer.json") and present(folder / "tokenizer" / "tokenizer.json"):
        folder = folder / "tokenizer"
    path = folder / "tokenizer.json"
    if not present(path):
        raise CheckpointError(f"{path}: file not found; {missing_hint}")
    try:
        text = read_regular_text(path, "the tokenizer", MAX_TOKENIZER_BYTES, CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc}); restore it from the checkpoint.") \
            from None
    try:
        tokenizer = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers package raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: not a valid tokenizers file ({exc}); restore it from the checkpoint.") \
            from None
    del text
    heap.trim()  # the parse's scratch, freed but kept resident by malloc (~145 MiB of a large vocabulary's)
    return folder, tokenizer


# ---- a language model's tokenizer (text generation, sentence embeddings) ----------------------------------
# A language model's tokenizer as transformers loads it from a checkpoint folder, and its prompts.
#
# ``tokenizer.json`` is run by the ``tokenizers`` package with tokenizer_config.json's settings applied as
# transformers' ``TokenizersBackend`` applies them: ``add_bos_token``/``add_eos_token`` rewrite the post-processor,
# special tokens missing from the vocabulary are added, ``split_special_tokens``, and ``clean_up_tokenization_spaces``
# on decoding (never for a BPE model, as transformers 5). A prompt becomes ids either as ``tokenizer(prompt)`` does
# (special tokens included: ``--no-chat``) or as ``apply_chat_template([system?, user], add_generation_prompt=True,
# tokenize=True)`` does: the checkpoint's own template rendered in transformers' sandbox, then encoded without
# special tokens. The EOS ids generation stops at come from generation_config.json, else config.json.

# names every template is given by transformers; --chat-var may not set them
RESERVED_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt"}


@dataclass
class TextTokenizer:
    backend: tokenizers.Tokenizer
    folder: Path
    special_tokens: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    template_source: str = ""
    clean_up_spaces: bool = False

    @classmethod
    def from_checkpoint(cls, folder: str | Path, chat_template: str | None = None) -> TextTokenizer:
        """The tokenizer of a checkpoint folder (``tokenizer.json`` there or in ``tokenizer/``), or of a GGUF file
        (its metadata: ``text/gguf_tokenizer.py``)."""
        if str(folder).lower().endswith(".gguf"):
            return cls._from_gguf(Path(folder), chat_template)
        folder, backend = load_tokenizer_json(
            folder, "generating text needs the checkpoint's tokenizer (tokenizer.json, with tokenizer_config.json), "
            f"saved next to config.json as transformers' save_pretrained writes it. Copy the tokenizer files into "
            f"{Path(folder)}.")
        options = read_tokenizer_config(folder / "tokenizer_config.json")
        special = special_tokens(folder, options)
        backend.no_padding()
        backend.no_truncation()
        # what TokenizersBackend.__init__ does to the backend with these options
        missing = [t for t in special.values() if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens(list(dict.fromkeys(missing)))
        backend.encode_special_tokens = bool(options.get("split_special_tokens", False))
        explicit = "add_bos_token" in options or "add_eos_token" in options
        if explicit or backend.post_processor is None:
            _bos_eos_post_processor(backend, special, bool(options.get("add_bos_token", False)),
                                    bool(options.get("add_eos_token", False)))
        templates = _templates().find_chat_templates(folder, options, processor=False)
        template, source = (None, str(folder))
        if chat_template is not None or templates.templates is not None:
            template, source = templates.choose(chat_template)
        clean = bool(options.get("clean_up_tokenization_spaces", False)) and \
            type(backend.model).__name__ != "BPE"
        return cls(backend, folder, special, template, source, clean)

    @classmethod
    def _from_gguf(cls, path: Path, chat_template: str | None) -> TextTokenizer:
        from .gguf_tokenizer import load_gguf_tokenizer

        found = load_gguf_tokenizer(path)
        template, source = found.chat_template, found.template_source
        if chat_template is not None:
            template, source = chat_template, "the chat template given"
        return cls(found.backend, path, found.special_tokens, template, source, False)

    # ---- prompts -----------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer(text)["input_ids"]`` (``add_special_tokens=False``: as a chat template's text is encoded)."""
        check_text(text, f"{self.template_source or self.folder}: the text to encode", InputError)
        try:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        except BaseException as exc:  # a Rust panic (pyo3's PanicException derives from BaseException)
            if type(exc).__name__ != "PanicException":
                raise
            raise InputError(f"{self.folder / 'tokenizer.json'}: the tokenizer failed on a text of {len(text):,} "
                             f"characters ({str(exc)[:200]}); shorten the text, or give the run more memory.") \
                from None

    def render(self, prompt: str, system: str | None = None, variables: dict[str, Any] | None = None) -> str:
        """The chat template's text for a user prompt (after an optional system message), ready for the reply."""
        if self.chat_template is None:
            raise InputError(f"{self.folder}: the checkpoint has no chat template (chat_template.jinja, or "
                             "chat_template in tokenizer_config.json); use --no-chat to encode the prompt as is.")
        variables = dict(variables or {})
        known = _templates().template_variables(self.chat_template, self.template_source) - RESERVED_VARIABLES
        unknown = sorted(set(variables) - known)
        if unknown:
            reserved = sorted(set(unknown) & RESERVED_VARIABLES)
            raise InputError(
                f"--chat-var {unknown[0]}: "
                + (f"'{reserved[0]}' is set by the generator itself" if reserved else
                   f"the chat template ({self.template_source}) reads no variable '{unknown[0]}'")
                + f"; the variables it reads are: {', '.join(sorted(known)) or 'none'}.")
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        return _templates().render_chat(self.chat_template, messages, self.special_tokens, self.template_source,
                           add_generation_prompt=True, variables=variables,
                           refused_hint="use --no-chat to encode the prompt without the template, or drop --system")

    def prompt_ids(self, prompt: str, chat: bool, system: str | None = None,
                   variables: dict[str, Any] | None = None) -> list[int]:
        if not chat:
            if system is not None or variables:
                raise InputError(f"{'--system' if system is not None else '--chat-var'} needs the chat template; "
                                 "drop --no-chat")
            return self.encode(prompt)
        return self.encode(self.render(prompt, system, variables), add_special_tokens=False)

    # ---- replies -----------------------------------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text


def clean_up_tokenization(text: str) -> str:
    """transformers' ``PreTrainedTokenizerBase.clean_up_tokenization``."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))


def _bos_eos_post_processor(backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool,
                            add_eos: bool) -> None:
    """``TokenizersBackend.update_post_processor``."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    tokens = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
        ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def eos_token_ids(checkpoint: Path) -> list[int]:
    """The ids generation stops at: ``eos_token_id`` of generation_config.json, else of config.json (an int or a
    list, as transformers' GenerationConfig reads it); for a GGUF file, tokenizer.ggml.eos_token_id."""
    if str(checkpoint).lower().endswith(".gguf"):
        from .gguf_tokenizer import gguf_eos_ids

        return gguf_eos_ids(checkpoint)  # from the metadata (building the tokenizer again cost ~1 s and ~10 MiB)
    for name in ("generation_config.json", "config.json"):
        path = Path(checkpoint) / name
        if not present(path):
            continue
        try:
            data = read_json(path, name, MAX_JSON_BYTES, CheckpointError, fix="restore it from the checkpoint")
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it as JSON ({exc}).") from None
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        if value is None and name == "config.json" and isinstance(data, dict):
            value = (data.get("text_config") or {}).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of them, got {value!r}.")
        return list(ids)
    return []
