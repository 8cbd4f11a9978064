"""The one Jinja environment every chat template is compiled and rendered in: transformers' sandbox
(``ImmutableSandboxedEnvironment``), with time, size and depth bounds that hold BEFORE the work is done.

A chat template comes from a checkpoint, that is from whoever published it; rendering must neither hang nor exhaust
memory, whatever it says. The principle: every operation that can produce a large value computes the size of its
result from its operands first, and refuses one beyond the limits below; operations whose result is at most a few
times their operand (escaping, JSON quoting, case changes) are checked right after. On top of that one render has
a budget of steps (loop iterations, calls, attribute and item lookups, operators, filters), of seconds, and of the
characters and items all its operations produce together.

- ``+ * % **`` are intercepted (``intercepted_binops``): ``'a' * 10**9``, ``10 ** (10 ** 10)``,
  ``'%*d' % (10**9, 1)``, ``'%0999999999d' % 0`` are sized before they run; and, being intercepted, they are never
  folded while Jinja compiles (``{{ 10 ** (10 ** 10) }}`` in a branch never taken used to hang the compiler).
- ``~`` (a custom code generator), string methods reached through ``call`` (``center``, ``ljust``, ``zfill``,
  ``expandtabs``, ``join``, ``replace``, ``translate``, ``int.to_bytes``), ``str.format`` fields (width, precision)
  and every filter (``center``, ``indent``, ``format``, ``join``, ``replace``, ``wordwrap``, ``batch``, ``slice``,
  ``sum``, ``tojson(indent=...)``, ``pprint``, ``string``, the escapes...) check sizes first.
- Turning a value into text (``{{ x }}``, ``~``, ``|string``, ``%s``, ``{}``) first estimates the text's length by
  walking the value, so a list holding one long string a million times is refused, not printed.
- ``range`` has at most 100000 items (as Jinja's sandbox); ``lipsum`` is bounded; every ``for`` loop's iterations
  are counted (the code generator wraps the loop's iterable), as are calls (macros, recursive loops).
- The source is at most MAX_TEMPLATE_CHARS; nesting that overflows the parser or Python's compiler, and integer
  literals Python cannot convert, are errors at compile time, not tracebacks.

Every failure is a ``TemplateBoundError`` (a ``TemplateError``) or, for errors Python raises (RecursionError...),
mapped by the caller (``chat_template.render_chat``) to one located message.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import time
import types
from collections.abc import Callable
from functools import update_wrapper
from typing import Any

import jinja2
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace
from markupsafe import Markup

from .printf import printf_numbers

MAX_TEMPLATE_CHARS = 1 << 16  # a template's source: real ones are 1-20 KB; compiling 64 KiB of Jinja takes seconds
MAX_VALUE = 1 << 20  # characters of one string (the rendered text included)
MAX_ITEMS = 1 << 17  # items of one list, tuple or dict (Jinja's filters loop over items in Python)
MAX_WORK = 1 << 24  # characters and items all the operations of one render produce together
MAX_SLOW_TEXT = 1 << 17  # characters of the input of a filter that loops in Python over its words (urlize) or
#                          copies the rest of the text once per tag it removes (striptags: quadratic)
_SLOW = ("urlize", "striptags")  # filters (and Markup methods) limited to MAX_SLOW_TEXT characters of input
MAX_WRAP_WORK = 1 << 31  # textwrap splits a long word in steps that copy the rest: (longest word) ** 2 / width
MAX_STEPS = 1 << 19  # loop iterations, calls, lookups, operators and filters of one render
MAX_SECONDS = 5.0  # one render's wall time, checked at every step
MAX_INT_BITS = 1 << 14  # integers a template computes (about 4900 digits)
MAX_RANGE = 100_000  # items of one range(), as Jinja's sandbox
LOOP_GUARD = "luminal loop guard"  # the filter the code generator wraps every for loop's iterable in


class TemplateBoundError(jinja2.exceptions.TemplateError):
    """A template went beyond one of the limits above."""


def _too_big(what: str, size: int, limit: int = MAX_VALUE) -> TemplateBoundError:
    kind = "characters" if limit == MAX_VALUE else "items"
    return TemplateBoundError(f"{what} would make at least {size} {kind}, more than the {limit} a chat template may "
                              f"build")


def _limit(value: Any) -> int:
    return MAX_VALUE if isinstance(value, (str, bytes)) else MAX_ITEMS


# ---- the budget of one render -------------------------------------------------------------------------------------
class _Budget:
    def __init__(self) -> None:
        self.steps = 0
        self.work = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        self.sizes: dict[int, tuple[Any, int]] = {}  # id -> (container, its text_size): each built one, once

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateBoundError(f"the template took more than {MAX_STEPS} steps (loop iterations, calls, "
                                     f"lookups); chat templates render a conversation in a few thousand")
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(f"rendering took more than {MAX_SECONDS:g} seconds")

    def spend(self, size: int) -> None:
        self.work += size
        if self.work > MAX_WORK:
            raise TemplateBoundError(f"the template's operations built more than {MAX_WORK} characters and items "
                                     f"in all")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("luminal_template_budget", default=None)


def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _spend(value: Any) -> Any:
    """Count a value an operation built against the render's budget (and its size against MAX_VALUE or
    MAX_ITEMS); a list, tuple or dict also by its text (``_built_size``)."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        size = len(value)
        if size > _limit(value):
            raise _too_big("an operation", size, _limit(value))
        if not isinstance(value, (str, bytes)):
            _built_size(value)
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend(size)
    return value


def _built_size(value: list | tuple | dict) -> int:
    """The text size of a container a template builds (``text_size``: an item held twice counts twice), refused
    beyond MAX_WORK. Python compares, hashes, sorts, copies and lower-cases such a value item by item in one C call
    that no step count interrupts, so a value whose text is larger than its length says is refused when built:
    ``[s] * 100000`` (s a long string: ``|sort``, ``|unique``, ``|max`` lower-case every item) or ``[x, x]``
    nested 60 deep (2**60 items to ``==`` or ``hash``). Each container built in a render is sized once (its sized
    items are looked up, not walked again), so building stays linear."""
    budget = _BUDGET.get()
    sizes = budget.sizes if budget is not None else {}
    known = sizes.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    children = [x for pair in value.items() for x in pair] if isinstance(value, dict) else value
    total = 2 + len(value) * 4
    for child in children:
        if total > MAX_WORK:
            break
        if isinstance(child, str):
            total += len(child)
            continue
        known = sizes.get(id(child))
        total += known[1] if known is not None and known[0] is child else text_size(child, MAX_WORK - total)
    return _record_size(value, total)


def _record_size(value: Any, total: int, kind: type | None = None) -> int:
    if total > MAX_WORK:
        raise TemplateBoundError(f"a {(kind or type(value)).__name__} whose text would be more than {MAX_WORK} "
                                 f"characters (items held more than once count each time); chat templates build "
                                 f"smaller values")
    budget = _BUDGET.get()
    if budget is not None and value is not None:
        budget.sizes[id(value)] = (value, total)
    return total


def _binop_size(operator: str, left: Any, right: Any) -> int | None:
    """The text size of ``left + right`` or ``left * right`` for lists and tuples, from the operands' (each sized
    once), refused beyond MAX_WORK before the result is built; None for other operations."""
    sequences = (list, tuple)
    if operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return _record_size(None, _built_size(left) + _built_size(right), type(left))
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(count, int):
                return _record_size(None, 2 + max(0, count) * _built_size(seq), type(seq))
    return None


def render(template: jinja2.Template, variables: dict) -> str:
    """``template.render(**variables)`` under a fresh budget."""
    token = _BUDGET.set(_Budget())
    try:
        return template.render(**variables)
    finally:
        _BUDGET.reset(token)


# ---- sizes, from the operands -------------------------------------------------------------------------------------
def text_size(value: Any, limit: int = MAX_VALUE, indent: int = 0, separator: int = 2) -> int:
    """About how many characters ``str(value)`` (or its JSON, with ``indent``) has, found by walking the value
    without building the text: a list counts every item each time it appears. Stops soon after ``limit``."""
    total, stack = 0, [(value, 0)]
    while stack and total <= limit:
        item, depth = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item) + (2 if depth else 0)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() * 30103 // 100000 + 2
        elif isinstance(item, float):
            total += 24
        elif isinstance(item, (list, tuple, set, frozenset, dict, Namespace)):
            children: Any = item
            if isinstance(item, Namespace):
                children = object.__getattribute__(item, "_Namespace__attrs")
                total += 12
            if isinstance(children, dict):
                total += 2 + len(children) * (separator + 2 + indent * (depth + 1))
                stack.extend((x, depth + 1) for pair in children.items() for x in pair)
            else:
                total += 2 + len(children) * (separator + indent * (depth + 1))
                stack.extend((x, depth + 1) for x in children)
        elif isinstance(item, jinja2.Undefined):
            continue
        else:
            total += 64  # a loop, macro, cycler...: a short repr
    return total


def _check_text(value: Any, what: str) -> None:
    if not isinstance(value, str):
        size = text_size(value)
        if size > MAX_VALUE:
            raise _too_big(what, size)


def _bounded_str(value: Any) -> str:
    """``str(value)`` once its size is known to be within the limits (output of ``{{ ... }}``)."""
    if isinstance(value, str):
        return value
    _check_text(value, "printing this value")
    return _spend(str(value))


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default




def printf_size(template: str, args: Any) -> int:
    """About how long ``template % args`` is, from its field widths and precisions (``%0999999999d``,
    ``%*d`` with a width argument) and its arguments' text."""
    if isinstance(args, dict):
        values = list(args.values())
    elif isinstance(args, tuple):
        values = list(args)
    else:
        values = [args]
    size = len(template) + text_size(values)
    stars = [abs(v) for v in values if isinstance(v, int)]
    for number in printf_numbers(template):  # linear, nested %(keys) as Python reads them
        if number == "*":
            size += max(stars, default=0)
        else:
            size += int(number) if len(number) < 12 else MAX_VALUE + 1
        if size > MAX_VALUE:
            break
    return size


# format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?", re.DOTALL)


def _spec_size(spec: str) -> int:
    match = _FORMAT_SPEC.match(spec)
    size = 0
    for number in (match.group(1, 2) if match else ()):
        if number:
            size += int(number) if len(number) < 12 else MAX_VALUE + 1
    return size


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` whose result would be beyond the limits, before computing it."""
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, sequences) and isinstance(count, int) and len(seq) * count > _limit(seq):
                raise _too_big(f"{count} repetitions of {len(seq)} characters or items", len(seq) * count,
                               _limit(seq))
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBoundError(f"the product would have more than {MAX_INT_BITS} bits")
    elif operator == "**":
        plain = isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
        if plain and (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
            raise TemplateBoundError(f"{_short(left)} ** {_short(right)} would have more than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences) and len(left) + len(right) > _limit(left):
            raise _too_big("this sum", len(left) + len(right), _limit(left))
    elif operator == "%" and isinstance(left, str):
        size = printf_size(left, right)
        if size > MAX_VALUE:
            raise _too_big(f"{_short(left)} % ...", size)


def _short(value: Any) -> str:
    big = isinstance(value, int) and value.bit_length() >= 200
    text = f"<a {value.bit_length()}-bit int>" if big else repr(value)
    return text if len(text) <= 40 else text[:30] + "..."


# ---- string methods reached through call() -----------------------------------------------------------------------
def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _method_size(name: str, owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """(the result's size, the arguments to call with) of ``owner.name(*args, **kwargs)``."""
    if isinstance(owner, int) and not isinstance(owner, bool):
        if name == "to_bytes":
            return _int(_arg(args, kwargs, 0, "length", 1)), args
        return 0, args
    size = len(owner)
    if name in _SLOW:
        _check_slow(name, size)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(size, _int(_arg(args, kwargs, 0, "width"))), args
    if name == "expandtabs":
        tab = owner.count("\t" if isinstance(owner, str) else b"\t")
        return size + tab * max(0, _int(_arg(args, kwargs, 0, "tabsize", 8))), args
    if name == "join" and args:
        items = list(args[0])
        sep = size * max(0, len(items) - 1)
        return sep + sum(len(x) if isinstance(x, (str, bytes)) else 0 for x in items), (items, *args[1:])
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, (str, bytes)) and isinstance(new, (str, bytes)):
            count = size + 1 if not old else owner.count(old)
            limit = _int(_arg(args, kwargs, 2, "count", -1), -1)
            if limit >= 0:
                count = min(count, limit)
            return size + count * max(0, len(new) - len(old)), args
    if name == "translate" and args:
        table = args[0]
        values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
        longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
        return size * max(1, longest), args
    return 0, args


def _check_slow(name: str, size: int) -> None:
    if size > MAX_SLOW_TEXT:
        raise TemplateBoundError(f"{name} of {size} characters would take too long; chat templates {name} at most "
                                 f"{MAX_SLOW_TEXT}")


# ---- filters ------------------------------------------------------------------------------------------------------
# filters that turn their first argument into text: its text is sized first
_STRINGIFYING = {"string", "e", "escape", "forceescape", "safe", "striptags", "title", "capitalize", "upper",
                 "lower", "trim", "urlencode", "urlize", "wordcount", "truncate", "center", "indent", "wordwrap",
                 "replace", "format", "pprint", "xmlattr", "tojson"}


_PASSED = ("eval_ctx", "environment", "context")  # what Jinja passes a filter before its value


def _filter_size(name: str, a: dict, environment: jinja2.Environment) -> int:
    """The result's size of filter ``name`` called with the bound arguments ``a`` (may replace an iterable
    argument in ``a`` by the list it was read into)."""
    key = next((k for k in a if k not in _PASSED), None)
    value = a.get(key)
    text = len(value) if isinstance(value, str) else 0
    if name == "center":
        return max(text, _int(a.get("width")))
    if name == "indent":
        width = a.get("width")
        width = len(width) if isinstance(width, str) else _int(width)
        return text + (value.count("\n") + 1 if isinstance(value, str) else 1) * max(0, width)
    if name == "format":
        return printf_size(str(value), a.get("kwargs") or a.get("args") or ())
    if name == "join":
        items = list(value) if value is not None and not isinstance(value, jinja2.Undefined) else []
        a[key] = items
        if a.get("attribute") is not None:
            items = [make_attrgetter(environment, a["attribute"])(x) for x in items]
        d = a.get("d")
        return text_size(items, separator=len(d) if isinstance(d, str) else 0)
    if name == "replace":
        old, new = str(a.get("old", "")), str(a.get("new", ""))
        count = text + 1 if not old else str(value).count(old)
        if isinstance(a.get("count"), int) and a["count"] >= 0:
            count = min(count, a["count"])
        return text + count * max(0, len(new) - len(old))
    if name in _SLOW:
        _check_slow(name, text)
    if name == "wordwrap":
        wrap = a.get("wrapstring")
        wrap = len(wrap) if isinstance(wrap, str) else 1
        width = max(1, _int(a.get("width"), 79))
        longest = max((len(w) for w in value.split()), default=0) if isinstance(value, str) else 0
        if longest * longest // width > MAX_WRAP_WORK:
            raise TemplateBoundError(f"wordwrap of a {longest}-character word at width {width} would take too long")
        lines = 2 * text // width + (value.count("\n") if isinstance(value, str) else 0) + 2
        return text + lines * wrap
    if name in ("batch", "slice"):
        if a.get("fill_with") is not None or name == "slice":
            return _int(a.get("linecount", a.get("slices")))
        return 0
    if name == "tojson":
        indent = a.get("indent")
        indent = len(indent) if isinstance(indent, str) else _int(indent)
        separators = a.get("separators")
        sep = max((len(s) for s in separators if isinstance(s, str)), default=2) if isinstance(
            separators, (list, tuple)) else 2
        return text_size(value, indent=max(0, indent), separator=sep + 1)
    if name == "pprint":
        return text_size(value, indent=1)
    if name == "sum":
        items = list(value) if value is not None and not isinstance(value, jinja2.Undefined) else []
        a[key] = items
        start = a.get("start", 0)
        if isinstance(start, (list, tuple, str)) or any(isinstance(x, (list, tuple)) for x in items):
            return sum(len(x) for x in [start, *items] if isinstance(x, (list, tuple, str)))
        return 0
    return 0


def _sum(environment: jinja2.Environment, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum``, adding lists or tuples in one pass (sized first) instead of quadratic ``+`` steps."""
    items = list(iterable)
    if attribute is not None:
        items = [make_attrgetter(environment, attribute)(x) for x in items]
    kind = type(start)
    if kind in (list, tuple) and all(type(x) is kind for x in items):
        return kind(x for part in (start, *items) for x in part)
    return sum(items, start)


_sum = jinja2.pass_environment(_sum)


# filters whose result's size depends on their arguments (widths, counts, separators): sized by _filter_size
_SIZED = {"center", "indent", "format", "join", "replace", "wordwrap", "batch", "slice", "tojson", "pprint", "sum",
          "urlize", "striptags"}


def _bounded_filter(name: str, function: Callable, environment: jinja2.Environment) -> Callable:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None
    passed = 1 if hasattr(function, "jinja_pass_arg") else 0  # the context, eval context or environment first
    parameters = [p for p in signature.parameters if p not in _PASSED] if signature is not None else []
    first_name = parameters[0] if parameters else None

    def filter_(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if name in _STRINGIFYING:
            first = args[passed] if len(args) > passed else kwargs.get(first_name)
            _check_text(first, f"the filter '{name}' of this value")
        if name in _SIZED and signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                bound = None  # the filter itself says what is wrong
            if bound is not None:
                bound.apply_defaults()
                size = _filter_size(name, bound.arguments, environment)
                limit = MAX_ITEMS if name in ("batch", "slice", "sum") else MAX_VALUE
                if size > limit:
                    raise _too_big(f"the filter '{name}'", size, limit)
                args, kwargs = bound.args, bound.kwargs
        return _spend(function(*args, **kwargs))

    update_wrapper(filter_, function)  # keeps jinja_pass_arg (context, eval_ctx, environment)
    filter_.__wrapped__ = function
    return filter_


@jinja2.pass_context
def _loop_guard(context: Any, iterable: Any) -> Any:
    """What every ``for`` loop iterates: its iterable, each item counted as a step."""
    budget = _BUDGET.get()
    for item in iterable:
        if budget is not None:
            budget.tick()
        yield item


def _range(*args: Any) -> range:
    numbers = range(*args)
    if len(numbers) > MAX_RANGE:
        raise TemplateBoundError(f"range() of {len(numbers)} numbers; chat templates may count to at most "
                                 f"{MAX_RANGE} (as Jinja's sandbox)")
    return numbers


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - Jinja's names
    from jinja2.utils import generate_lorem_ipsum

    if _int(n) * _int(max) * 16 > MAX_VALUE:
        raise _too_big("lipsum()", _int(n) * _int(max) * 16)
    return generate_lorem_ipsum(n, html, min, max)


# ---- the environment ----------------------------------------------------------------------------------------------
class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` joined by ``environment.bounded_join``, which sizes the pieces' text first; list, tuple and dict
    literals sized as they are built (``environment.built``)."""

    def _built(visit: Callable) -> Callable:  # noqa: N805 - a decorator of this class's visitors
        def visitor(self: CodeGenerator, node: nodes.Expr, frame: Any) -> None:
            if getattr(node, "ctx", "load") != "load":  # a tuple being assigned to (a for loop's target)
                visit(self, node, frame)
                return
            self.write("environment.built(")
            visit(self, node, frame)
            self.write(")")

        return visitor

    visit_List = _built(CodeGenerator.visit_List)
    visit_Tuple = _built(CodeGenerator.visit_Tuple)
    visit_Dict = _built(CodeGenerator.visit_Dict)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"environment.bounded_join({func_name}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` fields sized before they are formatted, and the whole text as it is built."""

    def __init__(self, env: jinja2.Environment, **kwargs: Any) -> None:
        super().__init__(env, **kwargs)
        self.size = 0

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            _check_text(value, f"the format field !{conversion}")
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        _tick()
        self.size += max(_spec_size(format_spec), text_size(value)) + _spec_size(format_spec)
        if self.size > MAX_VALUE:
            raise _too_big("str.format()", self.size)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, SandboxedEscapeFormatter):
    pass


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, bounded (module docstring)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, finalize=_bounded_str, **kwargs)
        self.globals["range"] = _range
        self.globals["lipsum"] = _lipsum
        self.filters["sum"] = _sum

    def bound_filters(self) -> None:
        """Wrap every filter (once the caller has added its own, e.g. tojson) in the size checks."""
        self.filters = {name: _bounded_filter(name, f, self) for name, f in self.filters.items()}
        self.filters[LOOP_GUARD] = _loop_guard

    # compile: the source's size, and every loop's iterable counted
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateBoundError(f"the template is {len(source)} characters long; chat templates are read up "
                                     f"to {MAX_TEMPLATE_CHARS}")
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            guarded = nodes.Filter(loop.iter, LOOP_GUARD, [], [], None, None, lineno=loop.iter.lineno)
            guarded.set_environment(self)
            loop.iter = guarded
        return tree

    # runtime hooks: each a step, each sized before it runs
    def concat(self, pieces: Any) -> str:  # noqa: D102 - Environment.concat, used for every output buffer
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > MAX_VALUE:
                raise _too_big("the rendered text", size)
            out.append(piece)
        return _spend("".join(out))

    def bounded_join(self, join: Callable, pieces: tuple) -> str:
        _tick()
        size = sum(len(p) if isinstance(p, str) else text_size(p) for p in pieces)
        if size > MAX_VALUE:
            raise _too_big("this ~ join", size)
        return _spend(join(pieces))

    def built(self, value: Any) -> Any:
        """A list, tuple or dict literal's value, sized (``_built_size``)."""
        _tick()
        return _spend(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        check_binop(operator, left, right)
        size = _binop_size(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if size is not None:
            _record_size(result, size)  # so that _spend does not walk the result again
        return _spend(result)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's names
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)) and isinstance(owner, (str, bytes, int)):
            size, args = _method_size(__obj.__name__, owner, args, kwargs)
            if size > MAX_VALUE:
                raise _too_big(f"{type(owner).__name__}.{__obj.__name__}()", size)
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(items): items counted too
            args = (_loop_guard(__context, args[0]), *args[1:])
        return _spend(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        owner = value.__self__
        formatter = (_BoundedEscapeFormatter(self, escape=owner.escape) if isinstance(owner, Markup)
                     else _BoundedFormatter(self))
        is_format_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                kwargs, args = args[0], ()
            formatter.size = len(owner)
            return _spend(type(owner)(formatter.vformat(owner, args, kwargs)))

        return update_wrapper(bounded, value)
