"""Response-cache human format (envs/cache/jsonl.py), normalisation, derived fields and
the ``data check`` report, each against a hand-written oracle (docs/caches.md)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from envs.cache.fast import load_fast, save_fast
from envs.cache.schema import CacheError, arrays_checksum
from envs.cache.formats import load_cache
from envs.cache.jsonl import read_jsonl, write_jsonl
from envs.cache.normalise import normalise_answer
from envs.replay.report import cache_stats, describe

MANIFEST = {
    "name": "tiny", "task": "hotpotqa", "T": 3,
    "models": {"base": {"name": "llama", "price_in": 0.1, "price_out": 0.2},
               "guide": {"name": "gpt-4o", "price_in": 2.5, "price_out": 10.0}},
    "provenance": {"kind": "real", "source": "hand-written", "license": "CC0"},
}


def _b(answer, correct, tin, tout, conf=None):
    d = {"answer": answer, "correct": correct, "tokens_in": tin, "tokens_out": tout}
    if conf is not None:
        d["confidence"] = conf
    return d


def _g(verdict, answer, correct, tin, tout, unc=None):
    d = {"verdict": verdict, "answer": answer, "correct": correct, "tokens_in": tin, "tokens_out": tout}
    if unc is not None:
        d["uncertainty"] = unc
    return d


QUESTIONS = [
    {"id": "q-1", "gold": "Indiana University", "note": "extra fields are ignored",
     "rounds": [{"base": _b("Purdue University", False, 800, 60, 0.4),
                 "guide": _g(False, "the Indiana University.", True, 88, 4, 0.1)},
                {"base": _b("indiana university", True, 700, 50),
                 "guide": _g(True, "Indiana  University", True, 90, 5)}],
     "baselines": {"exit": {"llama": {"correct": False, "rounds": 3, "cost_cents": 0}}}},
    {"id": "q-2",
     "rounds": [{"base": _b("Paris", False, 100, 10), "guide": _g(True, "Paris", False, 20, 2)},
                {"base": _b("Lyon", False, 100, 10), "guide": _g(False, "Marseille", False, 20, 2)},
                {"base": _b("paris!", False, 100, 10), "guide": _g(False, "Lyon", False, 30, 3, 0.9)}],
     "baselines": {"llm_policy": {"llama": [2, 2, 1]}}},
    {"id": 7, "gold": "42",
     "rounds": [{"base": _b("42", True, 50.5, 5), "guide": _g(True, "42", True, 10, 1)}],
     "baselines": {"exit": {"gpt-4o": {"correct": True, "rounds": 1, "cost_cents": 0.3}},
                   "llm_policy": {"llama": [0]}}},
]


def _write(path: Path, records, manifest=MANIFEST) -> Path:
    lines = ([json.dumps({"manifest": manifest})] if manifest is not None else [])
    lines += [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def tiny(tmp_path):
    return read_jsonl(_write(tmp_path / "tiny.jsonl", QUESTIONS))


# -- normalisation ------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("  The Indiana University! ", "indiana university"),
    ("U.S.A.", "usa"),                         # punctuation deleted, not spaced (SQuAD)
    ("well-known", "wellknown"),
    ("An apple a day", "apple day"),           # articles as whole words only
    ("Theatre", "theatre"),
    ("“Quoted” — dash…", "quoted dash"),        # Unicode punctuation
    ("e\u0301te\u0301", "\u00e9t\u00e9"),      # NFC: decomposed accents compose
    ("tab\tand\nnewline", "tab and newline"),
    ("a the an", ""),
    ("A", "a"), ("(A)", "a"), (" A. ", "a"), ("B", "b"),  # option letters: A is not an article (issue 49)
    ("A cat", "cat"), ("a a", ""),
])
def test_normalise_answer_examples(text, expected):
    assert normalise_answer(text) == expected


# -- reading: id mapping and arrays against the hand-written example ------------

def test_id_mapping_and_arrays_match_hand_oracle(tiny):
    a = tiny.arrays
    assert tiny.T == 3 and tiny.n_questions == 3
    assert a["question_ids"].tolist() == ["q-1", "q-2", "7"]
    assert a["gold"].tolist() == ["Indiana University", "", "42"]
    # q-1: "purdue university" -> 0, "indiana university" -> 1 (base and guide share ids)
    # q-2: paris 0, lyon 1, marseille 2;  q-3: "42" -> 0
    np.testing.assert_array_equal(a["base_answer"], [[0, 1, -1], [0, 1, 0], [0, -1, -1]])
    np.testing.assert_array_equal(a["guide_answer"], [[1, 1, -1], [0, 2, 1], [0, -1, -1]])
    assert a["answer_text"][0, :2].tolist() == ["purdue university", "indiana university"]
    assert a["answer_text"][1, :3].tolist() == ["paris", "lyon", "marseille"]
    assert a["answer_text"][2, 0] == "42" and (a["answer_text"][2, 1:] == "").all()
    np.testing.assert_array_equal(a["round_mask"], [[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(a["base_correct"], [[0, 1, 0], [0, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(a["guide_correct"], [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(a["guide_verdict"], [[0, 1, 0], [1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(a["base_tokens_in"], [[800, 700, 0], [100, 100, 100], [50.5, 0, 0]])
    np.testing.assert_array_equal(a["guide_tokens_out"], [[4, 5, 0], [2, 2, 3], [1, 0, 0]])
    conf, unc = a["base_confidence"], a["guide_uncertainty"]
    assert conf[0, 0] == np.float32(0.4) and np.isnan(conf).sum() == 8
    assert unc[0, 0] == np.float32(0.1) and unc[1, 2] == np.float32(0.9) and np.isnan(unc).sum() == 7
    # baselines: model columns in order of first appearance
    assert tiny.manifest.exit_models == ("llama", "gpt-4o")
    assert tiny.manifest.llm_policy_models == ("llama",)
    np.testing.assert_array_equal(a["exit_mask"], [[1, 0], [0, 0], [0, 1]])
    np.testing.assert_array_equal(a["exit_correct"], [[0, 0], [0, 0], [0, 1]])
    np.testing.assert_array_equal(a["exit_rounds"], [[3, 0], [0, 0], [0, 1]])
    np.testing.assert_allclose(a["exit_cost_cents"], [[0, 0], [0, 0], [0, 0.3]], rtol=1e-6)
    np.testing.assert_array_equal(a["llm_policy_actions"][:, 0], [[-1, -1, -1], [2, 2, 1], [0, -1, -1]])
    assert tiny.manifest.arrays_checksum == arrays_checksum(a) and tiny.manifest.checksum == tiny.checksum()


def test_derived_fields_match_hand_computation(tiny):
    np.testing.assert_array_equal(tiny.unsolvable, [False, True, False])
    np.testing.assert_array_equal(tiny.n_rounds, [2, 3, 1])
    # cents = (tokens * USD per 1M tokens) / 1e6 * 100; hand sums per round:
    # q-1 r0: 800*.1 + 60*.2 + 88*2.5 + 4*10 = 352 -> 0.0352 ; r1: 70+10+225+50 = 355
    # q-2 r0, r1: 10+2+50+20 = 82 ; r2: 10+2+75+30 = 117 ; q-3: 5.05+1+25+10 = 41.05
    expected = np.array([[352, 355, 0], [82, 82, 117], [41.05, 0, 0]]) / 1e4
    np.testing.assert_allclose(tiny.round_cost_cents(), expected, rtol=1e-6)


def test_describe_numbers_match_hand_computation(tiny):
    s = cache_stats(tiny)
    assert s["questions"] == 3 and s["T"] == 3
    assert s["rounds_hist"] == [1, 1, 1] and s["questions_per_round"] == [3, 2, 1]
    np.testing.assert_allclose(s["base_acc"], [1 / 3, 1 / 2, 0])
    np.testing.assert_allclose(s["guide_acc"], [2 / 3, 1 / 2, 0])
    np.testing.assert_allclose(s["verdict_acc"], [2 / 3, 1, 1])
    assert s["base_acc_all"] == pytest.approx(2 / 6)
    assert s["guide_acc_all"] == pytest.approx(3 / 6)
    assert s["verdict_acc_all"] == pytest.approx(5 / 6)
    assert s["unsolvable_share"] == pytest.approx(1 / 3)
    assert s["guide_tokens_in_mean"] == pytest.approx(258 / 6)
    assert s["guide_tokens_out_mean"] == pytest.approx(17 / 6)
    # guide USD*1e6 per call: 260, 275, 70, 70, 105, 35 -> mean 815/6, in cents / 1e4
    assert s["guide_cents_per_call"] == pytest.approx(815 / 6 / 1e4, rel=1e-6)
    assert s["distinct_answers_mean"] == pytest.approx(2.0)
    assert s["gold_given"] == 2
    assert s["exit"]["llama"] == pytest.approx({"questions": 1, "accuracy": 0.0, "rounds_mean": 3.0, "cost_cents_mean": 0.0})
    assert s["exit"]["gpt-4o"]["accuracy"] == 1.0
    assert s["llm_policy"]["llama"] == {"questions": 2, "rounds_mean": 2.0}
    text = describe(tiny, "tiny.jsonl")
    assert "0.333" in text and "0.833" in text and "0.0136" in text
    assert tiny.checksum() in text and "SYNTHETIC" not in text


def test_describe_labels_synthetic(tmp_path):
    man = dict(MANIFEST, provenance={"kind": "synthetic", "generator": "test", "seed": 3})
    cache = read_jsonl(_write(tmp_path / "s.jsonl", QUESTIONS, man))
    text = describe(cache, "s.jsonl")
    assert text.splitlines()[1].startswith("SYNTHETIC") and text.count("SYNTHETIC") >= 3


def test_defaults_without_manifest(tmp_path):
    cache = read_jsonl(_write(tmp_path / "plain.jsonl", QUESTIONS, manifest=None))
    m = cache.manifest
    assert (m.name, m.task, m.T) == ("plain", "unknown", 3)
    assert (m.base.name, m.guide.name, m.base.price_in, m.guide.price_out) == ("base", "guide", 0.0, 0.0)
    assert m.provenance == {"kind": "real", "source": str(tmp_path / "plain.jsonl"), "license": "unknown"}
    assert (cache.round_cost_cents() == 0).all()


# -- round trip -----------------------------------------------------------------

def _assert_same(c1, c2):
    assert c1.manifest == c2.manifest
    assert set(c1.arrays) == set(c2.arrays)
    for k in c1.arrays:
        x, y = c1.arrays[k], c2.arrays[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        np.testing.assert_array_equal(x, y, err_msg=k)  # NaN == NaN here


def _random_records(rng, n, T):
    vocab = ["Paris", "paris.", "Lyon", "the Lyon", "Nice", "Rome", ""]
    recs = []
    for q in range(n):
        gold = vocab[rng.integers(0, 6)] if rng.random() < 0.7 else None
        truth = {normalise_answer(v): bool(rng.random() < 0.4) for v in vocab}
        if gold is not None:
            truth[normalise_answer(gold)] = True
        rounds = []
        for _ in range(rng.integers(1, T + 1)):
            ab, ag = vocab[rng.integers(0, 7)], vocab[rng.integers(0, 7)]
            rounds.append({
                "base": _b(ab, truth[normalise_answer(ab)], int(rng.integers(0, 2000)),
                           float(rng.integers(0, 400)) / 4, float(rng.random()) if rng.random() < .5 else None),
                "guide": _g(bool(rng.random() < .5), ag, truth[normalise_answer(ag)], float(rng.random() * 300),
                            int(rng.integers(0, 50)), float(rng.random()) if rng.random() < .5 else None),
            })
        rec = {"id": f"r{q}", "rounds": rounds}
        if gold is not None:
            rec["gold"] = gold
        if rng.random() < 0.5:
            rec["baselines"] = {"exit": {"m1": {"correct": bool(rng.random() < .5), "rounds": int(rng.integers(1, T + 1)),
                                                "cost_cents": float(rng.random())}},
                                "llm_policy": {"m2": [2] * int(rng.integers(0, len(rounds))) + [int(rng.integers(0, 2))]}}
        recs.append(rec)
    return recs


@pytest.mark.parametrize("which", ["tiny", "random"])
def test_round_trip_jsonl_fast_jsonl(tmp_path, which):
    if which == "tiny":
        src = _write(tmp_path / "a.jsonl", QUESTIONS)
    else:
        man = dict(MANIFEST, T=4, name="rand")
        src = _write(tmp_path / "a.jsonl", _random_records(np.random.default_rng(1), 60, 4), man)
    c1 = read_jsonl(src)
    save_fast(c1, tmp_path / "fast")
    c2 = load_fast(tmp_path / "fast")
    _assert_same(c1, c2)
    write_jsonl(c2, tmp_path / "b.jsonl")
    c3 = read_jsonl(tmp_path / "b.jsonl")
    _assert_same(c1, c3)
    # and load_cache dispatches on the path kind
    _assert_same(c1, load_cache(tmp_path / "fast"))
    _assert_same(c1, load_cache(tmp_path / "b.jsonl"))
    # the second export is byte-identical to the first (a fixed point)
    write_jsonl(c3, tmp_path / "c.jsonl")
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "c.jsonl").read_bytes()


def test_checksum_ignores_storage_width(tiny):
    a = dict(tiny.arrays)
    wide = dict(a, answer_text=a["answer_text"].astype("<U64"), gold=a["gold"].astype("<U50"))
    assert arrays_checksum(wide) == arrays_checksum(a)
    changed = dict(a, base_tokens_in=a["base_tokens_in"] + np.float32(1))
    assert arrays_checksum(changed) != arrays_checksum(a)


def test_tampered_fast_cache_is_rejected(tmp_path, tiny):
    d = save_fast(tiny, tmp_path / "fast")
    with np.load(d / "arrays.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["guide_correct"][1, 0] = True
    np.savez_compressed(d / "arrays.npz", **arrays)
    with pytest.raises(CacheError, match="checksum mismatch"):
        load_fast(d)
    d2 = save_fast(tiny, tmp_path / "fast2")
    man = json.loads((d2 / "manifest.json").read_text())
    man["checksum"] = "sha256:" + "0" * 64
    (d2 / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CacheError, match="checksum mismatch"):
        load_fast(d2)


def test_save_fast_refuses_to_replace_a_non_cache_directory(tmp_path, tiny):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CacheError, match="not a fast-format cache"):
        save_fast(tiny, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    save_fast(tiny, tmp_path / "c")
    save_fast(tiny.subset(np.array([0])), tmp_path / "c")  # replacing a cache is fine
    assert load_fast(tmp_path / "c").n_questions == 1
    assert sorted(os.listdir(tmp_path)) == ["c", "mine", "tiny.jsonl"]


def test_write_jsonl_is_atomic(tmp_path, tiny, monkeypatch):
    out = tmp_path / "o.jsonl"
    out.write_text("old\n")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(CacheError, match="o.jsonl: cannot write"):
        write_jsonl(tiny, out)
    assert out.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["o.jsonl", "tiny.jsonl"]


# -- validation rules (in-process; the CLI tests run the same through a subprocess)

def _err(tmp_path, records, manifest=MANIFEST) -> str:
    with pytest.raises(CacheError) as e:
        read_jsonl(_write(tmp_path / "bad.jsonl", records, manifest))
    return str(e.value)


def _mutate(fn):
    recs = json.loads(json.dumps(QUESTIONS))
    fn(recs)
    return recs


@pytest.mark.parametrize("mutation, expected", [
    (lambda r: r[1]["rounds"][1]["guide"].update(correct=True),  # "Marseille": fine, new id
     None),
    (lambda r: r[1]["rounds"][2]["base"].update(correct=True),  # "paris!" == "Paris" (false) in round 0
     "bad.jsonl:3: rounds[2].base.correct: true contradicts rounds[0].base.correct = false"),
    (lambda r: r[0]["rounds"][0]["base"].update(answer="INDIANA university"),  # equals gold, flagged false
     "bad.jsonl:2: rounds[0].base.correct: false, but the answer"),
    (lambda r: r[0]["rounds"][1]["guide"].update(answer="IU"),  # correct true on another text: allowed
     None),
    (lambda r: r[1]["baselines"]["llm_policy"].update(llama=[1, 2]),
     "bad.jsonl:3: baselines.llm_policy.llama[0]: action 1 answers and ends the episode"),
    (lambda r: r[1]["baselines"]["llm_policy"].update(llama=[2, 2]),
     "baselines.llm_policy.llama[1]: the last action must answer"),
    (lambda r: r[1]["baselines"]["llm_policy"].update(llama=[2, 2, 2, 1]),
     "baselines.llm_policy.llama: 4 actions, but the question has 3 rounds"),
    (lambda r: r[2]["baselines"]["llm_policy"].update(llama=[3]),
     "bad.jsonl:4: baselines.llm_policy.llama[0]: expected an action 0 (base), 1 (guide) or 2 (next), got 3"),
    (lambda r: r[0]["baselines"]["exit"]["llama"].update(rounds=4),
     "bad.jsonl:2: baselines.exit.llama.rounds: expected an integer in [1, 3], got 4"),
    (lambda r: r[2]["baselines"]["exit"]["gpt-4o"].update(cost_cents=-0.1),
     "baselines.exit.gpt-4o.cost_cents: expected a number >= 0 and <= 1e+09, got -0.1"),
    (lambda r: r[0]["rounds"][0]["base"].update(tokens_in=True),
     "rounds[0].base.tokens_in: expected a number >= 0 and <= 1e+07, got boolean true"),
    (lambda r: r[0]["rounds"][0]["base"].update(confidence=-0.5),
     "rounds[0].base.confidence: expected a number in [0, 1] or null, got -0.5"),
    (lambda r: r[0]["rounds"][0].pop("guide"), "bad.jsonl:2: rounds[0].guide: missing required field"),
    (lambda r: r[0].update(id=""), "bad.jsonl:2: id: expected a non-empty string"),
    (lambda r: r[2].update(id="q-1"), "bad.jsonl:4: id: duplicate question id 'q-1' (first on line 2)"),
])
def test_validation_rules(tmp_path, mutation, expected):
    recs = _mutate(mutation)
    if expected is None:
        read_jsonl(_write(tmp_path / "ok.jsonl", recs))
    else:
        assert expected in _err(tmp_path, recs)


def test_manifest_must_come_first_and_be_valid(tmp_path):
    recs = QUESTIONS[:1] + [{"manifest": MANIFEST}] + QUESTIONS[1:]
    assert "bad.jsonl:2: manifest: the manifest must be on the first line" in _err(tmp_path, recs, None)
    bad = dict(MANIFEST, normalisation="none")
    assert "bad.jsonl:1: manifest.normalisation" in _err(tmp_path, QUESTIONS, bad)
    no_models = {k: v for k, v in MANIFEST.items() if k != "models"}
    assert "bad.jsonl:1: manifest.models: missing required field" in _err(tmp_path, QUESTIONS, no_models)
    assert "no questions" in _err(tmp_path, [], MANIFEST)
    # manifest errors come before errors of later lines
    assert ":1: manifest.T" in _err(tmp_path, [{"id": "x"}], dict(MANIFEST, T=0))


def test_nan_in_ignored_field_is_harmless_and_in_read_field_is_an_error(tmp_path):
    p = tmp_path / "n.jsonl"
    line = json.dumps(QUESTIONS[2])[:-1] + ', "debug": NaN}'
    p.write_text(json.dumps({"manifest": MANIFEST}) + "\n" + line + "\n")
    assert read_jsonl(p).n_questions == 1
    p.write_text(json.dumps({"manifest": MANIFEST}) + "\n" + line.replace('"tokens_out": 5', '"tokens_out": Infinity') + "\n")
    with pytest.raises(CacheError, match=r"n.jsonl:2: rounds\[0\].base.tokens_out: .* got Infinity"):
        read_jsonl(p)


# -- other producers of caches survive a JSONL round trip --------------------------

def test_synthetic_cache_survives_jsonl_round_trip_up_to_id_renumbering(tmp_path):
    """Synthetic ids are not in first-appearance order, so the reader renumbers them;
    every equality between answers, every flag and every number must survive."""
    from envs.generators.synthetic import generate

    c1 = generate("hotpotqa-llama2", n_questions=40, seed=5)
    c2 = read_jsonl(write_jsonl(c1, tmp_path / "s.jsonl"))
    assert c2.manifest.provenance == c1.manifest.provenance and c2.manifest.is_synthetic
    a1, a2 = c1.arrays, c2.arrays
    for k in a1:
        if k not in ("base_answer", "guide_answer", "answer_text"):
            np.testing.assert_array_equal(a1[k], a2[k], err_msg=k)
    m = a1["round_mask"]
    for q in range(c1.n_questions):
        old = np.concatenate([a1["base_answer"][q][m[q]], a1["guide_answer"][q][m[q]]])
        new = np.concatenate([a2["base_answer"][q][m[q]], a2["guide_answer"][q][m[q]]])
        np.testing.assert_array_equal(old[:, None] == old[None, :], new[:, None] == new[None, :])
        texts_old = [normalise_answer(str(a1["answer_text"][q][i])) for i in old]
        assert texts_old == a2["answer_text"][q][new].tolist()


@pytest.mark.parametrize("fmt, rel", [("uala-hotpotqa", "uala"), ("omnisbench", "omnisbench")])
def test_real_imports_survive_jsonl_round_trip_with_same_checksum(real_data, tmp_path, fmt, rel):
    from envs.importers import import_cache

    c1 = import_cache(fmt, real_data.root / rel)
    c2 = read_jsonl(write_jsonl(c1, tmp_path / "r.jsonl"))
    assert c2.checksum() == c1.checksum() and c2.manifest.provenance == c1.manifest.provenance
