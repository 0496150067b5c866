"""OmnisBench results -> a single-round cascade cache (T = 1) with real tokens and costs.

Source (``tests/fixtures/SOURCES.md``): Fortitude-Group/OmnisBench @15674d9b,
``runs/*/results.json`` and the dated pricing YAML (Apache-2.0). A results
file lists, per routing policy, one record per benchmark item with the model
the policy chose, ``passed``, ``cost_usd``, ``input_tokens``,
``output_tokens`` and ``response_text``.

Read as a cascade with T = 1 (docs/caches.md, "Real data"): the ``always_cheap`` policy's
model is the base, the ``always_big`` policy's model the guide (its answer is
the corrected answer). The ``random`` and ``oracle`` policies are routers over
four models, not runs of these two models nor LLM-EXIT runs, so they are not
imported (no EXIT / LLM-policy rows).

- *correct* = ``passed`` (OmnisBench's own grader: numeric match for GSM8K,
  unit tests for HumanEval / LiveCodeBench);
- *tokens* = the file's ``input_tokens`` / ``output_tokens`` (real counts);
- *prices* = ``pricing_<snapshot_date>.yaml`` beside the results file (the
  snapshot the run names in ``provenance.snapshot_date``). The importer checks
  tokens x prices against each record's ``cost_usd`` and stores the largest
  deviation in the provenance (``cost_check``); the cache's cents are
  tokens x prices, i.e. ``cost_usd * 100`` up to that deviation;
- *answers*: GSM8K: gold = the ``reference`` number (written 'minus 3 point 5',
  as RouteLLM GSM8K answers), a passed answer is the gold answer, a failed one
  is keyed by the last number of its response (a failed one whose number equals
  the gold is kept apart as '<n> graded wrong');
  code tasks: a passed solution gets the gold id and all failed ones share one
  'wrong' id (two failing programs count as the same answer; set size is then a
  lower bound). Guide verdict = same answer id (agreement);
- no confidence / uncertainty (NaN).

``src`` is a results JSON or a folder; a folder means every ``results*.json``
in it (sorted by name). Question ids are ``<run date>/<dataset>/<item_id>``,
so items re-run in several files stay separate questions.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from envs.cache.schema import CacheError, ModelInfo, ResponseCache
from envs.cache.values import price_problem
from envs.importers import CASCADE_PROTOCOL, GOLD_KEY, Side, build_cache, correctness_key, number_key
from envs.importers.pricing import yaml_error_text
from envs.importers.routellm import final_number

REPO = "Fortitude-Group/OmnisBench @15674d9b"
LICENSE = "Apache-2.0"
BASE_POLICY, GUIDE_POLICY = "always_cheap", "always_big"
_ITEM_FIELDS = {
    "policy": str,
    "dataset": str,
    "item_id": str,
    "chosen_model": str,
    "passed": bool,
    "cost_usd": (int, float),
    "input_tokens": int,
    "output_tokens": int,
}


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CacheError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise CacheError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise CacheError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CacheError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


def read_pricing(path: Path) -> dict[str, tuple[float, float]]:
    """``pricing_<date>.yaml`` -> {model: (USD per M input tokens, USD per M output tokens)}."""
    import yaml

    if not path.is_file():
        raise CacheError(f"{path}: pricing file not found (named by the results' provenance.snapshot_date)")
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise CacheError(f"{path}: {yaml_error_text(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CacheError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    except RecursionError:
        raise CacheError(f"{path}: not valid YAML (nested too deeply)") from None
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict) or not models:
        raise CacheError(f"{path}: missing field 'models'")
    out = {}
    for name, p in models.items():
        try:
            pin, pout = float(p["input_per_mtok"]), float(p["output_per_mtok"])
        except (TypeError, KeyError, ValueError, OverflowError):
            raise CacheError(f"{path}: models.{name}: needs numbers 'input_per_mtok' and 'output_per_mtok'") from None
        for key, v in (("input_per_mtok", pin), ("output_per_mtok", pout)):
            problem = price_problem(v)  # the cache's own price rule (envs.cache.values), as every reader applies it
            if problem:
                raise CacheError(f"{path}: models.{name}.{key}: {problem}")
        out[name] = (pin, pout)
    return out


def _items(path: Path, doc) -> list[dict]:
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise CacheError(f"{path}: missing field 'items' (a list): not an OmnisBench results file")
    if not doc["items"]:
        raise CacheError(f"{path}: 'items' is empty")
    for i, it in enumerate(doc["items"]):
        if not isinstance(it, dict):
            raise CacheError(f"{path}: items[{i}]: expected an object")
        for k, typ in _ITEM_FIELDS.items():
            if k not in it:
                raise CacheError(f"{path}: items[{i}]: missing field '{k}'")
            v = it[k]
            if not isinstance(v, typ) or (typ is not bool and isinstance(v, bool)):
                raise CacheError(f"{path}: items[{i}].{k}: expected {getattr(typ, '__name__', 'a number')}, got {v!r}")
        for k in ("input_tokens", "output_tokens", "cost_usd"):
            if not math.isfinite(it[k]) or it[k] < 0:
                raise CacheError(f"{path}: items[{i}].{k}: must be finite and >= 0, got {it[k]!r}")
    return doc["items"]


def _answer_key(it: dict, gold: str, role: str) -> str:
    if it["dataset"] == "gsm8k":
        if it["passed"]:
            return gold or GOLD_KEY
        num = final_number(str(it.get("response_text", "")))
        if num is None:
            return f"no number ({role})"
        key = number_key(num)
        return key if key != gold else f"{key} (graded wrong)"
    return correctness_key(it["passed"])


def load(src: Path) -> ResponseCache:
    """Build the T = 1 cascade cache from one results JSON or a folder of them."""
    files = sorted(p for p in src.glob("results*.json") if p.is_file()) if src.is_dir() else [src]
    if not files:
        raise CacheError(f"{src}: no results*.json files (expected OmnisBench run results)")
    ids, gold, rounds, datasets, groups = [], [], [], set(), []
    models: dict[str, set] = {BASE_POLICY: set(), GUIDE_POLICY: set()}
    prices: dict[str, tuple[float, float]] = {}
    max_dev, n_checked, snapshots = 0.0, 0, []
    for path in files:
        doc = _read_json(path)
        items = _items(path, doc)
        prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
        snap = prov.get("snapshot_date")
        if not isinstance(snap, str):
            raise CacheError(f"{path}: missing field 'provenance.snapshot_date' (names the pricing YAML)")
        pricing_path = path.parent / f"pricing_{snap}.yaml"
        table = read_pricing(pricing_path)
        snapshots.append(pricing_path.name)
        run = str(prov.get("run_date") or path.stem.removeprefix("results_"))
        pairs: dict[tuple[str, str], dict[str, tuple[int, dict]]] = {}
        for i, it in enumerate(items):
            if it["policy"] not in models:
                continue
            key = (it["dataset"], it["item_id"])
            slot = pairs.setdefault(key, {})
            if it["policy"] in slot:
                raise CacheError(f"{path}: items[{i}]: second '{it['policy']}' record for {key[0]}/{key[1]}")
            slot[it["policy"]] = (i, it)
        for (ds, item_id), slot in pairs.items():
            sides = []
            for pol in (BASE_POLICY, GUIDE_POLICY):
                if pol not in slot:
                    raise CacheError(f"{path}: {ds}/{item_id} has no '{pol}' record (need both policies per item)")
                i, it = slot[pol]
                m = it["chosen_model"]
                if m not in table:
                    raise CacheError(f"{path}: items[{i}].chosen_model {m!r} has no price in {pricing_path}")
                if m in prices and prices[m] != table[m]:
                    raise CacheError(f"{pricing_path}: price of {m!r} differs from the other runs' pricing file")
                prices[m] = table[m]
                models[pol].add(m)
                dev = abs((it["input_tokens"] * table[m][0] + it["output_tokens"] * table[m][1]) / 1e6 - it["cost_usd"])
                max_dev, n_checked = max(max_dev, dev), n_checked + 1
                sides.append(it)
            b_it, g_it = sides
            g_text = ""
            if ds == "gsm8k":
                ref = str(b_it.get("reference", "")).strip()
                num = final_number(ref)
                g_text = number_key(num) if num is not None else ref
            b = Side(_answer_key(b_it, g_text, "base"), b_it["passed"], b_it["input_tokens"], b_it["output_tokens"])
            g = Side(_answer_key(g_it, g_text, "guide"), g_it["passed"], g_it["input_tokens"], g_it["output_tokens"])
            ids.append(f"{run}/{ds}/{item_id}")
            gold.append(g_text)
            rounds.append([(b, g)])
            datasets.add(ds)
            groups.append(str(ds))
    for pol, ms in models.items():
        if len(ms) != 1:
            raise CacheError(f"{src}: policy '{pol}' uses {len(ms)} models {sorted(ms)}; expected exactly one")
    (base_name,), (guide_name,) = models[BASE_POLICY], models[GUIDE_POLICY]
    base = ModelInfo(base_name, *prices[base_name])
    guide = ModelInfo(guide_name, *prices[guide_name])
    provenance = {
        "kind": "real",
        "source": f"{REPO}, runs/*/results.json: " + ", ".join(p.name for p in files),
        "license": LICENSE,
        "protocol": CASCADE_PROTOCOL,
        "base": f"{base_name} ('{BASE_POLICY}' policy records)",
        "guide": f"{guide_name} ('{GUIDE_POLICY}' policy records; its answer is the guide's corrected answer)",
        "verdict": "guide verdict = guide answer id equals base answer id (agreement); code tasks: both pass or both fail",
        "tokens": "input_tokens / output_tokens as recorded (real counts)",
        "prices": "USD per M tokens from " + ", ".join(sorted(set(snapshots))),
        "cost_check": f"max |tokens x prices - cost_usd| = {max_dev:.3g} USD over {n_checked} records",
    }
    return build_cache(
        name="omnisbench" if len(files) > 1 else f"omnisbench-{files[0].stem.removeprefix('results_')}",
        task="+".join(sorted(datasets)),
        base=base,
        guide=guide,
        provenance=provenance,
        question_ids=ids,
        gold=gold,
        rounds=rounds,
        T=1,
        groups=groups,
    )


def load_ladder(src: Path) -> ResponseCache:
    """Format ``omnisbench-ladder``: :func:`load`'s runs as a two-rung ladder without a guide (round 1 the
    cheap model's answer, round 2 the big model's own answer; ``envs.importers.ladder.pair_to_ladder``)."""
    from envs.importers.ladder import pair_to_ladder

    return pair_to_ladder(load(src), str(src))
