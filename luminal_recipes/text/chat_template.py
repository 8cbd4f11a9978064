"""A checkpoint's chat templates, found and rendered exactly as transformers finds and renders them.

Finding (``tokenizer/`` folder): a tokenizer (``PreTrainedTokenizerFast`` in model_index.json) takes
``chat_template.jinja`` plus ``additional_chat_templates/*.jinja`` (named templates) when present, else
tokenizer_config.json's ``chat_template`` (a string, or a list of ``{name, template}``). A processor
(``PixtralProcessor``, as FLUX.2-dev names) takes processor_config.json's ``chat_template``, else the legacy
``chat_template.json``, else the same files. Choosing (``get_chat_template``): a name picks a named template, any
other override is itself the template; without one, a single template, else the one named ``default``.

Rendering: the sandboxed Jinja environment of transformers' ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``): ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the ``loopcontrols`` extension and the ``{% generation %}`` tag, ``raise_exception``,
``strftime_now``, ``dict`` and an underscore-refusing ``namespace``, and a ``tojson`` filter that does not escape
HTML; the variables are ``messages``, ``tools`` and ``documents`` (None), ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``...). That environment is ``bounded_jinja.BoundedEnvironment``: the same
sandbox with time, size and depth bounds checked before the work, so a hostile template is one located error.
"""

from __future__ import annotations

import json
import os
import re
import traceback
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from ..errors import CheckpointError
from ..files import MAX_JSON_BYTES, kind_of, present, read_json, read_regular_text
from .bounded_jinja import MAX_TEMPLATE_CHARS, BoundedEnvironment, TemplateBoundError, render

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_PROCESSOR_FILE = "chat_template.json"
# The standard named special tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplates:
    """The templates of a tokenizer folder: one unnamed template, or several by name."""

    templates: str | dict[str, str] | None
    source: str  # the file (and key) they were read from, for messages

    def choose(self, override: str | None = None) -> tuple[str, str]:
        """(template, where it came from), as ``get_chat_template`` picks it; raises CheckpointError."""
        if isinstance(self.templates, dict):
            if override is not None and override in self.templates:
                return self.templates[override], f"{self.source} (template '{override}')"
            if override is None:
                if "default" in self.templates:
                    return self.templates["default"], f"{self.source} (template 'default')"
                raise CheckpointError(
                    f"{self.source}: the tokenizer has several chat templates ({', '.join(sorted(self.templates))}) "
                    "and none is named 'default'; name one with the pipeline recipe's tokenizer.chat_template."
                )
        if override is not None:
            return override, "the pipeline recipe's tokenizer.chat_template"
        if self.templates is None:
            raise CheckpointError(f"{self.source}: no chat template")
        return self.templates, self.source


def find_chat_templates(folder: Path, tokenizer_config: dict, processor: bool) -> ChatTemplates:
    """The templates a transformers tokenizer (or processor) loaded from ``folder`` would hold."""
    if processor:
        processor_config = _read_json(folder / "processor_config.json")
        if processor_config.get("chat_template") is not None:
            return _named(processor_config["chat_template"], f"{folder / 'processor_config.json'} chat_template")
        legacy = folder / LEGACY_PROCESSOR_FILE
        if present(legacy):
            data = _read_json(legacy)
            if "chat_template" not in data:
                raise CheckpointError(f"{legacy}: has no 'chat_template' key; restore the file from the checkpoint.")
            return _named(data["chat_template"], f"{legacy} chat_template")
    files: dict[str, str] = {}
    jinja = folder / CHAT_TEMPLATE_FILE
    if present(jinja):  # whatever is there is read as a file: a FIFO, a folder or a device is refused, not skipped
        files["default"] = _read_text(jinja)
    extra = folder / CHAT_TEMPLATE_DIR
    if present(extra):
        if not extra.is_dir():
            raise CheckpointError(f"{extra}: the named chat templates must be a folder of .jinja files, but this is "
                                  f"{kind_of(os.stat(extra).st_mode) if extra.exists() else 'a broken link'}.")
        names = []
        with os.scandir(extra) as entries:  # counted as listed: a folder of a million files is not sorted first
            for entry in entries:
                if entry.name.endswith(".jinja"):
                    names.append(entry.name)
                    if len(names) > MAX_NAMED_TEMPLATES:
                        raise CheckpointError(f"{extra}: more than {MAX_NAMED_TEMPLATES} named chat templates; a "
                                              f"tokenizer has a few. Restore the folder from the checkpoint.")
        for name in sorted(names):
            files[name.removesuffix(".jinja")] = _read_text(extra / name)
    if files:
        where = str(jinja) if list(files) == ["default"] else f"{folder} ({CHAT_TEMPLATE_FILE}, {CHAT_TEMPLATE_DIR}/)"
        return ChatTemplates(files["default"] if list(files) == ["default"] else files, where)
    if not processor and tokenizer_config.get("chat_template") is not None:
        return _named(tokenizer_config["chat_template"], f"{folder / 'tokenizer_config.json'} chat_template")
    return ChatTemplates(None, str(folder))


def _named(value: Any, source: str) -> ChatTemplates:
    if isinstance(value, str):
        return ChatTemplates(value, source)
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return ChatTemplates(dict(value), source)
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return ChatTemplates({t["name"]: t["template"] for t in value}, source)
    raise CheckpointError(
        f"{source}: a chat template is a string, or a list of {{\"name\": ..., \"template\": ...}}; got "
        f"{type(value).__name__}. Restore the file from the checkpoint."
    )


MAX_TEMPLATE_BYTES = 4 * MAX_TEMPLATE_CHARS  # a template file: what the renderer compiles, in UTF-8 at most
MAX_NAMED_TEMPLATES = 256  # additional_chat_templates/*.jinja: each read whole, so their number is bounded too


def _read_text(path: Path) -> str:
    try:
        return read_regular_text(path, "a chat template", MAX_TEMPLATE_BYTES, CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc}); restore it from the checkpoint.") from None


def _read_json(path: Path) -> dict:
    if not present(path):
        return {}
    try:
        data = read_json(path, "a tokenizer file", MAX_JSON_BYTES, CheckpointError,
                         fix="restore it from the checkpoint")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc}); restore it from the checkpoint.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object.")
    return data


# ---- the sandboxed environment -------------------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it to mark assistant
    tokens; without a mask requested it changes nothing)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Jinja's own tojson escapes HTML characters; transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates, without access to the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed attributes (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


@lru_cache(maxsize=16)
def _compile_cached(template: str) -> jinja2.Template:
    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _compile(template: str, source: str) -> jinja2.Template:
    """The template compiled in the bounded sandbox; CheckpointError (naming ``source`` and the line) when it
    is not valid Jinja or goes beyond the compile-time limits."""
    try:
        return _compile_cached(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise CheckpointError(
            f"{source}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message}); fix or replace it."
        ) from None
    except TemplateBoundError as exc:
        raise CheckpointError(f"{source}: the chat template is beyond the renderer's limits ({exc}); fix or "
                              f"replace it.") from None
    except (RecursionError, SyntaxError, MemoryError):  # the parser's or Python's compiler's stack
        raise CheckpointError(f"{source}: the chat template is nested too deeply to compile (brackets, "
                              f"expressions or blocks inside one another); fix or replace it.") from None
    except (ValueError, OverflowError) as exc:  # an integer literal Python will not convert (> 4300 digits)
        line = _line_of_long_number(template)
        why = ("an integer literal has more digits than Python converts (4300)" if "digits" in str(exc) else
               f"{type(exc).__name__}: {_shorten(str(exc))}")
        raise CheckpointError(f"{source}{f':{line}' if line else ''}: the chat template cannot be compiled "
                              f"({why}); fix or replace it.") from None


def _line_of_long_number(template: str) -> int | None:
    match = re.search(r"\d{1000,}", template)
    return template.count("\n", 0, match.start()) + 1 if match else None


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _template_line(exc: BaseException) -> int | None:
    """The template line Jinja's rewritten traceback gives for an error raised while rendering."""
    line = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == "<template>":
            line = lineno
    return line


_REFUSED_HINT = ("the template does not accept a system message followed by a text user message. Replace it with "
                 "tokenizer.chat_template in the pipeline recipe")


def template_variables(template: str, source: str) -> set[str]:
    """The names ``template`` reads that nothing inside it defines (what ``apply_chat_template``'s extra keyword
    arguments may set, besides messages and the special tokens)."""
    import jinja2.meta

    environment = _compile(template, source).environment
    try:
        return set(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except (RecursionError, MemoryError):
        raise CheckpointError(f"{source}: the chat template is nested too deeply to read; fix or replace it.") \
            from None


def render_chat(
    template: str,
    messages: list[dict],
    special_tokens: dict[str, str],
    source: str,
    add_generation_prompt: bool = False,
    variables: dict | None = None,
    refused_hint: str = _REFUSED_HINT,
) -> str:
    """``template`` rendered for one conversation, as ``apply_chat_template(..., tokenize=False, **variables)``
    does: ``variables`` (``enable_thinking=False``) reach the template over the special tokens of the same name."""
    compiled = _compile(template, source)
    try:
        return render(compiled, dict(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **(variables or {})},
        ))
    except TemplateBoundError as exc:
        raise CheckpointError(f"{_at(source, exc)}: the chat template went beyond the renderer's limits "
                              f"({_shorten(str(exc), 300)}); fix or replace the template.") from None
    except jinja2.exceptions.TemplateError as exc:  # raise_exception, sandbox refusals, undefined calls...
        raise CheckpointError(f"{_at(source, exc)}: the chat template refused the conversation "
                              f"({_shorten(str(exc), 300)}); {refused_hint}.") from None
    except RecursionError as exc:
        raise CheckpointError(f"{_at(source, exc)}: the chat template calls itself too deeply (macro or loop "
                              f"recursion); fix or replace it.") from None
    except MemoryError as exc:
        raise CheckpointError(f"{_at(source, exc)}: rendering the chat template ran out of memory; fix or "
                              f"replace it.") from None
    except Exception as exc:  # noqa: BLE001 - anything a template's Python operations raise (TypeError...)
        raise CheckpointError(f"{_at(source, exc)}: rendering the chat template failed ({type(exc).__name__}: "
                              f"{_shorten(str(exc), 300)}).") from None


def _at(source: str, exc: BaseException) -> str:
    line = _template_line(exc)
    return f"{source}:{line}" if line else source
