"""Tiny checkpoints for the text-generation tests, saved by transformers with real tokenizers.

``llama_tokenizer``: a byte-level BPE trained by the ``tokenizers`` package on a small English/French/emoji corpus
(Llama 3's layout: ``<|begin_of_text|>`` added by the post-processor, the header and ``<|eot_id|>`` special tokens,
Llama 3's chat template), saved by transformers' ``PreTrainedTokenizerFast``. ``save_llama``: a
``LlamaForCausalLM`` with a vocabulary of that tokenizer's size, its generation_config naming ``<|eot_id|>`` and
``<|end_of_text|>`` as EOS.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "Une phrase en français, avec des accents: é è à ç ô. Ça marche très bien!",
    "Emoji and symbols: 🦊 🌍 ✨ — “quotes” and 日本語のテキスト.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers 0123456789 and punctuation ,.;:!? ()[]{}",
] * 4

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Llama 3.1's template, shortened to what these tests use (system + user messages, generation prompt)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
    "+ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def llama_tokenizer(folder: Path, vocab: int = 384):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIAL), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def save_llama(folder: Path, seed: int = 0, layers: int = 2, **overrides):
    """A tiny Llama with the test tokenizer, saved by transformers; returns the model (eval mode)."""
    import torch
    import transformers

    tokenizer = llama_tokenizer(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.convert_tokens_to_ids("<|end_of_text|>"),
                                                          tokenizer.eos_token_id], **overrides)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    return model


RECIPES = Path(__file__).resolve().parents[3] / "recipes"


TEKKEN = RECIPES / "flux2-tiny" / "checkpoint" / "tokenizer"  # mistral-common's Tekken, converted by transformers


def save_mistral(folder: Path, seed: int = 0, sliding_window: int | None = 8):
    """A tiny MistralForCausalLM (tied embeddings, a short sliding window) with Mistral's real Tekken tokenizer
    and the Mistral-Small-3.2 chat template, saved by transformers; returns the model (eval mode)."""
    import shutil

    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TEKKEN / name, folder / name)
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))  # (transformers' loads in seconds)
    torch.manual_seed(seed)
    config = transformers.MistralConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
        max_position_embeddings=512, sliding_window=sliding_window, tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id("<s>"), eos_token_id=tokenizer.token_to_id("</s>"))
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model
