"""A real llama.cpp ``llama-server`` serving tiny GGUF models whose next-token probabilities are designed.

The models are bigram models in the llama architecture: every attention and feed-forward
weight is zero, so the residual stream at a position is its token's embedding and the
next-token distribution depends on the current token only. Embeddings are one-hot, the
final RMS norm's gain undoes the norm (a one-hot row has RMS ``sqrt(1/n + eps)``), and
column k of the output matrix holds the designed log-probabilities of the tokens that follow
token k. The chat template ends the prompt with ``<|assistant|>``, so a reply is a walk of
the chain from that token (``BASE`` / ``GUIDE`` below): the base replies ``Answer: Paris``
(p 0.45), ``Answer: Rome`` (0.30) or ``Answer: Berlin`` (0.25); the guide ``Yes`` (0.70) or
``No Paris`` (0.30). So at temperature 0 the base's answer confidence is 0.45 and the
guide's verdict uncertainty is 1 - 0.70 = 0.30, known before any call.

The GGUF file is written here from the format's specification (header, key-value metadata,
tensor descriptors, 32-byte-aligned F32 data); no package is needed. The tokenizer is a
SentencePiece-style vocabulary with byte fallback (the 256 ``<0xNN>`` tokens), so any prompt
tokenizes.

``python -m ccpo_jax.testing.llama_server record LLAMA_SERVER_BINARY OUT_DIR`` starts the binary on both
models and records the reply bodies kept in ``tests/fixtures/llama_server/``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

N_EMBD, N_HEAD, N_FF, N_CTX = 64, 2, 64, 4096
RMS_EPS = 1e-6
ASSISTANT = "<|assistant|>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["Answer:", "\u2581Paris", "\u2581Rome", "\u2581Berlin", "Yes", "No"]
EOS = "</s>"
#: token -> {next token: probability}; the walk starts at <|assistant|> and ends at </s>.
BASE = {ASSISTANT: {"Answer:": 1.0},
        "Answer:": {"\u2581Paris": 0.45, "\u2581Rome": 0.30, "\u2581Berlin": 0.25},
        "\u2581Paris": {EOS: 1.0}, "\u2581Rome": {EOS: 1.0}, "\u2581Berlin": {EOS: 1.0}}
GUIDE = {ASSISTANT: {"Yes": 0.70, "No": 0.30},
         "Yes": {EOS: 1.0}, "No": {"\u2581Paris": 1.0}, "\u2581Paris": {EOS: 1.0}}
#: Logit of every token the design does not name (exp(-40) x 270 tokens ~ 1e-15 of mass).
OFF = -40.0


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their types (1 normal, 2 unknown, 3 control, 6 byte)."""
    toks = ["<unk>", "<s>", EOS] + [f"<0x{b:02X}>" for b in range(256)] + [ASSISTANT] + WORDS
    types = [2, 3, 3] + [6] * 256 + [3] + [1] * len(WORDS)
    return toks, types


def weights(design: dict[str, dict[str, float]]) -> dict[str, np.ndarray]:
    toks, _ = vocabulary()
    ix = {t: i for i, t in enumerate(toks)}
    n_vocab = len(toks)
    emb = np.zeros((n_vocab, N_EMBD), np.float32)
    out = np.full((n_vocab, N_EMBD), OFF, np.float32)
    for k, (tok, nxt) in enumerate(design.items()):
        assert k < N_EMBD and abs(sum(nxt.values()) - 1.0) < 1e-9, tok
        emb[ix[tok], k] = 1.0
        for t, p in nxt.items():
            out[ix[t], k] = math.log(p)
    d, ff = N_EMBD, N_FF
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    return {
        "token_embd.weight": emb,
        "output_norm.weight": np.full(d, math.sqrt(1.0 / d + RMS_EPS), np.float32),
        "output.weight": out,
        "blk.0.attn_norm.weight": np.ones(d, np.float32),
        "blk.0.attn_q.weight": z(d, d), "blk.0.attn_k.weight": z(d, d), "blk.0.attn_v.weight": z(d, d),
        "blk.0.attn_output.weight": z(d, d),
        "blk.0.ffn_norm.weight": np.ones(d, np.float32),
        "blk.0.ffn_gate.weight": z(ff, d), "blk.0.ffn_up.weight": z(ff, d), "blk.0.ffn_down.weight": z(d, ff),
    }


# -- GGUF (version 3) --------------------------------------------------------------------------
_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9


def _s(text: str) -> bytes:
    b = text.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, value) -> bytes:
    if isinstance(value, bool):
        return _s(key) + struct.pack("<I?", _BOOL, value)
    if isinstance(value, int):
        return _s(key) + struct.pack("<II", _U32, value)
    if isinstance(value, float):
        return _s(key) + struct.pack("<If", _F32, value)
    if isinstance(value, str):
        return _s(key) + struct.pack("<I", _STR) + _s(value)
    kind, items = value  # ("str" | "i32" | "f32", list)
    head = _s(key) + struct.pack("<I", _ARR)
    if kind == "str":
        return head + struct.pack("<IQ", _STR, len(items)) + b"".join(_s(x) for x in items)
    code, fmt = {"i32": (_I32, "i"), "f32": (_F32, "f")}[kind]
    return head + struct.pack(f"<IQ{len(items)}{fmt}", code, len(items), *items)


def write_gguf(path: Path, design: dict[str, dict[str, float]], name: str) -> Path:
    toks, types = vocabulary()
    meta = {
        "general.architecture": "llama", "general.name": name, "general.alignment": 32,
        "llama.context_length": N_CTX, "llama.embedding_length": N_EMBD, "llama.block_count": 1,
        "llama.feed_forward_length": N_FF, "llama.attention.head_count": N_HEAD,
        "llama.attention.head_count_kv": N_HEAD, "llama.rope.dimension_count": N_EMBD // N_HEAD,
        "llama.attention.layer_norm_rms_epsilon": RMS_EPS, "llama.vocab_size": len(toks),
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ("str", toks),
        "tokenizer.ggml.scores": ("f32", [0.0] * len(toks)), "tokenizer.ggml.token_type": ("i32", types),
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    tensors = weights(design)
    infos, blobs, offset = [], [], 0
    for tname, arr in tensors.items():
        dims = arr.shape[::-1]  # GGUF lists the fastest-varying dimension first
        infos.append(_s(tname) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, offset))  # type 0 = F32
        data = arr.astype("<f4").tobytes()
        pad = (-len(data)) % 32
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(_kv(k, v) for k, v in meta.items())
    head += b"".join(infos)
    head += b"\0" * ((-len(head)) % 32)
    path.write_bytes(head + b"".join(blobs))
    return path


# -- running the server ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary: str, model: Path, alias: str, log: Path, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``llama-server`` on ``model`` (listed as ``alias``); (process, API base URL) once /health answers."""
    port = free_port()
    cmd = [binary, "-m", str(model), "--alias", alias, "--host", "127.0.0.1", "--port", str(port),
           "-c", str(N_CTX), "-t", "1", "-np", "1", "--jinja", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url + "/v1"
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"llama-server did not answer /health within {timeout_s:g} s; its log: {log}")


#: The binary the slow tests run: $LLAMA_SERVER, else llama-server on PATH (None: they are skipped).
BINARY = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
NO_BINARY = ("no llama-server binary ($LLAMA_SERVER or llama-server on PATH); build llama.cpp's llama-server "
             "target to run this")


@contextlib.contextmanager
def designed_servers(binary: str, d: Path):
    """The designed base and guide models served by two ``llama-server`` processes in ``d``: yields
    {"base": URL, "guide": URL} (API bases, models listed as bigram-base / bigram-guide); both stop after."""
    procs, urls = [], {}
    try:
        for role, design in (("base", BASE), ("guide", GUIDE)):
            gguf = write_gguf(d / f"{role}.gguf", design, f"bigram-{role}")
            proc, url = start(binary, gguf, f"bigram-{role}", d / f"{role}.log")
            procs.append(proc)
            urls[role] = url
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def record(binary: str, out: Path) -> None:
    """The fixtures: real replies of ``binary`` to the requests the collector sends (and an error)."""
    out.mkdir(parents=True, exist_ok=True)
    work = out / "_models"
    work.mkdir(exist_ok=True)
    q = "What is the capital of France?"
    from ccpo_jax.llm import paper as P  # noqa: PLC0415 (run from the repository root)
    procs = []
    try:
        for role, design, alias in (("base", BASE, "bigram-base"), ("guide", GUIDE, "bigram-guide")):
            gguf = write_gguf(work / f"{role}.gguf", design, alias)
            proc, url = start(binary, gguf, alias, work / f"{role}.log")
            procs.append(proc)
            msgs = P.base_messages(q, []) if role == "base" else P.guide_messages(q, "Paris")
            runs = {"models": (url + "/models", None)}
            for tag, extra in (("logprobs_top1", {"logprobs": True, "top_logprobs": 1}),
                               ("logprobs_only", {"logprobs": True}), ("no_logprobs", {})):
                runs[f"chat_{tag}"] = (url + "/chat/completions", {"model": alias, "messages": msgs, "max_tokens": 32,
                                                                   "temperature": 0, "seed": 0, **extra})
            runs["chat_unlisted_model"] = (url + "/chat/completions", {"model": "gpt-4o", "messages": msgs,
                                                                       "max_tokens": 32, "temperature": 0,
                                                                       "logprobs": True, "top_logprobs": 1})
            runs["chat_cut_at_max_tokens"] = (url + "/chat/completions", {"model": alias, "messages": msgs,
                                                                          "max_tokens": 1, "temperature": 0,
                                                                          "logprobs": True, "top_logprobs": 1})
            runs["error_context_length"] = (url + "/chat/completions", {
                "model": alias, "messages": [{"role": "user", "content": "x " * (N_CTX + 100)}], "max_tokens": 8})
            for tag, (u, body) in runs.items():
                status, reply = _call(u, body)
                (out / f"{role}_{tag}.json").write_text(json.dumps({"status": status, "request": body,
                                                                    "reply": reply}, indent=1) + "\n")
                print(f"{role} {tag}: HTTP {status}")
        status, health = _call(url.rsplit("/v1", 1)[0] + "/props")
        (out / "props.json").write_text(json.dumps({"status": status, "build_info": health.get("build_info")}) + "\n")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(sys.argv[2], Path(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "models":
        d = Path(sys.argv[2])
        d.mkdir(parents=True, exist_ok=True)
        for role, design in (("base", BASE), ("guide", GUIDE)):
            print(write_gguf(d / f"{role}.gguf", design, f"bigram-{role}"))
    else:
        sys.exit("usage: python -m ccpo_jax.testing.llama_server record LLAMA_SERVER OUT_DIR | models DIR")
