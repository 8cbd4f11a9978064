"""The width and precision fields of a printf-style format (``template % args``), found in one linear pass, as
Python parses them, so that both bounded evaluators (chat templates, ``text/bounded_jinja.py``; recipe
expressions, ``recipe/safe_eval.py``) can size ``template % args`` before formatting it.

A regular expression is not enough here: ``%(name)`` keys nest parentheses (``'%(a(b)c)999999999s'`` is the key
``a(b)c`` with width 999999999, which ``%(?:\\([^)]*\\))?`` misreads), and a pattern that looks for the key's
``)`` from every ``%(`` rescans the rest of the text each time (``'%(' * n`` took quadratic time).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_PAREN = re.compile(r"[()]")
_DIGITS = re.compile(r"\d*")
_FLAGS = re.compile(r"[-+ #0]*")


def printf_numbers(template: str) -> Iterator[str]:
    """Each width and precision of ``template``'s conversion fields, as written: ``'*'`` (taken from the
    arguments) or a string of digits (``'%(k)-*.5f %10s'`` gives ``'*'``, ``'5'``, ``'10'``). Stops where Python's
    own parser would fail (an unclosed key, a format ending inside a field): formatting then raises anyway."""
    end = len(template)
    at = template.find("%")
    while 0 <= at < end - 1:
        i = at + 1
        if template[i] == "(":  # a mapping key: parentheses nest, as in CPython's parser
            depth, i = 1, i + 1
            while depth:
                found = _PAREN.search(template, i)
                if found is None:
                    return  # "incomplete format key"
                depth += 1 if found.group() == "(" else -1
                i = found.end()
        i = _FLAGS.match(template, i).end()
        for _ in range(2):  # the width, then (after '.') the precision
            if i < end and template[i] == "*":
                yield "*"
                i += 1
            else:
                digits = _DIGITS.match(template, i).end()
                if digits > i:
                    yield template[i:digits]
                i = digits
            if i < end and template[i] == ".":
                i += 1
            else:
                break
        if i < end and template[i] in "hlL":
            i += 1
        if i >= end:
            return  # "incomplete format"
        at = template.find("%", i + 1)  # past the conversion character (which may itself be '%')
