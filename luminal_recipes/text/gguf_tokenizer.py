"""A GGUF file's tokenizer, built with the ``tokenizers`` library from its ``tokenizer.*`` metadata as
transformers builds it (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``: ``get_gguf_tokenizer`` and
``convert_gguf_tokenizer`` in transformers/integrations/gguf/gguf_tokenizer_mapping.py, then the model type's
tokenizer class), so that the ids are the same:

* ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE (GPT2Tokenizer): tokens respelled in the byte alphabet, the
  file's merges, ByteLevel pre-tokenizer and decoder; the split regex of ``tokenizer.ggml.pre`` where transformers
  knows one (``SPLITS``), else GPT-2's;
* ``llama`` (SentencePiece as BPE, LlamaTokenizer): byte fallback, Metaspace with a prefix space, merges from the
  file or derived from the scores; Gemma files (architecture gemma*) as GemmaTokenizer builds them;
* control tokens (token type 3) become special added tokens, user-defined ones (4) plain added tokens; the named
  special tokens (``bos/eos/unknown/padding_token_id``) and each class's own defaults are added as special;
* ``add_bos_token``/``add_eos_token`` (default: BOS for SentencePiece files) set the post-processor.

Keys that change the ids but that this module does not implement are refused naming the key (``REFUSED``).
The chat template is ``tokenizer.chat_template``; generation stops at ``tokenizer.ggml.eos_token_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from .. import heap
from ..errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4
# tokenizer.ggml.pre -> the split regex transformers' GGUF loader applies (GGUF_PRE_TOKENIZER_SPLITS)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN35 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# special tokens each builder's tokenizer class adds as its defaults (transformers adds them when missing, in the
# order of SPECIAL_TOKENS_ATTRIBUTES: bos, eos, unk, sep, pad, cls, mask)
INNER_DEFAULTS = {"gpt2": ("<|endoftext|>",), "llama": ("<s>", "</s>", "<unk>"),
                  "gemma": ("<bos>", "<eos>", "<unk>", "<pad>", "<mask>")}
# extra named special tokens the model type's tokenizer class keeps by default (GemmaTokenizer's mask token)
OUTER_DEFAULTS = {"gemma3_text": {"mask_token": "<mask>"}}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
NAMED_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
# tokenizer.* keys read here, and those that cannot change the ids of a prompt or the reply's text
READ = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"}
IGNORED = {
    "tokenizer.ggml.add_space_prefix": "transformers' GGUF tokenizers take the prefix space from the tokenizer "
                                       "class (SentencePiece: always; byte-level BPE: never), as here",
    "tokenizer.ggml.eot_token_id": "llama.cpp's end-of-turn id; transformers stops at eos_token_id only",
    "tokenizer.ggml.eom_token_id": "llama.cpp's end-of-message id; transformers stops at eos_token_id only",
    "tokenizer.ggml.sep_token_id": "used by encoders (pairs of texts), not by text generation",
    "tokenizer.ggml.cls_token_id": "used by encoders, not by text generation",
    "tokenizer.ggml.mask_token_id": "used by masked-language encoders, not by text generation",
    "tokenizer.ggml.add_sep_token": "used by encoders (pairs of texts), not by text generation",
    "tokenizer.ggml.fim_pre_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
    "tokenizer.ggml.fim_suf_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
    "tokenizer.ggml.fim_mid_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
    "tokenizer.ggml.fim_pad_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
    "tokenizer.ggml.fim_rep_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
    "tokenizer.ggml.fim_sep_token_id": "fill-in-the-middle ids of llama.cpp's infill API, not read by generation",
}


@dataclass
class GgufTokenizer:
    """What ``TextTokenizer`` needs: the backend, the named special tokens, the chat template, the EOS ids."""

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str]
    chat_template: str | None
    template_source: str
    eos_ids: list[int]


def load_gguf_tokenizer(checkpoint: Any) -> GgufTokenizer:
    """The tokenizer of a :class:`~luminal_recipes.weights.gguf_io.GgufCheckpoint` (or of a .gguf path)."""
    if isinstance(checkpoint, (str, Path)):
        from ..weights.gguf_io import GgufCheckpoint

        checkpoint = GgufCheckpoint.open(checkpoint)
    path = checkpoint.root
    value = checkpoint.value
    for key in checkpoint.metadata_keys():
        if key.startswith("tokenizer.") and key not in READ and key not in IGNORED and \
                not key.startswith("tokenizer.chat_template."):
            raise CheckpointError(f"{path}: metadata key '{key}' changes how text becomes ids in llama.cpp, and "
                                  f"this GGUF tokenizer does not implement it; use the model's tokenizer.json "
                                  f"(its safetensors checkpoint) instead.")
    model = value("tokenizer.ggml.model")
    tokens = value("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise CheckpointError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.model and "
                              f"tokenizer.ggml.tokens); generating text needs one. Convert the model again with its "
                              f"tokenizer.")
    types = value("tokenizer.ggml.token_type") or []
    architecture = checkpoint.architecture
    if model == "gpt2":
        backend, alphabet = _byte_level(path, tokens, value("tokenizer.ggml.merges")), set(_bytes_to_unicode().values())
        inner = "gpt2"
    elif model == "llama":
        gemma = architecture in GEMMA_ARCHITECTURES
        backend = _gemma(tokens) if gemma else _sentencepiece(path, tokens, value("tokenizer.ggml.merges"),
                                                              value("tokenizer.ggml.scores"))
        alphabet, inner = None, "gemma" if gemma else "llama"
    else:
        raise CheckpointError(f"{path}: tokenizer.ggml.model is '{model}'; the GGUF tokenizers implemented are "
                              f"'gpt2' (byte-level BPE) and 'llama' (SentencePiece). Use the model's tokenizer.json "
                              f"(its safetensors checkpoint) instead.")
    _add_special(backend, INNER_DEFAULTS[inner])
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
    split = SPLITS.get(value("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special: dict[str, str] = {}
    for name, key in NAMED_IDS.items():
        token_id = value(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
                raise CheckpointError(f"{path}: tokenizer.ggml.{key} is {token_id!r}, not an id of the "
                                      f"{len(tokens)}-token vocabulary; the file is corrupt.")
            special[name] = tokens[token_id]
    model_type = checkpoint.config.get("model_type")
    for name, token in OUTER_DEFAULTS.get(model_type, {}).items():
        special.setdefault(name, token)
    _add_special(backend, list(special.values()))
    add_bos = value("tokenizer.ggml.add_bos_token", True if model == "llama" else None)
    add_eos = value("tokenizer.ggml.add_eos_token")
    if add_bos is not None or add_eos is not None or backend.post_processor is None:
        _post_processor(backend, special, bool(add_bos), bool(add_eos))
    backend.no_padding()
    backend.no_truncation()
    template = value("tokenizer.chat_template")
    found = GgufTokenizer(backend, special, template, f"{path} (tokenizer.chat_template)", gguf_eos_ids(checkpoint))
    # the vocabulary's and merges' Python lists and tokenizers' scratch, freed but kept resident by malloc (~9 MiB
    # of SmolLM2's 49k-token vocabulary, in every later peak)
    del tokens, types
    heap.trim()
    return found


def gguf_eos_ids(checkpoint: Any) -> list[int]:
    """The ids generation stops at: ``tokenizer.ggml.eos_token_id`` of a GGUF checkpoint (or .gguf path), read
    from the metadata without building the tokenizer."""
    if isinstance(checkpoint, (str, Path)):
        from ..weights.gguf_io import GgufCheckpoint

        checkpoint = GgufCheckpoint.open(checkpoint)
    eos = checkpoint.value("tokenizer.ggml.eos_token_id")
    return [eos] if isinstance(eos, int) and not isinstance(eos, bool) else []


def _add_special(backend: tokenizers.Tokenizer, tokens) -> None:
    """Special tokens not yet added tokens (``TokenizersBackend.__init__``: even ones in the vocabulary)."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(tokens) if t not in added]
    if missing:
        backend.add_tokens([AddedToken(t, special=True) for t in missing])


def _post_processor(backend: tokenizers.Tokenizer, special: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    """``TokenizersBackend.update_post_processor``."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    ids = ([(bos, backend.token_to_id(bos))] if add_bos else []) + ([(eos, backend.token_to_id(eos))] if add_eos
                                                                     else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``convert_slow_tokenizer.bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges(path: Path, merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens separated by "
                                  f"one space; the file is corrupt.")
        out.append((parts[0], parts[1]))
    return out


def _byte_level(path: Path, tokens: list[str], merges: list[str] | None) -> tokenizers.Tokenizer:
    if merges is None:
        raise CheckpointError(f"{path}: a byte-level BPE tokenizer (tokenizer.ggml.model gpt2) needs "
                              f"tokenizer.ggml.merges, which the file lacks; convert the model again.")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        vocab[token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))] = index
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=_merges(path, merges), dropout=None,
                                                         continuing_subword_prefix="", end_of_word_suffix="",
                                                         fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def generate_merges(vocab: dict[str, int], scores: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary, best first (transformers' ``generate_merges``)."""
    reverse = scores is not None
    ranked = dict(scores) if reverse else vocab
    merges = []
    for merge, score in ranked.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges = sorted(merges, key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(path: Path, tokens: list[str], merges: list[str] | None,
                   scores: list[float] | None) -> tokenizers.Tokenizer:
    """LlamaTokenizer(vocab, merges) as transformers' ``sentencepiece_tokenizer`` builds it."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = _merges(path, merges)
    elif scores is not None:
        pairs = generate_merges(vocab, dict(zip(tokens, scores)))
    else:
        raise CheckpointError(f"{path}: a SentencePiece tokenizer needs tokenizer.ggml.merges or "
                              f"tokenizer.ggml.scores, which the file lacks; convert the model again.")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                                         dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


def _gemma(tokens: list[str]) -> tokenizers.Tokenizer:
    """GemmaTokenizer as transformers' ``gemma_tokenizer`` builds it: space-only tokens respelled with ▁, merges
    ranked by file order."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = generate_merges(vocab, {token: -index for index, token in enumerate(tokens)})
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>",
                                                         dropout=None, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", "▁")
    return backend
