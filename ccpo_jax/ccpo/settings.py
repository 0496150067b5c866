"""One setting per table of the CCPO paper (arXiv 2511.11828, Tables 2-9).

A :class:`Setting` says which task, base model, alpha and lambda values a
table used, how the questions were split (the paper's §5: 1000/200/200 for
HotpotQA, 560/200/200 for MMLU) and which synthetic profile stands in for the
paper's (unreleased) response cache. It also carries the paper's published
numbers for that table, used only for the side-by-side column of ``table.md``
(never as a target of anything).

Row names are those of docs/reproduce.md ("Settings"), which results.json and
table.md use; the paper's rows map to them as follows:

===============================  ==========================================
paper row                        project row
===============================  ==========================================
``GPT-4o EXIT``                  ``GPT-4o EXIT``
``LLaMA-2 EXIT``                 ``LLaMA-2-7B EXIT`` (``<model> EXIT``)
``Random``                       ``Random``
``GPT-4o``                       ``LLM policy (GPT-4o)``
``LLaMA-2-7B`` / ``LLaMA-3.2-3b``  ``LLM policy (LLaMA-2-7B)`` / ``LLM policy (LLaMA-3.2-3B)``
``UALA``                         ``UALA``
``CPO`` / ``CPO batch`` /        same
``CPO online``
``CCPO (λ=0)``                   ``CCPO (lambda=0)``
``CCPO (λ=2e-4)``                ``CCPO (lambda=2e-4)`` (:func:`lambda_row_name`)
===============================  ==========================================
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping


from ccpo_jax.ccpo.rowid import (GUIDE_MODEL, RowId, Twin, exit_row, format_lambda, lambda_row, llm_policy_row,
                                 row_key)
from ccpo_jax.errors import UserError
from envs import published
from envs.cache.values import md_code

#: The evaluation protocols (``ccpo_jax.ccpo.splits``): recalibrate (the paper's box plots: one
#: training set, calibration/test redrawn per split) and retrain (every split trains its own policy).
PROTOCOLS = ("recalibrate", "retrain")

#: Per-split metrics, in the paper's column order (Cost (cents) / Coverage / Avg. Len. / Set Size).
METRICS = ("cost_cents", "coverage", "avg_len", "set_size")

BASE_MODELS = {"llama2": "LLaMA-2-7B", "llama3": "LLaMA-3.2-3B"}


def lambda_row_name(lam: float) -> str:
    """Row name of CCPO with set-size penalty ``lam`` (docs/reproduce.md): ``CCPO (lambda=2e-4)``."""
    return lambda_row(lam).name


def llm_policy_row_name(model: str) -> str:
    """Row of the prompted-LLM policy baseline (arXiv 2511.11828 §5, App. 8.3): ``LLM policy (GPT-4o)``."""
    return llm_policy_row(model).name


def exit_row_name(model: str) -> str:
    """Row of the LLM-EXIT baseline of ``model`` (arXiv 2511.11828 §5, App. 8.2): ``GPT-4o EXIT``."""
    return exit_row(model).name


#: How a kept-seed twin (``rowid.Twin.KEPT_SEED``) chose its seed (results.json ``kept_seed.rule``, the exported
#: router's ``seed_rule``).
KEPT_RULE = ("of the row's training seeds, the one whose calibrated sets cost least on the training questions it was "
             "trained on (threshold fitted there, in-sample); no calibration or test question is looked at")
#: How an ensemble twin's (``rowid.Twin.ENSEMBLE``) policy is made (results.json, the exported router's
#: ``seed_rule``).
ENSEMBLE_RULE = ("pi(a|o) is the mean of the seeds' probabilities (each softmax over the available actions), and "
                 "the set {a : pi(a|o) >= kappa} is calibrated on it like any policy's")


def served_row(row: str, seed_rule: str | None) -> str:
    """The table's name of a saved policy (``policies/ROW``, an exported router): ``ROW [kept seed]`` when it
    is ROW's kept seed (its ``seed_rule``), else ``row`` (an ensemble row, a one-seed run, an older run).
    One name for one policy in table.md, ``export``, ``serve``, the gateway and ``live-eval``."""
    rid = RowId.parse(row)  # a boundary: the name an artefact's manifest or policy.json holds
    kept = str(seed_rule or "").startswith("the kept seed") and rid.twin is not Twin.KEPT_SEED
    return rid.twin_of(Twin.KEPT_SEED).name if kept else row


def twin_notes(rows) -> list[str]:
    """table.md's header lines saying what the seed twins among ``rows`` are (none without them)."""
    out, twins = [], {RowId.parse(r).twin for r in rows}  # names read back from results.json
    kept, ens = Twin.KEPT_SEED.value, Twin.ENSEMBLE.value
    if Twin.KEPT_SEED in twins:
        out.append(f"- ROW{kept}: one seed of ROW, the one whose calibrated sets cost least on its own training "
                   "questions (threshold fitted there; no calibration or test question looked at); `policies/ROW` "
                   f"holds it and `export --row 'ROW{kept}'` serves it; cells over splits")
    if Twin.ENSEMBLE in twins:
        out.append(f"- ROW{ens}: ROW's seeds as one policy, pi the mean of their probabilities, calibrated on "
                   f"each split like any row; `policies/ROW-ensemble` holds it and `export --row 'ROW{ens}'` "
                   "serves it; cells over splits")
    return out


@dataclasses.dataclass(frozen=True)
class Setting:
    """One paper table: task, models, alpha, lambda, split sizes, and the published numbers."""

    name: str
    """Name used on the command line (``--setting``), e.g. ``hotpotqa-llama2-a0.1``."""
    table: int
    """Number of the paper's table (2-9) this setting reproduces."""
    task: str
    """Task of the questions: ``hotpotqa`` or ``mmlu``."""
    base_model: str
    """Display name of the cheap base model (``LLaMA-2-7B`` or ``LLaMA-3.2-3B``)."""
    guide_model: str
    """Display name of the expensive guide model (``GPT-4o``)."""
    profile: str
    """Synthetic-cache profile (``envs.generators.synthetic.PROFILES``) that stands in for the paper's data."""
    n_questions: int
    """Questions in the built-in synthetic cache: n_train + n_cal + n_test of the paper."""
    alpha: float
    """Miscoverage level: the target coverage is 1 - alpha."""
    lambdas: tuple[float, ...]
    """Nonzero set-size penalties of the table's ``CCPO (lambda=...)`` row(s); lambda = 0 always runs too."""
    n_train: int
    """Training questions per split (paper: 1000 HotpotQA, 560 MMLU)."""
    n_cal: int
    """Calibration questions per split (paper: 200)."""
    n_test: int
    """Test questions per split (paper: 200)."""
    paper: Mapping[str, Mapping[str, float]]
    """The paper's published numbers of the table: row name -> {metric in METRICS: value}.
    For side-by-side comparison in table.md only."""

    @property
    def split_sizes(self) -> tuple[int, int, int]:
        """(n_train, n_cal, n_test)."""
        return (self.n_train, self.n_cal, self.n_test)

    @property
    def all_lambdas(self) -> tuple[float, ...]:
        """Every CCPO lambda of the table, 0 first."""
        return (0.0,) + tuple(self.lambdas)

    @property
    def description(self) -> str:
        return (
            f"paper Table {self.table}: {self.task_title}, {self.base_model} + {self.guide_model}, "
            f"alpha={self.alpha:g}, lambda={', '.join(format_lambda(x) for x in self.all_lambdas)}"
        )

    def run_title(self, cache_name: str, own_cache: bool, alpha: float | None = None) -> str:
        """What a run of this setting is, honestly: the paper's table only on the setting's own
        (synthetic) cache; any other cache is named as a custom cache run with the setting's
        alpha and lambdas. ``alpha``: the run's alpha if ``--alpha`` overrode the setting's."""
        alpha = self.alpha if alpha is None else float(alpha)
        lams = ", ".join(format_lambda(x) for x in self.all_lambdas)
        same = abs(alpha - self.alpha) < 1e-12
        if own_cache:
            a = f"alpha={alpha:g}" + ("" if same else f" (the paper's: {self.alpha:g})")
            return (f"paper Table {self.table}: {self.task_title}, {self.base_model} + {self.guide_model}, "
                    f"{a}, lambda={lams}")
        if same:
            return (f"custom cache {md_code(cache_name)} with the Table {self.table} setting's alpha and lambdas "
                    f"(alpha={alpha:g}, lambda={lams})")
        return (f"custom cache {md_code(cache_name)} with the Table {self.table} setting's lambdas "
                f"(lambda={lams}) and alpha={alpha:g}")

    @property
    def task_title(self) -> str:
        return {"hotpotqa": "HotpotQA", "mmlu": "MMLU"}.get(self.task, self.task)

    def paper_row(self, row: str) -> Mapping[str, float] | None:
        """The paper's numbers for project row ``row`` (matched loosely), or None."""
        if row in self.paper:
            return self.paper[row]
        k = row_key(row)
        for name, vals in self.paper.items():
            if row_key(name) == k:
                return vals
        return None


def _paper_rows(table: int, base_model: str, lam: float) -> Mapping[str, Mapping[str, float]]:
    """Table ``table``'s published rows (:data:`envs.published.TABLES`) under this project's row names."""
    names = {
        "GX": exit_row_name(GUIDE_MODEL),
        "BX": exit_row_name(base_model),
        "GP": llm_policy_row_name(GUIDE_MODEL),
        "BP": llm_policy_row_name(base_model),
        "L0": lambda_row_name(0.0),
        "L": lambda_row_name(lam),
    }
    out = {}
    for kind, *vals in published.TABLES[table]:
        out[names.get(kind, kind)] = MappingProxyType(dict(zip(published.COLUMNS, map(float, vals))))
    return MappingProxyType(out)


def _setting(task: str, model: str, alpha: float, table: int, lam: float) -> Setting:
    base = BASE_MODELS[model]
    n_train = {"hotpotqa": 1000, "mmlu": 560}[task]
    n_cal = n_test = 200
    return Setting(
        name=f"{task}-{model}-a{alpha:g}",
        table=table,
        task=task,
        base_model=base,
        guide_model=GUIDE_MODEL,
        profile=f"{task}-{model}",
        n_questions=n_train + n_cal + n_test,
        alpha=alpha,
        lambdas=(lam,),
        n_train=n_train,
        n_cal=n_cal,
        n_test=n_test,
        paper=_paper_rows(table, base, lam),
    )


#: Every setting, by name, in table order (the lambda of each table: arXiv 2511.11828, Tables 2-9).
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        _setting("hotpotqa", "llama2", 0.1, 2, 2e-4),
        _setting("hotpotqa", "llama3", 0.1, 3, 1e-4),
        _setting("mmlu", "llama2", 0.1, 4, 2e-4),
        _setting("mmlu", "llama3", 0.1, 5, 1e-4),
        _setting("hotpotqa", "llama2", 0.2, 6, 1e-4),
        _setting("hotpotqa", "llama3", 0.05, 7, 1e-4),
        _setting("mmlu", "llama2", 0.2, 8, 2e-4),
        _setting("mmlu", "llama3", 0.2, 9, 2e-4),
    )
}

#: Table 2's setting: the default of ``ccpo-jax reproduce``.
DEFAULT_SETTING = "hotpotqa-llama2-a0.1"


def get_setting(name: str) -> Setting:
    """The setting called ``name``; a :class:`UserError` listing the valid names otherwise."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise UserError(
            f"setting: unknown setting {name!r}; valid settings: {', '.join(SETTINGS)} "
            "(see `ccpo-jax reproduce --list-settings`)", field="setting",
        ) from None


def settings_table() -> str:
    """Text listing of every setting (``ccpo-jax reproduce --list-settings``)."""
    lines = [f"{'setting':24s} {'table':5s} {'alpha':5s} {'lambda':8s} {'splits':12s} profile"]
    for s in SETTINGS.values():
        lam = ",".join(format_lambda(x) for x in s.lambdas)
        sizes = "/".join(map(str, s.split_sizes))
        lines.append(f"{s.name:24s} {s.table:<5d} {s.alpha:<5g} {lam:8s} {sizes:12s} {s.profile} (synthetic)")
    return "\n".join(lines)
