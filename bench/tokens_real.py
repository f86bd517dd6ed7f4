"""Token budgets against a real server's chat template (issue 33): the same chat backlog
through ``redis-quota`` in ``tokens`` mode with the plain estimate and with
``estimate_correction: usage``, against llama.cpp's ``llama-server`` (or, with ``--sim``, the
simulator counting a template's tokens). Target: the tokens the server counts per window, per
key, never more than the limit plus one request's estimate error; and what the correction
costs in throughput.

The server: ``llama-server`` built from the llama.cpp source that the ``llama-cpp-python``
sdist on PyPI ships, fed a tiny model with random weights and a real tokenizer and chat
template: Qwen2's byte-level BPE vocabulary and its ChatML template (which adds a default
system message), both read from ``models/ggml-vocab-qwen2.gguf`` of that source. Nothing of it
is committed here; these commands make it (~15–25 min of a 2-core machine)::

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/llama
    tar xzf /tmp/llama/llama_cpp_python-0.3.36.tar.gz -C /tmp/llama
    cd /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \\
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF
    nice -n 19 cmake --build build --target llama-server -j2
    cd -
    .venv/bin/pip install gguf        # to write the model; not a dependency of the pipeline
    .venv/bin/python bench/tokens_real.py make-model \\
        --vocab /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf \\
        --out /tmp/llama/tiny-qwen2.gguf

Then (the server is started and stopped by the bench, on a free loopback port)::

    .venv/bin/python bench/tokens_real.py \\
        --llama-server /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \\
        --model /tmp/llama/tiny-qwen2.gguf
    .venv/bin/python bench/tokens_real.py --sim     # the simulator, a template of (5, 12)

Setup: a private ``redis-server``; the server behind a recording proxy in this process (it logs
each 200's arrival time, the charge its admission made, read from Redis while the request is
in flight, and the usage the server answered); one worker node (``--slots`` threads); per
mode a queue with a token budget of ``--limit`` tokens per ``--window`` per userid. Two
tenants, ``-n`` chat requests each, submitted at once: one user message of 2–40 words of
English prose, a system message in a third of them, ``max_tokens`` 4–24. Modes, in one run:
``plain`` (the estimate, characters / 4 + 4 per message), ``learned`` (the correction,
starting from the plain estimate on a new queue) and ``learned, kept`` (what the mode before
learned kept: what a queue that has served before sees).

Measured per mode and tenant, from the proxy's log: the most tokens (prompt + completion, as
the server counted them) whose requests arrived within any ``window`` (every window that starts
at an arrival), against the limit; the largest under-estimate of one request (usage − its
charge); the budget used (tokens served over the backlog's span ÷ the budget of that span);
requests per second over the backlog; what was learned (real prompt tokens ≈ slope × estimate
+ overhead; charged with the spread added).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import redis
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router

from bench.common import (
    Node,
    PipelineEnv,
    Sim,
    bench_session,
    free_port,
    log,
    queue_entry,
    stop_proc,
    table,
    verdict,
)
from bench.tokens import max_window
from pipeline.cli.services import wait_until
from pipeline.gates.quota import TokenQuota
from pipeline.gates.tokens import DEFAULT_MAX_TOKENS, estimate_tokens

TENANTS = ("alice", "bob")
PROSE_TEXT = (
    "The river runs past the old mill where the town keeps its records of every harvest "
    "since the bridge was built. Please summarise the attached notes in two sentences, and "
    "say which of the figures changed most between the spring and the autumn reports. A "
    "short answer is fine; we only need the trend, not the numbers themselves. Could you "
    "also check whether the schedule for the next meeting still works for everyone on the "
    "team, given that two people are travelling that week?"
)
PROSE = PROSE_TEXT.split(" ")
SYSTEM = "You answer in plain English and keep it short."
MODES = (("plain", "none", True), ("learned", "usage", True), ("learned, kept", "usage", False))


def make_items(n: int, tenant: str, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` chat requests of ``tenant`` (ids ``<tenant>-<i>``)."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        start, words = rng.randrange(len(PROSE)), rng.randint(2, 40)
        text = " ".join(PROSE[(start + k) % len(PROSE)] for k in range(words))
        messages = [{"role": "user", "content": text}]
        if rng.random() < 1 / 3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        payload = {"model": "tiny", "messages": messages, "max_tokens": rng.randint(4, 24)}
        out.append(
            {
                "payload": payload,
                "id": f"{tenant}-{i}",
                "metadata": {"userid": tenant},
                "timeout": 900,
                "endpoint": "/v1/chat/completions",
            }
        )
    return out


# -- the recording proxy -------------------------------------------------------------------
@dataclass
class Arrival:
    at: float  # time.monotonic() when the request reached the proxy
    rid: str
    charge: int | None  # the admission's charge, read from Redis while in flight
    prompt: int = 0
    completion: int = 0


@dataclass
class Proxy:
    """Forwards every POST to ``upstream`` and logs each 200 (:class:`Arrival`)."""

    upstream: str
    client: redis.Redis
    charges_key: dict[str, str] = field(default_factory=dict)  # tenant -> its charges hash
    log: list[Arrival] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Router(routes=[Route("/{path:path}", self._forward, methods=["POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the recording proxy")

    def charge(self, rid: str) -> int | None:
        key = self.charges_key.get(rid.split("-", 1)[0])
        if key is None:
            return None
        for holder, value in self.client.hgetall(key).items():
            if holder.startswith(rid + ":") and value.startswith("e"):
                return int(value[1:])
        return None

    async def _forward(self, request: Request) -> Response:
        at = time.monotonic()
        rid = request.headers.get("x-request-id", "")
        charge = await asyncio.to_thread(self.charge, rid)
        body = await request.body()
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            resp = await client.post(
                f"{self.upstream}/{request.path_params['path']}",
                content=body,
                headers={"content-type": "application/json", "x-request-id": rid},
            )
        if resp.status_code == 200:
            usage = resp.json().get("usage") or {}
            self.log.append(
                Arrival(
                    at,
                    rid,
                    charge,
                    usage.get("prompt_tokens", 0),
                    usage.get("completion_tokens", 0),
                )  # fmt: skip
            )
        return Response(resp.content, resp.status_code, media_type="application/json")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# -- the server ----------------------------------------------------------------------------
class LlamaServer:
    def __init__(
        self, binary: str, model: str, parallel: int, workdir: Path, extra: Sequence[str] = ()
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(parallel), "-c", str(512 * parallel), "-t", "1", "--jinja",
                "--no-webui", "--log-disable", *extra]  # fmt: skip
        self.log_path = workdir / "llama-server.log"
        fh = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(argv, stdout=fh, stderr=fh)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log_path.read_text()[-3000:]}")
            try:
                return httpx.get(self.url + "/health", timeout=2, trust_env=False).is_success
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "llama-server /health", interval=0.2)

    def stop(self) -> None:
        stop_proc(self.proc, 10)


# -- one mode ------------------------------------------------------------------------------
def one_mode(
    rh: Any, workdir: Path, proxy: Proxy, args: Any, items: list[dict[str, Any]], mode: str,
    correction: str, prefix: str,
) -> list[list[Any]]:  # fmt: skip
    params = {"mode": "tokens", "attribute": "userid", "limit": args.limit,
              "window": args.window, "estimate_correction": correction}  # fmt: skip
    gate = {"gate_type": "redis-quota", "gate_params": params}
    penv = PipelineEnv(rh.url, [queue_entry("tok", proxy.url, **gate)], workdir, prefix=prefix)
    pl = penv.pipeline()
    quota = pl.gate("tok")
    assert isinstance(quota, TokenQuota)
    proxy.charges_key = {t: quota.tokens_keys(t)[1] for t in TENANTS}
    for t in TENANTS:  # each mode starts with an empty window
        pl.store.client.delete(*quota.tokens_keys(t))
    proxy.log.clear()
    node = Node(penv, concurrency=args.slots)
    try:
        t0 = time.monotonic()
        pl.submit_many([{**it, "queue": "tok"} for it in items])
        results = {it["id"]: pl.wait(it["id"], timeout=900) for it in items}
        took = time.monotonic() - t0
    finally:
        node.stop()
    learned = quota.learned("tok")
    payloads = {it["id"]: it["payload"] for it in items}
    rows = []
    for tenant in TENANTS:
        mine = sorted((a for a in proxy.log if a.rid.startswith(tenant + "-")), key=lambda a: a.at)
        arrivals = [(a.at, a.prompt + a.completion, a.rid) for a in mine]
        peak, _ = max_window(arrivals, args.window)
        charged = [a for a in mine if a.charge is not None]
        under = max((a.prompt + a.completion - (a.charge or 0) for a in charged), default=0)
        plain_under = max(
            a.prompt + a.completion - estimate_tokens(payloads[a.rid], DEFAULT_MAX_TOKENS)
            for a in mine
        )
        span = mine[-1].at - mine[0].at + args.window
        served = sum(a.prompt + a.completion for a in mine)
        used = served / (span / args.window * args.limit)
        ok = sum(results[it["id"]].ok for it in items if it["id"].startswith(tenant + "-"))
        rows.append(
            [
                f"{mode}, {tenant}",
                f"{peak} / {args.limit} ({peak / args.limit:.3f})",
                f"{under:+d}",
                f"{plain_under:+d}",
                f"{used:.2f}",
                f"{ok / took:.1f}",
                f"{learned.slope:.2f} x + {learned.overhead:.1f} + {learned.spread:.1f}"
                if correction == "usage"
                else "-",
                f"{len(charged)}/{len(mine)}",
                f"{took:.0f} s",
                verdict(peak <= args.limit + max(0, under)),
            ]
        )
        log(f"{mode} {tenant}: peak {peak} of {args.limit}, max under-estimate {under}")
    return rows


# -- the model -----------------------------------------------------------------------------
def make_model(args: Any) -> int:
    """A llama-architecture GGUF with random weights (``--layers``, ``--embd``) and the
    tokenizer and chat template of ``--vocab`` (a vocabulary-only GGUF, e.g. llama.cpp's
    ``models/ggml-vocab-qwen2.gguf``), or the template of ``--chat-template``."""
    try:
        import gguf
        import numpy as np
    except ImportError:
        raise SystemExit("make-model needs the gguf package: .venv/bin/pip install gguf") from None
    reader = gguf.GGUFReader(args.vocab)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    template = Path(args.chat_template).read_text() if args.chat_template else None
    template = template or fields.get("tokenizer.chat_template")
    if not template:
        raise SystemExit(f"{args.vocab} has no chat template: give --chat-template FILE")
    tokens = fields["tokenizer.ggml.tokens"]
    n_vocab, n_embd, n_ff, n_head = len(tokens), args.embd, 2 * args.embd, 4
    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name("tiny random llama, tokenizer of " + Path(args.vocab).name)
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(fields["tokenizer.ggml.merges"])
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("padding", writer.add_pad_token_id)):  # fmt: skip
        if f"tokenizer.ggml.{name}_token_id" in fields:
            add(fields[f"tokenizer.ggml.{name}_token_id"])
    writer.add_chat_template(template)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(args.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{blk}{name}.weight", weight(n_embd, n_embd))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(blk + "ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(blk + "ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(blk + "ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log(f"wrote {args.out}: {n_vocab} tokens, {args.layers} layers of {n_embd}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    sub = ap.add_subparsers(dest="command")
    mm = sub.add_parser("make-model", help="write the tiny GGUF")
    mm.add_argument("--vocab", required=True, help="a vocabulary GGUF (tokenizer + template)")
    mm.add_argument("--chat-template", help="a Jinja file instead of the vocabulary's template")
    mm.add_argument("--out", required=True)
    mm.add_argument("--layers", type=int, default=2)
    mm.add_argument("--embd", type=int, default=32)
    ap.add_argument("--redis-url", default=None, help="an existing Redis database (flushed!)")
    ap.add_argument("--llama-server", help="the llama-server binary")
    ap.add_argument("--model", help="the GGUF it serves")
    ap.add_argument("--parallel", type=int, default=4, help="llama-server slots (-np)")
    ap.add_argument("--sim", action="store_true", help="the simulator instead (--sim-template)")
    ap.add_argument("--sim-template", default="5,12", metavar="M,P",
                    help="the simulator's template tokens per message, per prompt")  # fmt: skip
    ap.add_argument("-n", type=int, default=200, help="requests per tenant")
    ap.add_argument("--limit", type=int, default=1500, help="tokens per window per tenant")
    ap.add_argument("--window", type=float, default=2.0, help="window, s")
    ap.add_argument("--slots", type=int, default=16, help="worker threads")
    ap.add_argument("--runs", type=int, default=2, help="runs of the three modes")
    args = ap.parse_args()
    if args.command == "make-model":
        return make_model(args)
    if not args.sim and not (args.llama_server and args.model):
        ap.error("give --llama-server and --model (see the docstring), or --sim")
    rows: list[list[Any]] = []
    with bench_session(args.redis_url) as (rh, workdir):
        server: LlamaServer | Sim
        if args.sim:
            m, p = args.sim_template.split(",")
            extra = ["--template-message-tokens", m, "--template-prompt-tokens", p]
            server = Sim(extra=extra)
            what = f"the simulator (a template of {m} tokens per message, {p} per prompt)"
        else:
            server = LlamaServer(args.llama_server, args.model, args.parallel, workdir)
            what = f"llama-server ({Path(args.model).name}, {args.parallel} slots)"
        proxy = Proxy(server.url, redis.Redis.from_url(rh.url, decode_responses=True))
        try:
            for run in range(args.runs):
                rng = random.Random(33 + run)
                items = [it for t in TENANTS for it in make_items(args.n, t, rng)]
                prefix = ""
                for i, (mode, correction, fresh) in enumerate(MODES):
                    # kept: the prefix of the mode before, whose queue learned already
                    prefix = f"tokreal{run}m{i}:" if fresh else prefix
                    mine = [{**it, "id": it["id"].replace("-", f"-{run}m{i}-", 1)} for it in items]
                    label = f"run {run + 1} {mode}"
                    rows += one_mode(rh, workdir, proxy, args, mine, label, correction, prefix)
        finally:
            proxy.stop()
            server.stop()
    print(
        f"\nToken budget {args.limit} tokens / {args.window:g} s per tenant, {args.n} chat "
        f"requests per tenant, {args.slots} slots, {what}\n"
    )
    print(
        table(
            [
                "run, mode, tenant",
                "max tokens in a window / limit",
                "max under-est. (charge)",
                "(plain estimate)",
                "budget used",
                "req/s",
                "learned: slope x + overhead + spread",
                "charges seen",
                "wall",
                "≤ limit + one error",
            ],
            rows,
        )
    )
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
