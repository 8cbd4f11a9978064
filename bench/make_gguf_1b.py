"""Make the ~1B Llama-shaped GGUF files of ``bench/llm_gguf.py --make-files DIR`` (speed only: random weights).

A TinyLlama-1.1B-shaped ``LlamaForCausalLM`` (hidden 2048, 22 layers, intermediate 5632, 32 heads, 4 KV heads,
vocabulary 32000, untied LM head) is initialised at random by transformers with its own initialiser (normal, std
``initializer_range`` = 0.02, as a trained model's weights are in scale, so the quantizer's scales behave) and saved
with ``save_pretrained`` in f16, with SmolLM2's byte-level BPE tokenizer cut to its first 32000 tokens
(``tests/fixtures/gguf/make_fixtures.py``). llama.cpp's own ``convert_hf_to_gguf.py`` writes the f16 GGUF, and
llama.cpp's quantizer (``llama_cpp.llama_model_quantize``, llama-cpp-python) makes Q4_K_M and Q8_0 from it.

Files already in DIR are kept (the cache); the f16 GGUF is kept too (``--no-f16`` deletes it after quantizing).
Random weights give degenerate text: these files measure speed, never quality.

    python bench/make_gguf_1b.py DIR            # DIR/llama-1b-q4_k_m.gguf, DIR/llama-1b-q8_0.gguf (+ f16)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "gguf" / "make_fixtures.py"
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
             initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def _fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def files(out: Path) -> dict[str, Path]:
    return {q: out / f"llama-1b-{q}.gguf" for q in QUANTS}


def make(out: Path, keep_f16: bool = True) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    want = files(out)
    f16 = out / "llama-1b-f16.gguf"
    if all(p.exists() for p in want.values()):
        return want
    fx = _fixtures()
    if not f16.exists():
        import torch
        import transformers as tf

        torch.manual_seed(0)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            folder = Path(tmp) / "llama-1b"
            torch.set_default_dtype(torch.float16)  # initialised in f16: half the memory of an f32 model
            try:
                model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE))
            finally:
                torch.set_default_dtype(torch.float32)
            std = float(model.model.layers[0].mlp.up_proj.weight.float().std())
            print(f"initialised {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
                  f"(a projection's std {std:.4f})", flush=True)
            model.save_pretrained(folder)
            del model
            fx.VOCAB = SHAPE["vocab_size"]
            fx.small_tokenizer(folder)
            fx.convert(folder, f16, "smollm", "f16")
        print("wrote", f16, flush=True)
    try:
        import diskcache  # noqa: F401  (llama_cpp imports it for its prompt cache, unused here)
    except ImportError:
        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp

    for q, path in want.items():
        if path.exists():
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, QUANTS[q])
        tmp = path.with_suffix(".part")
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise SystemExit(f"llama.cpp's quantizer failed ({rc}) making {path}")
        tmp.rename(path)
        print("wrote", path, flush=True)
    if not keep_f16:
        f16.unlink()
    return want


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--no-f16", action="store_true", help="delete the f16 GGUF after quantizing")
    args = p.parse_args()
    for path in make(args.dir, keep_f16=not args.no_f16).values():
        print(path)


if __name__ == "__main__":
    main()
