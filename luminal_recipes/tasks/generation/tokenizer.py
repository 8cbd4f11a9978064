"""A language model's tokenizer as transformers loads it from a checkpoint folder, and its prompts.

``tokenizer.json`` is run by the ``tokenizers`` package with tokenizer_config.json's settings applied as
transformers' ``TokenizersBackend`` applies them: ``add_bos_token``/``add_eos_token`` rewrite the post-processor,
special tokens missing from the vocabulary are added, ``split_special_tokens``, and ``clean_up_tokenization_spaces``
on decoding (never for a BPE model, as transformers 5). A prompt becomes ids either as ``tokenizer(prompt)`` does
(special tokens included: ``--no-chat``) or as ``apply_chat_template([system?, user], add_generation_prompt=True,
tokenize=True)`` does: the checkpoint's own template rendered in transformers' sandbox, then encoded without
special tokens. The EOS ids generation stops at come from generation_config.json, else config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from ...errors import CheckpointError, InputError
from ...files import MAX_JSON_BYTES, present, read_json
from ...text.chat_template import find_chat_templates, render_chat, template_variables
from ...text.check import check_text
from ...text.tokenizer import load_tokenizer_json, read_tokenizer_config, special_tokens
from ...weights.gguf_io import is_gguf

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
        if is_gguf(folder):
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
        templates = find_chat_templates(folder, options, processor=False)
        template, source = (None, str(folder))
        if chat_template is not None or templates.templates is not None:
            template, source = templates.choose(chat_template)
        clean = bool(options.get("clean_up_tokenization_spaces", False)) and \
            type(backend.model).__name__ != "BPE"
        return cls(backend, folder, special, template, source, clean)

    @classmethod
    def _from_gguf(cls, path: Path, chat_template: str | None) -> TextTokenizer:
        from ...text.gguf_tokenizer import load_gguf_tokenizer

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
        known = template_variables(self.chat_template, self.template_source) - RESERVED_VARIABLES
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
        return render_chat(self.chat_template, messages, self.special_tokens, self.template_source,
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
    if is_gguf(checkpoint):
        from ...text.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(checkpoint).eos_ids
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
