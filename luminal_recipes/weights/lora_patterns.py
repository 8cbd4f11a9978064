"""PEFT's ``rank_pattern``/``alpha_pattern`` keys matched against layer names in time linear in the name.

PEFT (``peft.utils.other.get_pattern_key``) takes the first key ``k``, in the dict's order, for which
``re.match(rf"(.*\\.)?({k})$", name)`` matches: ``k`` is a regular expression matched against a suffix of the
layer's name that starts at the name's start or after a dot. The keys come from the LoRA file (its
``lora_adapter_metadata`` header or ``adapter_config.json``), so they are untrusted: Python's backtracking ``re``
takes exponential time on ``(a|aa)+`` against a long name (41 characters: 16 s). Here the same expression is
parsed by Python's own parser (so what is a valid key, and what it means, is exactly ``re``'s), compiled into a
Thompson NFA and run as a lazily built DFA (the RE2 approach): one pass over the name, no backtracking, whatever
the key. Constructs that need backtracking (backreferences, lookarounds, conditionals, atomic groups, possessive
repeats) are refused with the key named, and so are keys longer than ``MAX_KEY_CHARS`` or whose automaton
exceeds ``MAX_STATES`` (a counted repeat such as ``(a{100}){100}`` expands).

A key without a repeat or a branch of its own (a module name, ``blocks.0.attn``: the common case) cannot make ``re``
backtrack beyond PEFT's ``(.*\\.)?`` wrapper (time ``len(name) * len(key)``), so ``re`` itself matches it. One dict
holds at most ``MAX_KEYS`` keys and ``MAX_TOTAL_STATES`` automaton states in all: each key is bounded, but building
thousands of large automata took minutes (400 keys ``[a-z]{4990}N``, a 10 KB header: 21 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

try:  # Python 3.11+: the parser and compiler behind ``re``
    import re._compiler as _compiler
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - older layouts
    import sre_compile as _compiler  # type: ignore[no-redef]
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]
import re
import warnings

_PREFIX_CHARS = len("(.*\\.)?(")  # PEFT's wrapper before the key
MAX_KEY_CHARS = 500  # PEFT keys are module names or short expressions
MAX_STATES = 5000  # NFA states of one key, counted repeats expanded
MAX_DFA_CACHE = 20000  # cached transitions per key before the cache is dropped (memory stays bounded)
MAX_KEYS = 4096  # keys of one pattern dict: a model has at most a few thousand LoRA layers to name
MAX_TOTAL_STATES = 50_000  # automaton states of all the keys of one dict (building them takes ~10 us a state)

_ATOMS = (_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN)
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)
_NAMES = {  # constructs refused, in words
    "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional group", "ASSERT": "a lookahead/lookbehind",
    "ASSERT_NOT": "a negative lookahead/lookbehind", "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repeat",
}


class PatternError(ValueError):
    """A key that is not a regular expression, or one this matcher refuses; the message says why."""


class _TooBig(Exception):
    pass


class PeftPattern:
    """One key of a PEFT pattern dict, compiled; ``matches(name)`` is ``re.match(rf"(.*\\.)?({key})$", name)``
    as a truth value, in time linear in ``len(name)``."""

    def __init__(self, key: str):
        if len(key) > MAX_KEY_CHARS:
            raise PatternError(f"the key {_shown(key)} is {len(key)} characters long (at most {MAX_KEY_CHARS})")
        self.key = key
        source = rf"(.*\.)?({key})$"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # re's FutureWarnings (a possible nested set...)
                re.compile(source)  # what PEFT compiles: the same errors, the same meaning
                tree = _parser.parse(source)
        except re.error as exc:
            at = f" at character {max(0, exc.pos - _PREFIX_CHARS)}" if exc.pos is not None else ""
            raise PatternError(f"the key {_shown(key)} is not a regular expression ({exc.msg}{at})") from None
        except RecursionError:
            raise PatternError(f"the key {_shown(key)} nests too deep") from None
        self.asserts: list[Callable] = []  # zero-width tests (``$``, ``\b``...), by index
        self.states: list[list] = []
        self.fast: Callable | None = None
        if _fixed(list(tree)) == 2:  # no repeat or branch of its own (only the wrapper's two): ``re`` is linear
            self.fast = re.compile(source).match  # module names, "blocks.0.attn" (the common keys), at C speed
            return
        self._work = 0  # items built, repeats expanded: bounded even where they add no state (``(?:){10**9}``)
        try:
            match = self._new(["m"])
            self.start = self._seq(list(tree), match, tree.state.flags, tree.state)
        except _TooBig:
            raise PatternError(f"the key {_shown(key)} expands to more than {MAX_STATES} automaton states") from None
        except RecursionError:
            raise PatternError(f"the key {_shown(key)} nests too deep") from None
        self._closures: dict = {}
        self._steps: dict = {}

    # -- building the NFA: states are ["c", test, next] (one character), ["e", nexts] (a choice),
    #    ["a", assert index, next] (zero-width), ["m"] (match) ----------------------------------------------------
    def _new(self, state: list) -> int:
        if len(self.states) >= MAX_STATES:
            raise _TooBig
        self.states.append(state)
        return len(self.states) - 1

    def _seq(self, items: list, nxt: int, flags: int, state) -> int:
        self._work += 1
        if self._work > 4 * MAX_STATES:
            raise _TooBig
        for item in reversed(items):
            nxt = self._one(item, nxt, flags, state)
        return nxt

    def _one(self, item: tuple, nxt: int, flags: int, state) -> int:
        op, av = item
        if op in _ATOMS:
            test = _compiler.compile(_parser.SubPattern(state, [item]), flags).match
            return self._new(["c", test, nxt])
        if op is _c.AT:
            test = _compiler.compile(_parser.SubPattern(state, [item]), flags).match
            self.asserts.append(test)
            return self._new(["a", len(self.asserts) - 1, nxt])
        if op is _c.BRANCH:
            return self._new(["e", [self._seq(list(branch), nxt, flags, state) for branch in av[1]]])
        if op is _c.SUBPATTERN:
            _group, add, remove, sub = av
            return self._seq(list(sub), nxt, (flags | add) & ~remove, state)
        if op in _REPEATS:
            low, high, sub = av
            if high is _c.MAXREPEAT or high == _c.MAXREPEAT:
                loop = self._new(["e", [None, nxt]])
                self.states[loop][1][0] = self._seq(list(sub), loop, flags, state)
                tail = loop
            else:
                tail = nxt
                for _ in range(high - low):
                    tail = self._new(["e", [self._seq(list(sub), tail, flags, state), nxt]])
            for _ in range(low):
                tail = self._seq(list(sub), tail, flags, state)
            return tail
        what = _NAMES.get(str(op), f"the construct {op}")
        raise PatternError(f"the key {_shown(self.key)} uses {what}, which needs backtracking; write the module name "
                           f"or a plain regular expression")

    # -- running it ----------------------------------------------------------------------------------------------
    def _closure(self, seeds: frozenset, context: tuple) -> tuple[tuple, bool]:
        """The character states reachable from ``seeds`` without consuming (asserts decided by ``context``), and
        whether the match state is among them."""
        key = (seeds, context)
        found = self._closures.get(key)
        if found is not None:
            return found
        stack, seen, chars, matched = list(seeds), set(seeds), [], False
        while stack:
            index = stack.pop()
            state = self.states[index]
            kind = state[0]
            if kind == "c":
                chars.append(index)
                continue
            if kind == "m":
                matched = True
                continue
            nexts = state[1] if kind == "e" else ([state[2]] if context[state[1]] else [])
            for n in nexts:
                if n not in seen:
                    seen.add(n)
                    stack.append(n)
        found = (tuple(sorted(chars)), matched)
        if len(self._closures) > MAX_DFA_CACHE:
            self._closures.clear()
        self._closures[key] = found
        return found

    def _step(self, chars: tuple, ch: str) -> frozenset:
        key = (chars, ch)
        found = self._steps.get(key)
        if found is None:
            found = frozenset(self.states[i][2] for i in chars if self.states[i][1](ch))
            if len(self._steps) > MAX_DFA_CACHE:
                self._steps.clear()
            self._steps[key] = found
        return found

    def matches(self, name: str) -> bool:
        if self.fast is not None:
            return self.fast(name) is not None
        seeds = frozenset((self.start,))
        for pos in range(len(name) + 1):
            context = tuple(test(name, pos) is not None for test in self.asserts)
            chars, matched = self._closure(seeds, context)
            if matched:
                return True  # re.match needs a match from the start, not one through the end
            if pos == len(name) or not chars:
                return False
            seeds = self._step(chars, name[pos])
        return False


def compile_patterns(patterns: dict, where: str, error: type[Exception]) -> list[tuple[PeftPattern, object]]:
    """A PEFT pattern dict's keys compiled, in order, with their values; ``error`` naming ``where`` and the key
    for one that is not a regular expression or is refused."""
    if len(patterns) > MAX_KEYS:
        raise error(f"{where}: {len(patterns)} keys, more than the {MAX_KEYS} this tool reads (a model has at most "
                    f"a few thousand layers to name)")
    out, states = [], 0
    for key, value in patterns.items():
        if not isinstance(key, str):
            raise error(f"{where}: the key {key!r} is not a string")
        try:
            out.append((PeftPattern(key), value))
        except PatternError as exc:
            raise error(f"{where}: {exc}") from None
        states += len(out[-1][0].states)
        if states > MAX_TOTAL_STATES:  # each key within MAX_STATES, but building thousands of them takes minutes
            raise error(f"{where}: the keys together expand to more than {MAX_TOTAL_STATES} automaton states "
                        f"(at {_shown(key)}); name the modules, or use fewer and simpler expressions")
    return out


def _fixed(items: list) -> int | None:
    """How many repeats a parsed expression holds, or None if it holds a branch or anything but plain
    characters, zero-width tests and groups (then it needs the automaton, or is refused there)."""
    count = 0
    for op, av in items:
        if op in _ATOMS or op is _c.AT:
            continue
        if op is _c.SUBPATTERN:
            inner = _fixed(list(av[3]))
        elif op in _REPEATS:
            inner = _fixed(list(av[2]))
            inner = None if inner is None else inner + 1
        else:
            return None
        if inner is None:
            return None
        count += inner
    return count


def first_match(compiled: Iterable[tuple[PeftPattern, object]], name: str):
    """PEFT's ``get_pattern_key`` then ``dict.get``: the value of the first key matching ``name``, or None."""
    for pattern, value in compiled:
        if pattern.matches(name):
            return value
    return None


def _shown(key: str, limit: int = 60) -> str:
    return repr(key) if len(key) <= limit else repr(key[:limit]) + "..."
