"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1, for the collector's tests.

Stdlib ``http.server`` in a thread (HTTP/1.1, keep-alive). Answers are a pure
function of the request (model and messages), so any order of requests gets
the same replies: a deterministic endpoint. It returns ``usage`` (prompt tokens
= words + 4 per message, completion tokens = words of the reply) and, when
asked, ``logprobs`` (one token per word with its leading whitespace). Faults are
injected by request content: ``server.fault(match, kind, times)`` makes the
next ``times`` requests whose last message contains ``match`` fail with
``kind`` (``timeout``, ``429``, ``500``, ``503``, ``malformed``, ``no_usage``, ``verbose``: 40 words
appended to the reply, ``huge``: the reply is an ``Answer:`` line of ``huge_answer_chars`` characters
in one word, control characters, quotes and accents among them, whatever max_tokens says). A reply longer than ``max_tokens`` words is cut there (``finish_reason: length``).
``rung_of`` ({model: k}) makes a model answer a base prompt as if k rounds more were in its chat
(rung k of a guide-less cascade, asked the question alone, gives the script's round-k answer).
``seen`` (and ``asked``) record each chat request in arrival order when ``log_requests`` or ``rung_of`` is given.
``models_mode`` makes ``GET /v1/models`` misbehave: ``drip`` (the list, after 400 spaces, one byte
every ``drip_s``), ``huge`` (a valid list of ``huge_bytes``, generated as it is sent, no
Content-Length) or ``huge-declared`` (the same with its Content-Length); ``models_bytes_sent``
counts the bytes of those bodies that the client accepted.
A request with a ``response_format`` (the ``json`` round protocol) gets the same reply as a JSON object
(:func:`as_json`: ``{"answer": ...}``, ``{"verdict": "yes"|"no", "answer": ...}``), except the replies
the script makes unreadable (no answer line, a non-verdict), which stay free text.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BASE_MODEL = "tiny-base"
GUIDE_MODEL = "big-guide"
#: How ``GET /v1/models`` answers (FakeChatServer(models_mode=...); see the module docstring).
MODELS_MODES = ("list", "drip", "huge", "huge-declared")


@dataclasses.dataclass
class Script:
    """One question: its gold answer, the base's answer per round, and the guide's behaviour."""

    gold: str
    base: list[str]
    guide: str = "judge"  # judge: Yes / No [gold]; wrong: No [bad]; unreadable: a non-verdict
    no_answer_line: bool = False  # round 1 of the base has no "Answer:" line


def make_scripts(n: int) -> dict[str, Script]:
    """``n`` questions with a mix of behaviours (question text -> script)."""
    out = {}
    for i in range(n):
        gold = f"answer {i}"
        kind = i % 5
        if kind == 0:
            s = Script(gold, [gold])
        elif kind == 1:
            s = Script(gold, [f"wrong {i}", gold])
        elif kind == 2:
            s = Script(gold, [f"wrong {i}", f"other {i}"])
        elif kind == 3:
            s = Script(gold, [f"wrong {i}"], guide="wrong")
        else:
            s = Script(gold, [f"wrong {i}", f"wrong {i}", gold])
        if i == 7:
            s.guide = "unreadable"
        if i == 11:
            s.no_answer_line = True
        out[f"Which answer belongs to item number {i}?"] = s
    return out


def as_json(messages: list[dict], text: str) -> str:
    """The scripted reply ``text`` in the ``json`` round protocol's shape (free text stays when the
    script made it unreadable)."""
    first = messages[0]["content"]
    if first.startswith("Evaluate the answer."):
        shown = re.search(r"^A: (.*)$", first, re.M).group(1).strip()
        if text == "Yes":
            return json.dumps({"verdict": "yes", "answer": shown})
        m = re.match(r"No \[(.*)\]$", text)
        return json.dumps({"verdict": "no", "answer": m.group(1)}) if m else text
    m = re.search(r"^Answer: (.*)$", text, re.M)
    return json.dumps({"answer": m.group(1)}) if m else text


def _words(text: str) -> int:
    return len(text.split())


def token_logprob(token: str) -> float:
    """The fake's log-prob of a token (one token per word, with its leading whitespace): designed
    values, so that a test knows the confidence and uncertainty the collector must compute."""
    return -(0.05 + 0.1 * (len(token) % 5))


#: How the fake behaves where real servers differ (what each returns was read from its source and
#: API reference; see tests/fixtures/chat_replies/README.md):
#: * ``openai`` (also vLLM): log-probs for ``logprobs: true``; the reply's ``model`` is the model asked
#:   for (OpenAI may answer with a dated snapshot name); serves every model of ``served``;
#: * ``llama-cpp-python`` (``python -m llama_cpp.server``, 0.3.36): ``"logprobs": null`` unless
#:   ``top_logprobs`` is sent too (it passes ``logprobs=top_logprobs if logprobs else None`` to the
#:   completion); answers any model name with its one loaded model and echoes the name asked for;
#: * ``llama.cpp`` (``llama-server``): log-probs for ``logprobs: true``; answers any model name
#:   with its loaded model, and names that model (its alias) in the reply.
#: ``GET /v1/models`` lists ``served`` (a one-model server: the model it loaded).
FLAVOURS = ("openai", "llama-cpp-python", "llama.cpp")


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # (the stdlib's 5 makes a burst of 64 clients wait for SYN retries, 1 s each)


class FakeChatServer:
    def __init__(self, scripts: dict[str, Script], key: str | None = None, delay_s: float = 0.0,
                 timeout_sleep_s: float = 1.0, flavour: str = "openai", served: list[str] | None = None,
                 list_models: bool = True, logprobs: bool = True, port: int = 0, models_mode: str = "list",
                 drip_s: float = 0.05, huge_bytes: int = 150 << 20, rung_of: dict[str, int] | None = None,
                 log_requests: bool = False, huge_answer_chars: int = 100_000):
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour {flavour!r}: one of {FLAVOURS}")
        if models_mode not in MODELS_MODES:
            raise ValueError(f"models_mode {models_mode!r}: one of {MODELS_MODES}")
        self.models_mode = models_mode
        self.huge_answer_chars = huge_answer_chars
        self.drip_s = drip_s
        self.huge_bytes = huge_bytes
        self.models_bytes_sent = 0
        self.flavour = flavour
        # one-model servers (llama.cpp, llama-cpp-python) answer every request with served[0]
        self.served = list(served) if served is not None else (
            [BASE_MODEL, GUIDE_MODEL] if flavour == "openai" else [GUIDE_MODEL])
        self.list_models = list_models  # False: a gateway without GET /models (404)
        self.logprobs = logprobs  # False: never returns log-probs (a gateway that drops them)
        self.model_listings = 0  # GET /models requests (not counted in ``requests``)
        self.scripts = scripts
        self.key = key
        self.delay_s = delay_s
        self.timeout_sleep_s = timeout_sleep_s
        self.lock = threading.Lock()
        self.faults: list[list] = []  # [match, kind, times left, retry_after]
        self.requests = 0
        self.rung_of = dict(rung_of or {})
        #: With ``log_requests`` (or ``rung_of``, whose tests read it): every chat request's {"model",
        #: "messages"} in ``asked`` and (model, messages) in ``seen``, in arrival order (off by default: the
        #: benchmarks' long runs would keep every request).
        self.log_requests = log_requests or bool(rung_of)
        self.asked: list[dict] = []
        self.seen: list[tuple[str, list[dict]]] = []
        self.fault_log: list[tuple[str, str]] = []
        self.auth_seen: set[str] = set()
        self._httpd = _Server(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._httpd.shutdown()
        self._httpd.server_close()

    def fault(self, match: str, kind: str, times: int = 1, retry_after: str = "1") -> None:
        with self.lock:
            self.faults.append([match, kind, times, retry_after])

    # -- replies ---------------------------------------------------------------------

    def _script(self, text: str) -> tuple[str, Script] | None:
        for q, s in self.scripts.items():
            if q in text:
                return q, s
        return None

    def reply(self, model: str, messages: list[dict]) -> str:
        first = messages[0]["content"]
        last = messages[-1]["content"]
        found = self._script(first)
        if found is None:
            return "I do not know this question."
        q, s = found
        if first.startswith("Evaluate the answer."):
            ans = re.search(r"^A: (.*)$", first, re.M).group(1).strip()
            if s.guide == "unreadable":
                return "Hmm, that is hard to tell."
            if s.guide == "wrong":
                return f"No [bad {s.gold}]"
            return "Yes" if ans == s.gold else f"No [{s.gold}]"
        if first.startswith("You are answering a question in rounds"):
            answers = re.findall(r"^\d+\. (.*)$", last, re.M)
            repeat = len(answers) > 1 and answers[-1] == answers[-2]
            return "[EXIT]" if repeat or answers[-1] == s.gold else "[CONTINUE]"
        if first.startswith("A small base model answers"):
            rounds = re.findall(r"^Round \d+ of \d+: .*guide verdict: (\w+)", first, re.M)
            if rounds[-1] == "Yes":
                return "1"
            return "2" if len(rounds) >= 2 else "3"
        # a base-style answer: round = assistant messages so far
        r = sum(1 for m in messages if m["role"] == "assistant") + self.rung_of.get(model, 0)
        ans = s.base[min(r, len(s.base) - 1)]
        if model == GUIDE_MODEL:
            ans = s.gold if s.guide == "judge" else f"bad {s.gold}"
        if s.no_answer_line and r == 0:
            return f"Let me think step by step. The item is {ans} I believe."
        return f"Let me think step by step. Item {q.split()[-1]} is listed.\nAnswer: {ans}"

    def _model(self, asked: str) -> tuple[str, str]:
        """(the model that answers, the model the reply names) for a request asking for ``asked``."""
        if self.flavour == "openai":
            return asked, asked
        return self.served[0], asked if self.flavour == "llama-cpp-python" else self.served[0]

    def models(self) -> dict:
        """The ``GET /v1/models`` body (the OpenAI list shape, which all three flavours use)."""
        owner = {"openai": "system", "llama-cpp-python": "me", "llama.cpp": "llamacpp"}[self.flavour]
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 1764547200, "owned_by": owner}
                                           for m in self.served]}

    def completion(self, body: dict, with_usage: bool = True, verbose: bool = False) -> dict:
        answering, named = self._model(body["model"])
        text = self.reply(answering, body["messages"])
        if body.get("response_format") is not None:
            text = as_json(body["messages"], text)
        if verbose:  # a model that explains itself after the reply
            text += " because " + " ".join(f"reason{i}" for i in range(40))
        finish = "stop"
        words = re.findall(r"\s*\S+", text)
        if len(words) > int(body.get("max_tokens") or 10**9):  # one token per word: cut at max_tokens
            text, finish = "".join(words[: int(body["max_tokens"])]), "length"
        out = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": named,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        }
        wants = bool(body.get("logprobs")) and self.logprobs
        if self.flavour == "llama-cpp-python":
            wants = wants and body.get("top_logprobs") is not None
        if wants:
            toks = re.findall(r"\s*\S+", text)
            n_top = int(body.get("top_logprobs") or 0)
            out["choices"][0]["logprobs"] = {
                "content": [{"token": t, "logprob": token_logprob(t), "bytes": list(t.encode()),
                             "top_logprobs": [{"token": t, "logprob": token_logprob(t), "bytes": list(t.encode())}][:n_top]}
                            for t in toks]
            }
        elif self.flavour == "llama-cpp-python":
            out["choices"][0]["logprobs"] = None  # (it sends the key, as null)
        if with_usage:
            p = sum(_words(m["content"]) + 4 for m in body["messages"])
            c = _words(text)
            out["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        return out

    def _take_fault(self, text: str) -> list | None:
        with self.lock:
            for f in self.faults:
                if f[2] > 0 and f[0] in text:
                    f[2] -= 1
                    self.fault_log.append((f[0], f[1]))
                    return f
        return None

    def _handler(self):
        """The request handler class bound to this server (``_Handler`` with ``fake`` = it)."""
        return type("Handler", (_Handler,), {"fake": self})


class _Handler(BaseHTTPRequestHandler):
    """A FakeChatServer's HTTP side: ``fake`` is the server whose scripts, faults and counters it uses."""

    fake: "FakeChatServer"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no delayed-ACK stall between them

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, payload: bytes, headers: dict | None = None):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self):
        auth = self.headers.get("Authorization")
        if self.fake.key is not None and auth != f"Bearer {self.fake.key}":
            msg = {"error": {"message": f"Incorrect API key provided: {auth}", "type": "invalid_request_error"}}
            return self._send(401, json.dumps(msg).encode())
        if not (self.path.endswith("/models") and self.fake.list_models):
            return self._send(404, b'{"error": {"message": "not found"}}')
        with self.fake.lock:
            self.fake.model_listings += 1
        listing = json.dumps(self.fake.models()).encode()
        if self.fake.models_mode == "list":
            return self._send(200, listing)
        try:
            self._bad_listing(listing)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: what it refused is not counted
        self.close_connection = True

    def _bad_listing(self, listing: bytes):
        """``GET /models`` per ``models_mode``: chunks generated as they are sent (the huge list is
        never held whole), each counted in ``models_bytes_sent`` once written."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.fake.models_mode == "drip":
            body = b" " * 400 + listing  # leading whitespace: still valid JSON when it ends
            self.send_header("Content-Length", str(len(body)))
            chunks = (body[i:i + 1] for i in range(len(body)))
        else:
            head, tail = b'{"object": "list", "data": [', listing[listing.index(b"[") + 1:]
            entry = b'{"id": "padding-model-%09d", "object": "model"}, '
            n = (self.fake.huge_bytes - len(head) - len(tail)) // len(entry % 0)
            if self.fake.models_mode == "huge-declared":
                self.send_header("Content-Length", str(len(head) + n * len(entry % 0) + len(tail)))
            else:
                self.send_header("Connection", "close")
            per = 1024  # entries per chunk (~50 KiB)
            chunks = itertools.chain(
                [head], (b"".join(entry % k for k in range(i, min(n, i + per))) for i in range(0, n, per)),
                [tail])
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
            self.wfile.flush()
            with self.fake.lock:
                self.fake.models_bytes_sent += len(chunk)
            if self.fake.models_mode == "drip":
                time.sleep(self.fake.drip_s)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(n)
        with self.fake.lock:
            self.fake.requests += 1
        auth = self.headers.get("Authorization")
        if auth:
            self.fake.auth_seen.add(auth)
        if not self.path.endswith("/chat/completions"):
            return self._send(404, b'{"error": {"message": "not found"}}')
        if self.fake.key is not None and auth != f"Bearer {self.fake.key}":
            msg = {"error": {"message": f"Incorrect API key provided: {auth}", "type": "invalid_request_error"}}
            return self._send(401, json.dumps(msg).encode())
        body = json.loads(raw)
        if self.fake.log_requests:
            with self.fake.lock:
                self.fake.asked.append({"model": body.get("model"), "messages": body.get("messages"),
                                     "temperature": body.get("temperature")})
                self.fake.seen.append((body.get("model"), body.get("messages")))
        if self.fake.delay_s:
            time.sleep(self.fake.delay_s)
        f = self.fake._take_fault(body["messages"][-1]["content"] + body["messages"][0]["content"])
        if f is not None:
            kind = f[1]
            if kind == "timeout":
                time.sleep(self.fake.timeout_sleep_s)
            elif kind == "429":
                return self._send(429, b'{"error": {"message": "rate limited"}}', {"Retry-After": f[3]})
            elif kind in ("500", "503"):
                return self._send(int(kind), b'{"error": {"message": "server error"}}')
            elif kind == "malformed":
                return self._send(200, b'{"choices": [{"message": {"content": "Ye')
            elif kind == "no_usage":
                return self._send(200, json.dumps(self.fake.completion(body, with_usage=False)).encode())
            elif kind == "huge":  # an upstream that ignores max_tokens
                text = "Answer: " + ("x\x01\"\u00e9" * self.fake.huge_answer_chars)[: self.fake.huge_answer_chars]
                out = self.fake.completion(body)
                out["choices"][0]["message"]["content"] = text
                out["choices"][0].pop("logprobs", None)
                return self._send(200, json.dumps(out).encode())
            elif kind == "verbose":
                return self._send(200, json.dumps(self.fake.completion(body, verbose=True)).encode())
        self._send(200, json.dumps(self.fake.completion(body)).encode())



def write_questions(path, n: int) -> None:
    """The questions file (id, question, gold) of :func:`make_scripts` (n)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (q, sc) in enumerate(make_scripts(n).items()):
            f.write(json.dumps({"id": f"q{i}", "question": q, "gold": sc.gold}) + "\n")


if __name__ == "__main__":
    # python -m ccpo_jax.testing.chat_server N [--delay-ms D] [--questions-out FILE] [--port P]: serve N scripted questions
    # on 127.0.0.1 (port chosen by the OS) in this process, print the API base URL, run until killed.
    import argparse
    import signal

    ap = argparse.ArgumentParser(description="a scripted OpenAI-compatible chat-completions server on 127.0.0.1")
    ap.add_argument("n", type=int, nargs="?", default=20)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--questions-out", default=None, help="also write the matching questions file here")
    ap.add_argument("--flavour", default="openai", choices=FLAVOURS,
                    help="behave as this server does where servers differ (see FLAVOURS in this file)")
    ap.add_argument("--served", default=None, help="comma-separated models GET /v1/models lists")
    ap.add_argument("--port", type=int, default=0, help="listen on this port (default: one the OS chooses); "
                    "the cache's provenance records the endpoint's port, so a fixed port makes its sha256 repeatable")
    a = ap.parse_args()
    if a.questions_out:
        write_questions(a.questions_out, a.n)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    served = a.served.split(",") if a.served else None
    with FakeChatServer(make_scripts(a.n), delay_s=a.delay_ms / 1000.0, flavour=a.flavour, served=served,
                       port=a.port) as srv:
        print(srv.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
