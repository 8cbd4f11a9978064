"""Writes the tiny language-model checkpoints the text goldens run on (``tests/golden/checkpoints/``): each a
2-layer model of a shipped recipe's architecture, saved by transformers from seeded random initialisation, with a
real byte-level BPE tokenizer (trained by the ``tokenizers`` package on a small corpus) and a chat template.
Their replies are gibberish (random weights); the token ids are what the goldens pin, and
``tests/golden/test_text_goldens.py`` checks them against transformers' own ``generate``.

    python tests/golden/make_text_checkpoints.py            # needs the test extra (torch, transformers)
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tasks" / "generation"))

# Mistral v0.3's [INST] format, for the tiny Mistral (its real Tekken vocabulary is too large to commit)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('only user and assistant messages') }}{%- endif %}{%- endfor %}"
)


def make_llama(folder: Path) -> None:
    from generation_checkpoints import save_llama

    save_llama(folder, seed=0)


def make_mistral(folder: Path) -> None:
    import torch
    import transformers
    from generation_checkpoints import llama_tokenizer

    tokenizer = llama_tokenizer(folder)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
        max_position_embeddings=256, sliding_window=16, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    transformers.MistralForCausalLM(config).eval().save_pretrained(folder)


def tiny(model_class: str, seed: int):
    """A maker for the tiny checkpoint of one architecture of tests/recipe/llm_checkpoints.py (its parity tests'
    sizes), saved with the test tokenizer."""

    def make(folder: Path) -> None:
        sys.path.insert(0, str(HERE.parent / "recipe"))
        from llm_checkpoints import save_tiny

        save_tiny(folder, model_class, seed=seed, tokenizer=True)

    return make


MAKERS = {"llama-tiny": make_llama, "mistral-tiny": make_mistral,
          "qwen3-tiny": tiny("Qwen3ForCausalLM", 2), "qwen3-moe-tiny": tiny("Qwen3MoeForCausalLM", 3),
          "gemma3-tiny": tiny("Gemma3ForCausalLM", 4), "gemma4-moe-tiny": tiny("Gemma4ForCausalLM", 5),
          "gpt2-tiny": tiny("GPT2LMHeadModel", 6)}


def main() -> None:
    wanted = sys.argv[1:] or list(MAKERS)  # names: only those checkpoints
    for name, make in MAKERS.items():
        if name not in wanted:
            continue
        folder = HERE / "checkpoints" / name
        folder.mkdir(parents=True, exist_ok=True)
        make(folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
