"""`luminal-recipe chat`: a conversation with a language model on the terminal, as llama.cpp's conversation mode.

Each line read from stdin is a user turn; the whole conversation (an optional system message, then the user and
assistant turns so far) is rendered by the checkpoint's chat template with the generation prompt, exactly as
transformers' ``apply_chat_template(messages, add_generation_prompt=True)``, and the reply is streamed to stdout
as it is decoded, then kept as the assistant's turn. When the conversation and the longest reply
(``max_new_tokens``) no longer fit the context, the oldest turns (a user turn and its reply) are dropped, and a line
on stderr says so. ``/reset`` forgets the conversation (the system message stays), ``/exit`` (or the end of
stdin, Ctrl-D) ends it. Everything but the replies goes to stderr; the ``> `` prompt is printed only when stdin
is a terminal.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from ...errors import InputError, LuminalError, NonFiniteError
from ...text.chat_template import render_chat

COMMANDS = {"/exit": "end the conversation", "/reset": "forget the conversation (the system message stays)",
            "/help": "list these commands"}


@dataclass
class Conversation:
    """The turns so far, and the ids of the conversation with the next user turn, fitted into the context."""

    model: Any  # a LanguageModel
    system: str | None = None
    chat_vars: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, str]] = field(default_factory=list)  # user, assistant, user, assistant...

    def messages(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system is not None else []) + turns

    def render(self, turns: list[dict[str, str]]) -> list[int]:
        tok = self.model.tokenizer
        text = render_chat(tok.chat_template, self.messages(turns), tok.special_tokens, tok.template_source,
                           add_generation_prompt=True, variables=dict(self.chat_vars),
                           refused_hint="drop --system, or /reset to start the conversation over")
        return tok.encode(text, add_special_tokens=False)

    def fit(self, user: str, max_new_tokens: int) -> tuple[list[int], int]:
        """The ids of the conversation with ``user`` as its next turn, dropping the oldest turns (user and reply)
        until they and ``max_new_tokens`` fit the context; returns (ids, turns dropped). A turn too long on its
        own is refused (InputError)."""
        limit = self.model.context or self.model.max_context
        turns = [*self.turns, {"role": "user", "content": user}]
        dropped = 0
        while True:
            ids = self.render(turns)
            if len(ids) + max_new_tokens <= limit or len(turns) == 1:
                break
            turns = turns[2:]  # the oldest user turn and its reply
            dropped += 1
        if len(ids) >= limit:
            raise InputError(f"this message is {len(ids)} tokens long with the chat template; {self.model.name} "
                             f"takes at most {limit} tokens of prompt and reply together. Shorten it (or pass a "
                             f"larger --context, up to {self.model.max_context}).")
        self.turns = turns[:-1]
        return ids, dropped


@dataclass
class ChatOptions:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)

    def sampling(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": self.repetition_penalty, "seed": self.seed,
                "stop": list(self.stop)}


def chat_loop(model, options: ChatOptions, system: str | None = None, chat_vars: dict[str, Any] | None = None,
              stdin: IO[str] | None = None, out: IO[str] | None = None, err: IO[str] | None = None,
              interactive: bool | None = None) -> int:
    """Run the conversation on ``stdin`` until ``/exit`` or its end; returns the number of replies given."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    if interactive is None:
        interactive = stdin.isatty()
    if model.tokenizer.chat_template is None:
        raise InputError(f"{model.checkpoint}: the checkpoint has no chat template (chat_template.jinja, or "
                         f"chat_template in tokenizer_config.json), so it cannot hold a conversation; use "
                         f"`luminal-recipe run --no-chat` to continue a text instead.")
    model.tokenizer.render("hello", system, dict(chat_vars or {}))  # --system and --chat-var checked up front
    conversation = Conversation(model, system, dict(chat_vars or {}))
    limit = model.context or model.max_context

    def say(message: str) -> None:
        print(message, file=err, flush=True)

    say(f"{model.name}: chatting (context {limit} tokens, replies up to {options.max_new_tokens}); "
        f"/reset forgets the conversation, /exit ends it")
    replies = 0
    seed = options.seed
    while True:
        if interactive:
            err.write("> ")
            err.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n").rstrip("\r")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            conversation.turns = []
            say("(conversation reset)")
            continue
        if command == "/help" or (command.startswith("/") and " " not in command):
            say("commands: " + "; ".join(f"{name}: {doc}" for name, doc in COMMANDS.items())
                + ("" if command == "/help" else f" (not a command: {command})"))
            continue
        try:
            ids, dropped = conversation.fit(text, options.max_new_tokens)
        except NonFiniteError:
            raise
        except LuminalError as exc:  # one bad message (too long, text the checks refuse) ends that turn only
            say(f"error: {exc}")
            continue
        if dropped:
            say(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit the context of {limit} "
                f"tokens)")
        sampling = options.sampling()
        sampling["seed"] = seed
        t0 = time.perf_counter()
        result = model.generate(ids, **sampling, on_text=lambda piece: (out.write(piece), out.flush()))
        out.write("\n")
        out.flush()
        seed += 1  # sampled replies differ from turn to turn, and a rerun of the session repeats them
        conversation.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": result.text}]
        replies += 1
        row = result.summary()
        say(f"[{row['generated_tokens']} tokens, {row['finish_reason']}, {len(ids)} in context; "
            f"{time.perf_counter() - t0:.1f} s]")
    return replies
