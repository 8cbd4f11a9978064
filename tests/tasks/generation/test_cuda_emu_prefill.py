"""Prefill on cuda-emu: prompts of 37, 64, 100 and 500 tokens share one prompt-length bucket (512), so the prefill
program is compiled into one module when loaded and each prompt only re-binds it - the kernels read the length
from their arguments - giving the numpy runtime's logits. Counts from ``luminal_recipes.instrument``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from luminal_recipes import instrument

pytestmark = pytest.mark.skipif(not shutil.which("g++"), reason="cuda-emu needs g++")

LENGTHS = (37, 64, 100, 500)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from generation_checkpoints import save_llama

    folder = tmp_path_factory.mktemp("llama-1k")
    save_llama(folder, seed=0)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for a 500-token prompt (RoPE tables come from positions)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _prefill_logits(lm, session, ids: list[int]) -> np.ndarray:
    lm._reset(session)
    n = len(ids)
    return np.array(lm._step(session.prefill, np.asarray([ids], np.int32), np.arange(n, dtype=np.int32),
                             lm._dims(n, n, session.cache)))


def test_prompts_in_one_bucket_compile_one_prefill_module(long_llama, assert_close):
    from generation_checkpoints import RECIPES

    from luminal_recipes.tasks.generation import LanguageModel

    rng = np.random.default_rng(0)
    emu, ref = (LanguageModel(RECIPES / "llama.yaml", weights=long_llama, runtime=name) for name in
                ("cuda-emu", "numpy"))
    try:
        prompts = [rng.integers(3, emu._vocab, n).tolist() for n in LENGTHS]
        emu._program("decode"), emu._program("prefill")  # compiled first: the counts below are of loading
        before = instrument.snapshot()
        session = emu._ensure(512, max(LENGTHS))
        assert session.prefill_len == 512 and session.prefill.loaded_dims["seq"] == 512
        loaded = instrument.snapshot()
        got = [_prefill_logits(emu, session, ids) for ids in prompts]
        rebinding = instrument.snapshot() - loaded
        # loading built the decode and prefill modules (one each); the four prompt lengths built nothing
        assert (loaded - before)[instrument.CUDA_MODULE] <= 2
        assert rebinding[instrument.CUDA_MODULE] == 0 and rebinding[instrument.CUDA_COMPILE] == 0
        assert session.prefill.stats.rebinds == len(LENGTHS)
        ref_session = ref._ensure(512, max(LENGTHS))
        for ids, logits in zip(prompts, got):
            assert_close("model", logits, _prefill_logits(ref, ref_session, ids))
    finally:
        emu.release()
        ref.release()
