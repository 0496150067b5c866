"""Importers of public cached-LLM-response data (envs/importers; docs/caches.md, tests/fixtures/SOURCES.md).

Every number is checked against an independent reading of the raw files with
``csv`` / ``json`` only (not the importers' parsers), or against numbers the
sources themselves publish (SOURCES.md accuracies, OmnisBench's leaderboard,
UALA's derived ``hotpotqa_joined.jsonl``). Every check runs on the shipped subsets in
``tests/fixtures/data`` and again on the full data (``real_data``; skipped when the full
data is absent, an error under CI=true); counts the sources publish for the full files
(SOURCES.md accuracies, 14,042 MMLU questions, ...) are checked on the full data only.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from envs.cache.fast import load_fast, save_fast
from envs.cache.schema import CacheError, check_arrays
from envs.importers import IMPORTERS, import_cache
from tests.helpers import REPO

FIXTURES = REPO / "tests" / "fixtures" / "data"

MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"
GPT4 = "gpt-4-1106-preview"


@pytest.fixture(scope="module")
def caches(real_data) -> dict:
    """Each importer run once on the real files (fixtures, then full data)."""
    d = real_data.root
    return {
        "routellm-mmlu": import_cache("routellm-mmlu", d / "routellm" / "mmlu"),
        "routellm-gsm8k": import_cache("routellm-gsm8k", d / "routellm" / "gsm8k"),
        "uala-hotpotqa": import_cache("uala-hotpotqa", d / "uala"),
        "omnisbench": import_cache("omnisbench", d / "omnisbench"),
        "omnisbench-main": import_cache("omnisbench", d / "omnisbench" / "results_2026-08-19.json"),
    }


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- common properties ---------------------------------------------------------


@pytest.mark.parametrize("name", ["routellm-mmlu", "routellm-gsm8k", "uala-hotpotqa", "omnisbench", "omnisbench-main"])
def test_structure_provenance_and_fast_round_trip(caches, name, tmp_path):
    c = caches[name]
    check_arrays(c.manifest, c.arrays, name)
    prov = c.manifest.provenance
    assert prov["kind"] == "real" and not c.manifest.is_synthetic
    assert prov["license"] and prov["source"] and "not the CCPO" in prov["protocol"]
    assert c.manifest.checksum == c.checksum()
    a = c.arrays
    # verdict rule: the guide agrees iff its answer id equals the base's (on existing rounds)
    m = a["round_mask"]
    assert np.array_equal(a["guide_verdict"][m], (a["base_answer"] == a["guide_answer"])[m])
    # one answer id never carries two correctness labels within a question
    for role in ("base", "guide"):
        other = "guide" if role == "base" else "base"
        same = (a[f"{role}_answer"] == a[f"{other}_answer"]) & m
        assert np.array_equal(a[f"{role}_correct"][same], a[f"{other}_correct"][same])
    back = load_fast(save_fast(c, tmp_path / name))
    assert back.manifest == c.manifest
    for k, v in c.arrays.items():
        np.testing.assert_array_equal(back.arrays[k], v, err_msg=k)


# -- RouteLLM ------------------------------------------------------------------


def test_routellm_mmlu_matches_raw_csvs(caches, real_data):
    c = caches["routellm-mmlu"]
    base, guide, n_in, ids = [], [], [], []
    for path in sorted((real_data.root / "routellm" / "mmlu").glob("*.csv")):
        subject = path.stem[len("mmlu_"):]
        for i, r in enumerate(_csv_rows(path)):
            base.append(r[MIXTRAL] == "True")
            guide.append(r[GPT4] == "True")
            n_in.append(-(-len(r["prompt"]) // 4))
            ids.append(f"{subject}/{i}")
    assert c.n_questions == len(base) == (14042 if real_data.full else 538) and c.T == 1
    assert list(c.question_ids) == ids
    np.testing.assert_array_equal(c.base_correct[:, 0], base)
    np.testing.assert_array_equal(c.guide_correct[:, 0], guide)
    if real_data.full:  # SOURCES.md: accuracy 0.681 (Mixtral) vs 0.806 (GPT-4)
        assert round(float(np.mean(base)), 3) == 0.681 and round(float(np.mean(guide)), 3) == 0.806
    # correctness-only verdict: agree iff both right or both wrong
    np.testing.assert_array_equal(c.guide_verdict[:, 0], np.equal(base, guide))
    np.testing.assert_array_equal(c.guide_tokens_in[:, 0], n_in)
    np.testing.assert_array_equal(c.guide_tokens_out[:, 0], 1)
    np.testing.assert_array_equal(c.unsolvable, ~(np.array(base) | np.array(guide)))
    # cents = tokens x list prices ($0.30/$0.30 Mixtral, $10/$30 GPT-4), hand-computed for question 0
    want = (n_in[0] * 0.30 + 1 * 0.30 + n_in[0] * 10.0 + 1 * 30.0) / 1e6 * 100
    assert c.round_cost_cents()[0, 0] == pytest.approx(want, rel=1e-6)


def test_routellm_mmlu_single_csv(real_data):
    path = real_data.root / "routellm" / "mmlu" / "mmlu_anatomy.csv"
    c = import_cache("routellm-mmlu", path)
    rows = _csv_rows(path)
    assert c.n_questions == len(rows) == 135
    assert c.base_correct[:, 0].sum() == sum(r[MIXTRAL] == "True" for r in rows)


def test_routellm_gsm8k_matches_raw_csv(caches, real_data):
    c = caches["routellm-gsm8k"]
    rows = _csv_rows(real_data.root / "routellm" / "gsm8k" / "gsm8k_responses.csv")
    base = np.array([r[MIXTRAL] == "True" for r in rows])
    guide = np.array([r[GPT4] == "True" for r in rows])
    assert c.n_questions == len(rows) == (1319 if real_data.full else 200)
    np.testing.assert_array_equal(c.base_correct[:, 0], base)
    np.testing.assert_array_equal(c.guide_correct[:, 0], guide)
    out = [-(-len(r[f"{MIXTRAL}_response"]) // 4) for r in rows]
    np.testing.assert_array_equal(c.base_tokens_out[:, 0], out)
    # both correct -> same (gold) answer; one right one wrong -> different answers
    v = c.guide_verdict[:, 0]
    assert v[base & guide].all() and not v[base != guide].any()
    # two wrong answers agree only if their final numbers agree: a hand-picked row, the house-flip
    # question (row 2): Mixtral's truncated "130,00" vs GPT-4's "$25,000" -> distinct
    assert not base[2] and not guide[2] and not v[2]


# -- UALA ----------------------------------------------------------------------


def test_uala_hotpotqa_against_joined_file(caches, real_data):
    c = caches["uala-hotpotqa"]
    joined = {r["question_idx"]: r for r in _jsonl(real_data.root / "uala" / "hotpotqa_joined.jsonl")}
    n = 500 if real_data.full else 200
    assert c.n_questions == len(joined) == n and c.T == 2
    qidx = [int(q.split("/")[1]) for q in c.question_ids]
    assert set(qidx) == set(joined)
    J = [joined[i] for i in qidx]
    # round 2 exists exactly where Llama's UALA run escalated to the tool (steps > 2)
    esc = np.array([r["llama2_70b_uala"]["steps"] > 2 for r in J])
    assert esc.sum() == (101 if real_data.full else 40)
    np.testing.assert_array_equal(c.round_mask[:, 1], esc)
    # Llama's final UALA answer is round 2's base answer if escalated, else round 1's
    final = np.where(esc, c.base_correct[:, 1], c.base_correct[:, 0])
    np.testing.assert_array_equal(final, [r["llama2_70b_uala"]["em"] for r in J])
    if real_data.full:
        assert final.mean() == pytest.approx(0.366)
    # gpt-3.5's UALA run that did not escalate (steps == 2) ended on its CoT answer: its em is
    # round 1's guide correctness ('kept_cot' in the joined file means "final answer kept", not CoT)
    kept = np.array([r["gpt35i_uala"]["steps"] == 2 for r in J])
    assert kept.sum() == n - (104 if real_data.full else 43)
    np.testing.assert_array_equal(c.guide_correct[kept, 0], [r["gpt35i_uala"]["em"] for r, k in zip(J, kept) if k])
    # round 2 guide = gpt-3.5 ReAct run
    np.testing.assert_array_equal(c.guide_correct[esc, 1], [r["gpt35i_react"]["em"] for r, e in zip(J, esc) if e])
    # uncertainty maps: guide 1 - exp(-u) of the CoT score, base exp(-u) (non-escalated rows:
    # the joined cot_uncertainty of escalated rows can hold the tool answer's score)
    u = np.array([r["gpt35i_uala"]["uncertainty_values"][0] for r in J])
    np.testing.assert_allclose(c.guide_uncertainty[:, 0], 1 - np.exp(-u), atol=1e-6)
    cu = np.array([r["llama2_70b_uala"]["cot_uncertainty"] for r in J])
    np.testing.assert_allclose(c.base_confidence[~esc, 0], np.exp(-cu[~esc]), atol=1e-6)
    assert np.isnan(c.guide_uncertainty[:, 1]).all()
    np.testing.assert_array_equal(c.gold, [r["gt_answer"] for r in J])
    assert c.exit_mask.shape[1] == 0  # no cached EXIT runs: absent, not faked


def test_uala_correctness_rule_reproduces_source_em(real_data):
    """normalise_answer(answer) == normalise_answer(gold) is the source's own `em`, on every record."""
    from envs.cache.normalise import normalise_answer

    for rel in (
        "llama2_70b/llama2-hotpotqa-dev-uala-nooracle-20251022-040122.jsonl",
        "outputs/HotpotQA/chatgpt-hotpotqa-dev-uala.jsonl",
        "outputs/HotpotQA/chatgpt-hotpotqa-dev-react.jsonl",
    ):
        recs = _jsonl(real_data.root / "uala" / rel)
        got = [normalise_answer(r["answer"]) == normalise_answer(r["gt_answer"]) for r in recs]
        assert got == [bool(r["em"]) for r in recs], rel


# -- OmnisBench ----------------------------------------------------------------


def _omnis(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_omnisbench_matches_results_and_leaderboard(caches, real_data):
    path = real_data.root / "omnisbench" / "results_2026-08-19.json"
    doc = _omnis(path)
    c = caches["omnisbench-main"]
    want = {"gsm8k": 200, "humaneval": 164} if real_data.full else {"gsm8k": 40, "humaneval": 30}
    assert c.n_questions == sum(want.values())
    assert Counter(q.split("/")[1] for q in c.question_ids) == want
    lead = {r["policy"]: r for r in doc["leaderboard"]}
    assert c.base_correct[:, 0].mean() == pytest.approx(lead["always_cheap"]["quality"])
    assert c.guide_correct[:, 0].mean() == pytest.approx(lead["always_big"]["quality"])
    assert c.manifest.base.name == "openai/gpt-5-nano" and c.manifest.guide.name == "anthropic/claude-opus-5"
    # real cost: round cost = (cost_usd of both records) * 100 per question
    cost = {}
    for it in doc["items"]:
        if it["policy"] in ("always_cheap", "always_big"):
            key = f"{doc['provenance']['run_date']}/{it['dataset']}/{it['item_id']}"
            cost[key] = cost.get(key, 0.0) + it["cost_usd"] * 100
    np.testing.assert_allclose(c.round_cost_cents()[:, 0], [cost[q] for q in c.question_ids], rtol=1e-5)
    guide_cents = (c.guide_tokens_in * c.manifest.guide.price_in + c.guide_tokens_out * c.manifest.guide.price_out) / 1e4
    assert guide_cents.mean() == pytest.approx(lead["always_big"]["avg_cost_usd"] * 100, rel=1e-5)


def test_omnisbench_folder_holds_every_run(caches, real_data):
    c = caches["omnisbench"]
    runs = Counter()
    for p in sorted((real_data.root / "omnisbench").glob("results*.json")):
        doc = _omnis(p)
        for it in doc["items"]:
            if it["policy"] == "always_cheap":
                runs[(doc["provenance"]["run_date"], it["dataset"])] += 1
    assert Counter(tuple(q.split("/")[:2]) for q in c.question_ids) == runs
    assert c.n_questions == sum(runs.values()) == (364 if real_data.full else 70) + 35


# -- malformed sources -----------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_missing_column(tmp_path):
    p = _write(tmp_path / "mmlu_x.csv", f'prompt,{MIXTRAL}\n"Q?",True\n')
    with pytest.raises(CacheError, match=rf"mmlu_x\.csv: missing column.*{GPT4}"):
        import_cache("routellm-mmlu", p)


def test_csv_non_boolean_cell(tmp_path):
    p = _write(tmp_path / "mmlu_x.csv", f'prompt,{MIXTRAL},{GPT4}\n"Q1",True,False\n"Q2",maybe,True\n')
    with pytest.raises(CacheError, match=rf"mmlu_x\.csv: row 3, column '{MIXTRAL}'.*'maybe'"):
        import_cache("routellm-mmlu", p)


def test_csv_empty_file(tmp_path):
    p = _write(tmp_path / "gsm8k_responses.csv", "")
    with pytest.raises(CacheError, match=r"gsm8k_responses\.csv: empty file"):
        import_cache("routellm-gsm8k", p)


def test_uala_missing_and_broken_files(tmp_path):
    src = tmp_path / "uala"
    shutil.copytree(FIXTURES / "uala" / "llama2_70b", src / "llama2_70b")
    with pytest.raises(CacheError, match=r"chatgpt-hotpotqa-dev-uala\.jsonl: no such file"):
        import_cache("uala-hotpotqa", src)
    (src / "outputs" / "HotpotQA").mkdir(parents=True)
    for name in ("chatgpt-hotpotqa-dev-uala.jsonl", "chatgpt-hotpotqa-dev-react.jsonl"):
        shutil.copy(FIXTURES / "uala" / "outputs" / "HotpotQA" / name, src / "outputs" / "HotpotQA" / name)
    react = src / "outputs" / "HotpotQA" / "chatgpt-hotpotqa-dev-react.jsonl"
    lines = react.read_text(encoding="utf-8").splitlines()
    rec = json.loads(lines[4])
    del rec["em"]
    lines[4] = json.dumps(rec)
    react.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CacheError, match=r"chatgpt-hotpotqa-dev-react\.jsonl: line 5: missing field 'em'"):
        import_cache("uala-hotpotqa", src)
    lines[4] = "{not json"
    react.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CacheError, match=r"chatgpt-hotpotqa-dev-react\.jsonl: line 5: not valid JSON"):
        import_cache("uala-hotpotqa", src)


def test_omnisbench_malformed(tmp_path):
    shutil.copy(FIXTURES / "omnisbench" / "pricing_2026-08-18.yaml", tmp_path)
    doc = _omnis(FIXTURES / "omnisbench" / "results_2026-08-19.json")
    doc["items"][3]["passed"] = "yes"
    p = tmp_path / "results_bad.json"
    p.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(CacheError, match=r"results_bad\.json: items\[3\]\.passed: expected bool"):
        import_cache("omnisbench", p)
    doc["items"][3]["passed"] = True
    doc["items"] = [it for it in doc["items"] if not (it["policy"] == "always_big" and it["item_id"] == "HumanEval/83")]
    p.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(CacheError, match=r"results_bad\.json: humaneval/HumanEval/83 has no 'always_big' record"):
        import_cache("omnisbench", p)
    (tmp_path / "pricing_2026-08-18.yaml").unlink()
    with pytest.raises(CacheError, match=r"pricing_2026-08-18\.yaml: pricing file not found"):
        import_cache("omnisbench", p)
    _write(p, "")
    with pytest.raises(CacheError, match=r"results_bad\.json: line 1: not valid JSON"):
        import_cache("omnisbench", p)


def test_unknown_format_and_missing_source(tmp_path):
    with pytest.raises(CacheError, match="unknown format 'nope'.*jsonl, routellm-mmlu, routellm-gsm8k, uala-hotpotqa, omnisbench"):
        import_cache("nope", tmp_path)
    for fmt in IMPORTERS:
        with pytest.raises(CacheError, match=rf"{tmp_path / 'absent'}: no such file or directory"):
            import_cache(fmt, tmp_path / "absent")


def test_cli_data_import(real_data, tmp_path):
    """`ccpo-jax data import` writes a fast-format cache; a bad source exits 2, no traceback."""
    cmd = [sys.executable, "-m", "ccpo_jax.cli", "data", "import", "--format", "routellm-gsm8k"]
    out = tmp_path / "gsm8k"
    r = subprocess.run([*cmd, str(real_data.root / "routellm" / "gsm8k"), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert load_fast(out).n_questions == (1319 if real_data.full else 200)
    bad = _write(tmp_path / "gsm8k_responses.csv", "prompt\n")
    r = subprocess.run([*cmd, str(bad), "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "gsm8k_responses.csv" in r.stderr
    assert not (tmp_path / "x").exists()


def test_token_rule_is_ceil_chars_over_4():
    from envs.cache.tokens import estimate_tokens
    from envs.importers import number_key

    assert [estimate_tokens("x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert estimate_tokens("x" * 4001) == math.ceil(4001 / 4)
    from envs.cache.normalise import normalise_answer

    # spelled numbers stay distinct under the SQuAD normalisation ('-' and '.' are deleted by it)
    keys = [number_key(s) for s in ("-3", "3", "3.5", "35")]
    assert len({normalise_answer(k) for k in keys}) == 4
