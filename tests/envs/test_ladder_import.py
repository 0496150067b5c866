"""Multi-model result tables imported as guide-less ladders (docs/caches.md "Model ladders"):
``per-model`` (anyone's per-model JSONL files), ``routerarena`` and ``omnisbench-ladder``. Oracles: the
source lines themselves (read here with json, not with the importer), the sources' recorded costs,
and the one-round pair import the ladder is built from."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.helpers import FIXTURE_DATA, run_cli
from envs.cache.jsonl import read_jsonl, write_jsonl
from envs.cache.schema import CacheError
from envs.importers import import_cache

RA = FIXTURE_DATA / "routerarena"


def _write(folder, name, rows):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(model_correct, n=5, conf=True, skip=()):
    return [{"id": f"q{i}", "answer": "A" if c else f"wrong {i}", "correct": bool(c), "tokens_in": 10 + i,
             "tokens_out": 2 + i, **({"confidence": 0.1 * (i + 1)} if conf else {}), "gold": "A", "group": f"g{i % 2}"}
            for i, c in enumerate(model_correct[:n]) if f"q{i}" not in skip]


def test_per_model_folder_is_a_ladder_ordered_by_price(tmp_path):
    _write(tmp_path, "big", _rows([1, 1, 1, 1, 1]))
    _write(tmp_path, "small", _rows([1, 0, 0, 1, 0], conf=False))
    _write(tmp_path, "mid", _rows([1, 1, 0, 1, 0], skip={"q3"}))  # q3 only in two files: left out
    (tmp_path / "ladder.json").write_text(json.dumps({"name": "mine", "task": "qa", "order": "price", "models": [
        {"name": "big", "price_in": 5, "price_out": 15}, {"name": "small", "price_in": 0.1, "price_out": 0.2},
        {"name": "mid", "price_in": 1, "price_out": 2}]}))
    c = import_cache("per-model", tmp_path)
    m, a = c.manifest, c.arrays
    assert [r.name for r in m.base_ladder] == ["small", "mid", "big"] and not m.has_guide and c.T == 3
    assert list(a["question_ids"]) == ["q0", "q1", "q2", "q4"] and m.provenance["questions_dropped"] == 1
    want = {"small": [1, 0, 0, 0], "mid": [1, 1, 0, 0], "big": [1, 1, 1, 1]}
    for t, name in enumerate(("small", "mid", "big")):
        assert a["base_correct"][:, t].astype(int).tolist() == want[name]
    assert np.isnan(a["base_confidence"][:, 0]).all()  # the small model gave no confidence
    assert a["base_confidence"][:, 1].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.5])
    assert (a["guide_answer"] == -1).all() and not a["guide_correct"].any()
    # cost: round t = the rung's tokens at the rung's prices (tokens 10 + i in, 2 + i out)
    i = np.array([0, 1, 2, 4])
    for t, (pin, pout) in enumerate(((0.1, 0.2), (1, 2), (5, 15))):
        assert c.round_cost_cents()[:, t] == pytest.approx(((10 + i) * pin + (2 + i) * pout) / 1e4, rel=1e-6)
    assert list(a["group"]) == ["g0", "g1", "g0", "g0"]
    back = read_jsonl(write_jsonl(c, tmp_path / "out.jsonl"))
    assert back.checksum() == c.checksum()


def test_per_model_without_ladder_json_uses_the_list_prices(tmp_path):
    _write(tmp_path, "gpt-4o", _rows([1, 1, 1]))
    _write(tmp_path, "gpt-4o-mini", _rows([1, 0, 1]))
    c = import_cache("per-model", tmp_path)
    assert [r.name for r in c.manifest.base_ladder] == ["gpt-4o-mini", "gpt-4o"]
    assert (c.manifest.base_ladder[1].price_in, c.manifest.base_ladder[1].price_out) == (2.5, 10.0)
    _write(tmp_path, "my-model", _rows([1]))
    with pytest.raises(CacheError, match=r"my-model\.jsonl: no list price for the model 'my-model'"):
        import_cache("per-model", tmp_path)


@pytest.mark.parametrize("line, match", [
    ({"id": "q0", "answer": "A", "tokens_in": 1, "tokens_out": 1}, r"m\.jsonl:2: correct: missing"),
    ({"id": "q0", "answer": "A", "correct": "yes", "tokens_in": 1, "tokens_out": 1}, r"m\.jsonl:2: correct: expected true or false"),
    ({"id": "q0", "answer": "A", "correct": True, "tokens_in": -1, "tokens_out": 1},
     r"m\.jsonl:2: tokens_in: expected a number >= 0 and <= 1e\+07, got -1$"),
    # issue 48 item 13: these named the output, "OUT (not written): question 'q0': rounds[0].base...", or no file
    ({"id": "q0", "answer": "A", "correct": True, "tokens_in": 1e8, "tokens_out": 1},
     r"m\.jsonl:2: tokens_in: expected a number >= 0 and <= 1e\+07, got 100000000.0$"),
    ({"id": "q0", "answer": "A", "correct": True, "tokens_in": 1, "tokens_out": 1, "group": "g\u001b[2J"},
     r"m\.jsonl:2: group: 'g\\x1b\[2J' contains the control character U\+001B at index 1; a group name is printable"),
    ({"id": "q0", "answer": "A\ud800", "correct": True, "tokens_in": 1, "tokens_out": 1},
     r"m\.jsonl:2: answer: holds a lone surrogate U\+D800 at character 1 \(not Unicode text\)$"),
    ({"id": "", "answer": "A", "correct": True, "tokens_in": 1, "tokens_out": 1}, r'm\.jsonl:2: id: expected a non-empty string, got ""$'),
    ({"id": "q0", "answer": "A", "correct": True, "tokens_in": 1, "tokens_out": 1, "confidence": float("nan")},
     r"m\.jsonl:2: confidence: expected a number in \[0, 1\] or null, got NaN$"),
    ({"id": "q0", "answer": "A", "correct": True, "tokens_in": 1, "tokens_out": 1, "confidence": 1.5},
     r"m\.jsonl:2: confidence: expected a number in \[0, 1\]"),
    ({"id": "q1", "answer": "A", "correct": True, "tokens_in": 1, "tokens_out": 1}, r"m\.jsonl:2: id: 'q1' is given twice"),
])
def test_bad_per_model_lines_name_file_line_and_field(tmp_path, line, match):
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "q1", "answer": "A", "correct": True, "tokens_in": 1,
                                                  "tokens_out": 1}) + "\n" + json.dumps(line) + "\n")
    (tmp_path / "ladder.json").write_text(json.dumps({"models": [{"name": "m", "price_in": 1, "price_out": 1}]}))
    with pytest.raises(CacheError, match=match):
        import_cache("per-model", tmp_path)


def test_per_model_import_command_and_data_check(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write(src, "gpt-4o", _rows([1, 1, 1]))
    _write(src, "gpt-4o-mini", _rows([1, 0, 1]))
    r = run_cli(["data", "import", "--format", "per-model", str(src), "--out", str(tmp_path / "c.jsonl")])
    assert r.returncode == 0, r.stderr
    shown = run_cli(["data", "check", str(tmp_path / "c.jsonl")]).stdout
    assert "rounds 1: gpt-4o-mini" in shown and "rounds 2: gpt-4o" in shown and "guide model: none" in shown
    # a cascade has no guide call: no guide token, price or uncertainty lines (they read 0 before)
    assert "guide tokens" not in shown and "per guide call" not in shown and "guide uncertainty" not in shown
    (src / "gpt-4o.jsonl").write_text("{not json\n")
    r = run_cli(["data", "import", "--format", "per-model", str(src), "--out", str(tmp_path / "d.jsonl")])
    assert r.returncode == 2 and "gpt-4o.jsonl:1: not valid JSON" in r.stderr and not (tmp_path / "d.jsonl").exists()


def test_routerarena_fixture_against_its_own_lines():
    c = import_cache("routerarena", RA)
    m, a = c.manifest, c.arrays
    assert [r.name for r in m.base_ladder] == ["gemini-2.0-flash-001", "claude-3-haiku-20240307"]  # by price
    assert not m.has_guide and m.provenance["license"] == "Apache-2.0"
    raw = {}
    for t, f in enumerate(("gemini-2.0-flash-001", "claude-3-haiku-20240307")):
        for line in (RA / f"{f}.jsonl").read_text().splitlines():
            d = json.loads(line)
            raw[(d["global_index"], t)] = d
    qids = list(a["question_ids"])
    assert len(qids) == 60 and m.provenance["questions_dropped"] == 0
    cost = c.round_cost_cents()
    for q, qid in enumerate(qids):
        for t in range(2):
            d = raw[(qid, t)]
            ev = d["evaluation_result"]
            assert bool(a["base_correct"][q, t]) == (float(ev["score"]) >= 0.5)
            assert a["base_tokens_in"][q, t] == d["token_usage"]["input_tokens"]
            # tokens x list prices reproduce the recorded inference cost (USD -> cents)
            assert cost[q, t] == pytest.approx(100 * float(ev["inference_cost"]), abs=1e-4)
        assert a["group"][q] == qid.rsplit("_", 1)[0]


def test_omnisbench_ladder_is_the_pair_import_as_two_rungs():
    pair = import_cache("omnisbench", FIXTURE_DATA / "omnisbench")
    lad = import_cache("omnisbench-ladder", FIXTURE_DATA / "omnisbench")
    assert lad.T == 2 and not lad.manifest.has_guide
    assert [r.name for r in lad.manifest.base_ladder] == [pair.manifest.base.name, pair.manifest.guide.name]
    p, l = pair.arrays, lad.arrays
    assert list(l["question_ids"]) == list(p["question_ids"])
    assert np.array_equal(l["base_correct"][:, 0], p["base_correct"][:, 0])
    assert np.array_equal(l["base_correct"][:, 1], p["guide_correct"][:, 0])
    assert np.array_equal(l["base_tokens_out"][:, 1], p["guide_tokens_out"][:, 0])
    # the ladder's cost of both rounds is the pair's one round (same calls, same prices)
    assert lad.round_cost_cents().sum(axis=1) == pytest.approx(pair.round_cost_cents()[:, 0], rel=1e-5)
    assert math.isclose(float(lad.round_cost_cents().sum()), float(pair.round_cost_cents().sum()), rel_tol=1e-5)


def test_uala_ladder_is_three_rungs_with_the_pair_imports_answers_and_confidences():
    """Rungs 1-2 are the uala-hotpotqa import's round-1 base and guide answers (tested against the files' em
    fields in test_importers); rung 3 is the separate ReAct run, read here with json."""
    src = FIXTURE_DATA / "uala"
    pair = import_cache("uala-hotpotqa", src)
    lad = import_cache("uala-ladder", src)
    m, a, p = lad.manifest, lad.arrays, pair.arrays
    assert lad.T == 3 and not m.has_guide and [r.price_in for r in m.base_ladder] == [0.64, 1.5, 1.5]
    assert m.base_ladder[1].name == "gpt-3.5-turbo-instruct" and "ReAct" in m.base_ladder[2].name
    assert list(a["question_ids"]) == list(p["question_ids"]) and np.asarray(a["round_mask"]).all()
    for k in ("correct", "tokens_in", "tokens_out"):
        assert np.array_equal(a[f"base_{k}"][:, 0], p[f"base_{k}"][:, 0])
        assert np.array_equal(a[f"base_{k}"][:, 1], p[f"guide_{k}"][:, 0])
    # exp(-u) in rung 1 as the pair's base confidence; rung 2's is 1 - the pair's guide uncertainty 1 - exp(-u)
    np.testing.assert_allclose(a["base_confidence"][:, 0], p["base_confidence"][:, 0], rtol=1e-6)
    np.testing.assert_allclose(a["base_confidence"][:, 1], 1.0 - p["guide_uncertainty"][:, 0], atol=1e-6)
    assert np.isnan(a["base_confidence"][:, 2]).all()
    react = {}
    for line in (src / "outputs/HotpotQA/chatgpt-hotpotqa-dev-react.jsonl").read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            react[f"hotpotqa-dev/{d['question_idx']}"] = bool(d["em"])
    assert [bool(x) for x in a["base_correct"][:, 2]] == [react[q] for q in a["question_ids"]]
    # round t priced at rung t: tokens x the rung's list price (USD per million -> cents)
    cost = lad.round_cost_cents()
    for t, r in enumerate(m.base_ladder):
        want = (a["base_tokens_in"][:, t] * r.price_in + a["base_tokens_out"][:, t] * r.price_out) / 1e4
        np.testing.assert_allclose(cost[:, t], want, rtol=1e-5)
    assert (cost[:, 2] > cost[:, 1]).mean() > 0.9  # the ReAct rung spends more tokens on the same model


def _two_rungs(folder, small, big, models=None):
    """A per-model folder of two rungs (small, then big) with ``ladder.json``; ``small`` / ``big`` are rows."""
    folder.mkdir(exist_ok=True)
    _write(folder, "small", small)
    _write(folder, "big", big)
    ms = models or [{"name": "small", "price_in": 0.1, "price_out": 0.2}, {"name": "big", "price_in": 1, "price_out": 2}]
    (folder / "ladder.json").write_text(json.dumps({"models": ms}))
    return folder


def _line(qid, answer, correct, **kw):
    return {"id": qid, "answer": answer, "correct": correct, "tokens_in": 10, "tokens_out": 2, **kw}


def test_rungs_that_contradict_are_refused_on_every_path_naming_both_source_lines(tmp_path):
    """Issue 48 item 9: rung 2 repeats rung 1's answer ('paris' = 'Paris' normalised) with the other flag.
    The import used to succeed; its JSONL output then failed ``data check``, its fast output passed it.
    Now the import refuses, naming both source lines, and writes nothing, to either format."""
    src = _two_rungs(tmp_path / "src", [_line("q0", "Lyon", False), _line("q1", "Paris", True)],
                     [_line("q0", "Rome", False), _line("q1", "paris", False)])
    want = (f"error: {src / 'big.jsonl'}:2: correct: false contradicts {src / 'small.jsonl'}:2 (correct: true) for the "
            "same normalised answer 'paris' (question 'q1'); a cache holds one flag per answer of a question: "
            "correct one of the lines")
    for out in (tmp_path / "c.jsonl", tmp_path / "fast"):
        r = run_cli(["data", "import", "--format", "per-model", str(src), "--out", str(out)], in_subprocess=out.suffix == "")
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [want]
        assert not out.exists()
    # the gold rule, across files: the gold given by one rung's file judges every rung's answer
    _two_rungs(src, [_line("q1", "Lyon", False, gold="Paris")], [_line("q1", "the paris", False)])
    with pytest.raises(CacheError) as e:
        import_cache("per-model", src)
    assert str(e.value) == (f"{src / 'big.jsonl'}:1: correct: false, but the answer 'the paris' equals the gold "
                            "answer 'Paris' after normalisation (question 'q1')")


def test_the_last_word_places_a_value_problem_at_its_source_line(tmp_path, monkeypatch):
    """Behind the per-line and per-question checks, the built cache goes through the shared value rules
    (``envs.cache.values``) before it is returned; a problem they find is placed at the rung's file and line
    (here the per-question check is switched off to reach it)."""
    import envs.importers.ladder as ladder

    monkeypatch.setattr(ladder, "_conflict", lambda qid, lines: None)
    src = _two_rungs(tmp_path / "src", [_line("q0", "Lyon", False), _line("q1", "Paris", True)],
                     [_line("q0", "Rome", False), _line("q1", "paris", False)])
    with pytest.raises(CacheError) as e:
        import_cache("per-model", src)
    assert str(e.value) == (f"{src / 'big.jsonl'}:2: correct: false contradicts rounds[0].base.correct = true for the "
                            "same normalised answer 'paris' (question 'q1')")


def test_every_rung_price_goes_through_the_cache_price_rule(tmp_path):
    """Issue 48 item 10: 1e7 USD per M on rung 2 of ladder.json imported with exit 0, and every reader then
    refused the output (only the first rung's price was checked on write). Now the import refuses, naming
    ladder.json and the rung, with the readers' own text, and writes nothing."""
    models = [{"name": "small", "price_in": 0.1, "price_out": 0.2}, {"name": "big", "price_in": 1e7, "price_out": 2}]
    src = _two_rungs(tmp_path / "src", [_line("q0", "A", True)], [_line("q0", "A", True)], models)
    for out in (tmp_path / "c.jsonl", tmp_path / "fast"):
        r = run_cli(["data", "import", "--format", "per-model", str(src), "--out", str(out)])
        assert r.returncode == 2 and not out.exists()
        assert r.stderr.strip().splitlines() == [
            f"error: {src / 'ladder.json'}: models[1].price_in: expected a number >= 0 and <= 1e+05 (USD per million "
            "tokens), got 10000000.0"]
    models[1].update(price_in=1e5)  # the bound itself is a price
    ok = import_cache("per-model", _two_rungs(src, [_line("q0", "A", True)], [_line("q0", "A", True)], models))
    assert ok.manifest.base_ladder[1].price_in == 1e5
    models[1].pop("price_in")
    with pytest.raises(CacheError, match=r"ladder\.json: models\[1\]\.price_in: missing$"):
        import_cache("per-model", _two_rungs(src, [_line("q0", "A", True)], [_line("q0", "A", True)], models))
    # OmnisBench's pricing YAML, the other file of prices an importer reads
    om = tmp_path / "om"
    om.mkdir()
    (om / "results.json").write_text((FIXTURE_DATA / "omnisbench" / "results_2026-08-19.json").read_text())
    yaml_text = (FIXTURE_DATA / "omnisbench" / "pricing_2026-08-18.yaml").read_text()
    (om / "pricing_2026-08-18.yaml").write_text(yaml_text.replace("output_per_mtok: 25.00", "output_per_mtok: 2.5e7"))
    with pytest.raises(CacheError) as e:
        import_cache("omnisbench", om / "results.json")
    assert str(e.value) == (f"{om / 'pricing_2026-08-18.yaml'}: models.anthropic/claude-opus-5.output_per_mtok: "
                            "expected a number >= 0 and <= 1e+05 (USD per million tokens), got 25000000.0")


@pytest.mark.parametrize("spec, problem", [
    # issue 48 item 11: a typo was taken silently as the given order
    ({"order": "prise"}, 'order: expected "given" or "price", got "prise"'),
    ({"order": None}, 'order: expected "given" or "price", got null'),
    ({"name": 5}, "name: expected a string, got number 5"),
    ({"license": ["CC0"]}, "license: expected a string, got array"),
    ({"models": [{"name": "small", "price_in": 0, "price_out": 0, "file": 3}]},
     "models[0].file: expected a string (the model's file in {src}), got 3"),
])
def test_ladder_json_refuses_values_it_would_otherwise_take_silently(tmp_path, spec, problem):
    src = _two_rungs(tmp_path / "src", [_line("q0", "A", True)], [_line("q0", "A", True)])
    doc = {**json.loads((src / "ladder.json").read_text()), **spec}
    (src / "ladder.json").write_text(json.dumps(doc))
    r = run_cli(["data", "import", "--format", "per-model", str(src), "--out", str(tmp_path / "c.jsonl")])
    assert r.returncode == 2 and not (tmp_path / "c.jsonl").exists()
    assert r.stderr.strip().splitlines() == [f"error: {src / 'ladder.json'}: {problem.format(src=src)}"]


def test_ladder_json_orders_given_and_price_and_a_deep_file_is_one_line(tmp_path):
    src = _two_rungs(tmp_path / "src", [_line("q0", "A", True)], [_line("q0", "A", True)])
    doc = json.loads((src / "ladder.json").read_text())
    doc["models"].reverse()  # listed dearest first
    for order, want in ((None, ["big", "small"]), ("given", ["big", "small"]), ("price", ["small", "big"])):
        (src / "ladder.json").write_text(json.dumps(doc if order is None else {**doc, "order": order}))
        assert [m.name for m in import_cache("per-model", src).manifest.base_ladder] == want
    (src / "ladder.json").write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError traceback before
    with pytest.raises(CacheError, match=r"ladder\.json: JSON nested too deeply"):
        import_cache("per-model", src)


def _routerarena_copy(tmp_path, edit_first_line):
    """The fixture's two files in ``tmp_path/ra``, the first line of gemini's edited by ``edit_first_line``."""
    ra = tmp_path / "ra"
    ra.mkdir()
    for f in RA.glob("*.jsonl"):
        lines = f.read_text().splitlines()
        if f.stem == "gemini-2.0-flash-001":
            lines[0] = edit_first_line(lines[0])
        (ra / f.name).write_text("\n".join(lines) + "\n")
    return ra, ra / "gemini-2.0-flash-001.jsonl"


@pytest.mark.parametrize("edit, problem", [
    # issue 48 item 12: a MemoryError traceback (Python's parser nests each unary minus)
    (lambda d: d.update(token_usage="-" * 100_000 + "1"), "1: token_usage: expected an object, got '" + "-" * 60 + "'"),
    (lambda d: d.update(token_usage="[" * 2_000_000), "1: token_usage: expected an object, got a text of 2000000 "
                                                       "characters (at most 1048576 are parsed)"),
    (lambda d: d.update(token_usage="{'input_tokens': 3, 'output_tokens': 4}"), None),  # the files' Python literals
    (lambda d: d.update(token_usage={"input_tokens": 10 ** 400, "output_tokens": 4}),
     "1: token_usage.input_tokens: expected a number, got 1" + "0" * 36 + "..."),
])
def test_routerarena_bounds_what_it_parses(tmp_path, edit, problem):
    def change(line):
        d = json.loads(line)
        edit(d)
        return json.dumps(d)

    ra, gem = _routerarena_copy(tmp_path, change)
    if problem is None:
        c = import_cache("routerarena", ra)
        assert (c.arrays["base_tokens_in"][0, 0], c.arrays["base_tokens_out"][0, 0]) == (3, 4)
        return
    r = run_cli(["data", "import", "--format", "routerarena", str(ra), "--out", str(tmp_path / "c.jsonl")],
                in_subprocess=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "c.jsonl").exists()
    assert r.stderr.strip().splitlines() == [f"error: {gem}:{problem}"]


@pytest.mark.parametrize("line, problem", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),  # RecursionError tracebacks before
    ('{"x": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),  # ValueError
    ('{"x": "\\ud800"} \xff', "not UTF-8 text"),
])
def test_importer_lines_past_the_parsers_limits_are_one_error_line(tmp_path, line, problem):
    ra, gem = _routerarena_copy(tmp_path, lambda first: line)
    if "\xff" in line:  # a byte that is not UTF-8
        gem.write_bytes(gem.read_bytes().replace("\xff".encode(), b"\xff", 1))
    with pytest.raises(CacheError) as e:
        import_cache("routerarena", ra)
    assert str(e.value).startswith(f"{gem}:1: {problem}")


def test_importer_messages_name_the_source_file_on_one_line(tmp_path):
    """Issue 48 item 13 through the CLI: a per-model value error named the output ("OUT (not written)"), a
    control character in a per-model group or a RouterArena dataset named no file ("pm: question 'q0':
    group: ..."), and a malformed OmnisBench pricing YAML printed three lines."""
    pm = _two_rungs(tmp_path / "pm", [_line("q0", "A", True, group="g\u001b[2J")], [_line("q0", "A", True, group="g")])
    ra, _ = _routerarena_copy(tmp_path, lambda line: line)
    for f in ra.glob("*.jsonl"):  # in both files (a question in one file only is dropped before any check)
        f.write_text(f.read_text().replace('"AIME_112"', '"AIME\\u001b[2J_112"', 1))
    om = tmp_path / "om"
    om.mkdir()
    (om / "results.json").write_text((FIXTURE_DATA / "omnisbench" / "results_2026-08-19.json").read_text())
    (om / "pricing_2026-08-18.yaml").write_text("models:\n  a: [1, 2\n  b: {x: 1}\n")
    cases = [
        ("per-model", pm, f"{pm / 'small.jsonl'}:1: group: 'g\\x1b[2J' contains the control character U+001B at index 1"),
        ("routerarena", ra, f"{ra / 'claude-3-haiku-20240307.jsonl'}:1: global_index: its dataset part is the "
                            "question's group: 'AIME\\x1b[2J' contains the control character U+001B at index 4"),
        ("omnisbench", om, f"{om / 'pricing_2026-08-18.yaml'}: line 3, column 4: not valid YAML (expected ',' or ']', "
                           "but got ':')"),
    ]
    for fmt, src, want in cases:
        out = tmp_path / f"{fmt}.jsonl"
        r = run_cli(["data", "import", "--format", fmt, str(src), "--out", str(out)], in_subprocess=fmt == "omnisbench")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and not out.exists() and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"error: {want}"), lines[0]
