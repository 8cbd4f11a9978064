"""Golden replies of the language-model recipes: the recorded token ids regenerate exactly, they are what
transformers' own generate makes on the same tiny checkpoints, and a changed reply or a missing concept fails with
a message that says where."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from luminal_recipes.cli import app
from luminal_recipes.tasks.generation.golden import check, load_manifest, missing_concepts, normalise

MANIFEST = Path(__file__).resolve().parent / "texts.yaml"


@pytest.fixture(scope="module")
def results():
    return check(MANIFEST)


def test_every_shipped_language_model_has_a_golden():
    recipes = {case.recipe.name for case in load_manifest(MANIFEST) if case.ids}
    shipped = {p.name for p in (MANIFEST.parents[2] / "recipes").glob("*.yaml")
               if "generation:" in p.read_text()}
    assert shipped <= recipes, f"language-model recipes without a tiny golden: {sorted(shipped - recipes)}"


def test_goldens_regenerate(results):
    for r in results:
        assert r.ok, f"{r.case.name}: {r.message}"
    assert sum(r.status == "ok" for r in results) >= 4


def test_greedy_goldens_are_transformers_generate(results):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for r in results:
        case = r.case
        if not case.ids or case.settings.get("temperature", 0) or case.weights.startswith("hf://"):
            continue
        tokenizer = transformers.AutoTokenizer.from_pretrained(case.weights)
        model = transformers.AutoModelForCausalLM.from_pretrained(case.weights).eval()
        if case.settings.get("chat", True):
            out = tokenizer.apply_chat_template([{"role": "user", "content": case.prompt}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        else:
            ids = tokenizer(case.prompt)["input_ids"]
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), do_sample=False,
                                  max_new_tokens=case.settings.get("max_new_tokens", 32),
                                  repetition_penalty=case.settings.get("repetition_penalty", 1.0),
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert json.loads(case.record.read_text())["ids"] == want, case.name


def tiny_manifest(tmp_path: Path, **entry) -> Path:
    data = yaml.safe_load(MANIFEST.read_text())
    item = dict(data["texts"][0])
    item.update(entry)
    item["recipe"] = str((MANIFEST.parent / item["recipe"]).resolve())
    item["weights"] = str((MANIFEST.parent / item["weights"]).resolve())
    (tmp_path / "texts").mkdir(parents=True)
    shutil.copy(MANIFEST.parent / "texts" / f"{data['texts'][0]['name']}.json",
                tmp_path / "texts" / f"{item['name']}.json")
    path = tmp_path / "texts.yaml"
    path.write_text(yaml.safe_dump({"texts": [item]}))
    return path


def test_a_changed_reply_fails_and_says_where(tmp_path):
    path = tiny_manifest(tmp_path)
    record = tmp_path / "texts" / "llama-tiny-chat.json"
    data = json.loads(record.read_text())
    data["ids"][5] += 1
    record.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["golden", "check", str(path)])
    assert result.exit_code == 1 and "FAIL llama-tiny-chat" in result.output and "at position 5" in result.output


def test_concept_groups(tmp_path, results):
    text = next(r.text for r in results if r.case.name == "llama-tiny-chat")
    word = next(w for w in text.split() if len(w) >= 3 and w.isprintable())
    ok = check(tiny_manifest(tmp_path / "a", ids=False, concepts=[[word.upper(), "zebra"]]))
    assert ok[0].status == "ok", ok[0].message
    bad = check(tiny_manifest(tmp_path / "b", ids=False, concepts=[[word], ["zebra", "giraffe"]]))
    assert bad[0].status == "FAIL"
    assert "missing: [['zebra', 'giraffe']]" in bad[0].message and f"expected all of [['{word}']" in bad[0].message


def test_normalisation():
    assert normalise("\x1b[1;32mThe  Capital\n\tof\x1b[0m FRANCE") == "the capital of france"
    assert missing_concepts("It is \x1b[1mParis\x1b[0m.", [["paris"], ["france", "french"]]) == [["france", "french"]]
