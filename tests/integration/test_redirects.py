"""Redirects and the response-size limit of the attempt's HTTP call, over real sockets.

A redirect is returned as it came unless a queue opts in (``follow_redirects``); then only a
307/308 is followed, with the same body, and only to the first URL's origin (scheme, host and
port) or one the queue lists (``redirect_origins``): one anywhere else is refused, another port
of the same host included (issue 45, item 12: a redirect reached a Redis port). To another
(listed) origin it carries no credential header and presents no client certificate; https ->
http is refused, and so is a loop. A response body over ``max_response_bytes`` ends the attempt
before more than that is held, whatever frames it (length, chunked, the connection's close).
Last, a real worker node: a queue without ``follow_redirects`` ends a redirected request with
its 307, one with it and the target listed reaches the other server without the queue's key,
one without the target listed ends ``INFERENCE_ERROR`` without reaching it, and no gate holds a
reservation afterwards."""

from __future__ import annotations

import json
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import parse_queues
from pipeline.errors import ConfigError
from pipeline.http import call as httpcall
from pipeline.http.classify import Kind, send
from tests.conftest import WorkerProc, assert_idle, local_limit, quota
from tests.integration.tls import Certs, make_certs
from tests.observability import isolated, start_node

BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()
OK = json.dumps({"choices": [{"text": "ok"}]}).encode()
SECRETS = {
    "Authorization": "Bearer sk-secret",
    "Proxy-Authorization": "Basic cHJveHk=",
    "Cookie": "session=s3cret",
    "api-key": "azure-key",
    "X-Api-Key": "x-key",
    "x-goog-api-key": "goog-key",
    "X-Auth-Token": "tok",
}
PLAIN = {"Content-Type": "application/json", "x-request-id": "r-1", "X-Tenant": "acme"}

# what a server answers for a path: status, extra headers, body (None: stream chunks forever)
Answer = tuple[int, dict[str, str], bytes | None]


@dataclass
class Call:
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    client_cert: bool  # a client certificate was presented (TLS servers only)


class Server:
    """A real HTTP/1.1 server (optionally TLS, asking for but not requiring a client
    certificate) that records every call and answers what ``answer`` says for its path."""

    def __init__(
        self, answer: Callable[[str], Answer], certs: Certs | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.calls: list[Call] = []
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                peer = getattr(self.connection, "getpeercert", lambda: None)()
                headers = {k.lower(): v for k, v in self.headers.items()}
                srv.calls.append(Call(self.path, headers, body, bool(peer)))
                status, extra, payload = answer(self.path)
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                if payload is None:
                    self._stream(extra)
                    return
                if "transfer-encoding" in {k.lower() for k in extra}:
                    self.end_headers()
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
                elif extra.get("Connection") == "close":
                    self.end_headers()
                    self.wfile.write(payload)
                    self.close_connection = True
                else:
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def _stream(self, extra: dict[str, str]) -> None:
                self.end_headers()
                self.close_connection = True
                piece = b"x" * 65536
                chunked = "Transfer-Encoding" in extra
                try:
                    while True:  # until the client hangs up
                        self.wfile.write(b"10000\r\n%s\r\n" % piece if chunked else piece)
                except OSError:
                    pass

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        scheme = "http"
        if certs is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=certs.ca)
            ctx.load_cert_chain(certs.server)
            ctx.verify_mode = ssl.CERT_OPTIONAL
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(answer: Callable[[str], Answer] = lambda _: (200, {}, OK), **kw: Any) -> Server:
        s = Server(answer, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    httpcall.close_all()
    yield
    httpcall.close_all()


def to(location: str, status: int = 307) -> Callable[[str], Answer]:
    """Redirect every path to ``location``."""
    return lambda _: (status, {"Location": location}, b"moved")


# -- off unless a queue opts in -----------------------------------------------------------
def test_a_redirect_is_returned_not_followed_by_default(serve: Callable[..., Server]) -> None:
    target = serve()
    origin = serve(to(target.url + "/v1/completions"))
    resp = httpcall.request("POST", origin.url + "/v1/completions", BODY, {**SECRETS, **PLAIN}, 5)
    assert (resp.status, resp.headers["location"]) == (307, target.url + "/v1/completions")
    assert target.calls == []
    out = send(origin.url + "/v1/completions", BODY.decode(), dict(SECRETS), 5)
    assert (out.kind, out.status_code, out.category) == (Kind.FATAL, 307, "REDIRECT")
    assert target.calls == []


@pytest.mark.parametrize("status", [301, 302, 303])
def test_only_307_and_308_are_followed(serve: Callable[..., Server], status: int) -> None:
    """301/302/303 would turn the POST into a GET (or lose its body): never followed."""
    target = serve()
    origin = serve(to(target.url + "/x", status))
    resp = httpcall.request("POST", origin.url + "/x", BODY, PLAIN, 5, follow_redirects=True)
    assert resp.status == status and target.calls == []


# -- same origin: everything kept ---------------------------------------------------------
@pytest.mark.parametrize("status", [307, 308])
def test_a_same_origin_redirect_keeps_headers_and_body(
    serve: Callable[..., Server], status: int
) -> None:
    def answer(path: str) -> Answer:
        return (status, {"Location": "/v2/completions"}, b"") if path == "/v1" else (200, {}, OK)

    s = serve(answer)
    resp = httpcall.request(
        "POST", s.url + "/v1", BODY, {**SECRETS, **PLAIN}, 5, follow_redirects=True
    )
    assert resp.status == 200 and resp.body == OK
    first, second = s.calls
    assert second.path == "/v2/completions" and second.body == BODY
    assert second.headers == first.headers  # credentials included: same scheme, host, port


# -- another origin: no credential goes along ---------------------------------------------
def assert_no_credentials(call: Call) -> None:
    assert not {k.lower() for k in SECRETS} & call.headers.keys(), call.headers
    for name, value in PLAIN.items():
        assert call.headers[name.lower()] == value
    assert call.body == BODY


def follow(target: Server) -> dict[str, Any]:
    """Follow redirects, to ``target``'s origin too."""
    return {"follow_redirects": True, "redirect_origins": [target.url]}


def test_another_port_gets_no_credential_header(serve: Callable[..., Server]) -> None:
    target = serve()
    origin = serve(to(target.url + "/v1/completions"))
    resp = httpcall.request(
        "POST", origin.url + "/v1", BODY, {**SECRETS, **PLAIN}, 5, **follow(target)
    )
    assert resp.status == 200
    assert origin.calls[0].headers["authorization"] == "Bearer sk-secret"
    (call,) = target.calls
    assert_no_credentials(call)


def test_another_host_name_gets_no_credential_header(serve: Callable[..., Server]) -> None:
    """127.0.0.1 and localhost are the same socket but not the same origin."""
    target = serve(host="localhost")
    origin = serve(to(target.url + "/x"))
    resp = httpcall.request(
        "POST", origin.url + "/x", BODY, {**SECRETS, **PLAIN}, 5, **follow(target)
    )
    assert resp.status == 200
    (call,) = target.calls
    assert_no_credentials(call)


def test_another_origin_gets_its_own_host_header(serve: Callable[..., Server]) -> None:
    """A caller's ``Host`` names the first origin: the new one is sent its own."""
    target = serve(host="localhost")
    origin = serve(to(target.url + "/x"))
    headers = {**PLAIN, "Host": "gateway.internal"}
    assert (
        httpcall.request("POST", origin.url + "/x", BODY, headers, 5, **follow(target)).status
        == 200
    )
    assert origin.calls[0].headers["host"] == "gateway.internal"
    (call,) = target.calls
    assert call.headers["host"] == target.url.removeprefix("http://")


def test_a_credential_header_is_known_in_any_letter_case() -> None:
    kept = httpcall.foreign_headers({"AUTHORIZATION": "a", "X-API-KEY": "k", "Accept": "*/*"})
    assert kept == {"Accept": "*/*"}


def test_another_https_origin_sees_no_client_certificate(
    serve: Callable[..., Server], certs: Certs
) -> None:
    target = serve(certs=certs, host="localhost")
    origin = serve(to(target.url + "/x"), certs=certs)
    tls = httpcall.TLS(certs.ca, certs.client_cert, certs.client_key)
    resp = httpcall.request("POST", origin.url + "/x", BODY, SECRETS, 5, tls, **follow(target))
    assert resp.status == 200
    assert origin.calls[0].client_cert  # mTLS to the queue's own server
    (call,) = target.calls
    assert not call.client_cert and "authorization" not in call.headers


def test_https_to_plain_http_is_refused(serve: Callable[..., Server], certs: Certs) -> None:
    target = serve()
    origin = serve(to(target.url + "/x"), certs=certs)
    tls = httpcall.TLS(certs.ca)
    with pytest.raises(httpcall.RedirectRefused, match="from https to plain http"):
        httpcall.request("POST", origin.url + "/x", BODY, SECRETS, 5, tls, **follow(target))
    out = send(origin.url + "/x", BODY.decode(), SECRETS, 5, tls, **follow(target))
    assert (out.kind, out.category, out.status_code) == (Kind.FATAL, "REDIRECT", None)
    assert "plain http" in (out.error or "")
    assert target.calls == []


def test_a_redirect_to_another_scheme_is_refused(serve: Callable[..., Server]) -> None:
    s = serve(to("ftp://127.0.0.1/x"))
    with pytest.raises(httpcall.RedirectRefused, match="ftp"):
        httpcall.request("POST", s.url + "/x", BODY, PLAIN, 5, follow_redirects=True)


def test_a_redirect_loop_ends(serve: Callable[..., Server]) -> None:
    s = serve(lambda path: (307, {"Location": path + "x"}, b""))
    with pytest.raises(httpcall.RedirectRefused, match=f"more than {httpcall.MAX_REDIRECTS}"):
        httpcall.request("POST", s.url + "/x", BODY, PLAIN, 5, follow_redirects=True)
    assert len(s.calls) == httpcall.MAX_REDIRECTS + 1


# -- where a redirect may go ----------------------------------------------------------------
def test_another_origin_is_refused_unless_listed(serve: Callable[..., Server]) -> None:
    """127.0.0.1 on another port (a Redis, say): refused before anything is sent there."""
    target = serve()
    origin = serve(to(target.url + "/v1/completions"))
    port = target.url.rpartition(":")[2]
    with pytest.raises(httpcall.RedirectRefused, match=f"another origin .*:{port}.* refused"):
        httpcall.request("POST", origin.url + "/v1", BODY, PLAIN, 5, follow_redirects=True)
    out = send(origin.url + "/v1", BODY.decode(), PLAIN, 5, follow_redirects=True)
    assert (out.kind, out.category, out.status_code) == (Kind.FATAL, "REDIRECT", None)
    assert target.calls == [] and len(origin.calls) == 2
    resp = httpcall.request("POST", origin.url + "/v1", BODY, PLAIN, 5, **follow(target))
    assert resp.status == 200 and len(target.calls) == 1


def test_a_listed_host_opens_only_its_own_port(serve: Callable[..., Server]) -> None:
    listed, other = serve(), serve()
    origin = serve(to(other.url + "/x"))
    with pytest.raises(httpcall.RedirectRefused, match="another origin"):
        httpcall.request("POST", origin.url + "/x", BODY, PLAIN, 5, **follow(listed))
    assert other.calls == []


def test_every_hop_of_a_chain_is_checked(serve: Callable[..., Server]) -> None:
    """A listed origin that redirects on to an unlisted one: the second hop is refused."""
    last = serve()
    middle = serve(to(last.url + "/x"))
    origin = serve(to(middle.url + "/x"))
    with pytest.raises(httpcall.RedirectRefused, match="another origin"):
        httpcall.request("POST", origin.url + "/x", BODY, PLAIN, 5, **follow(middle))
    assert len(middle.calls) == 1 and last.calls == []


def test_a_redirect_to_a_url_it_cannot_send_is_refused(serve: Callable[..., Server]) -> None:
    """A Location with a space would go out as a broken request line."""
    s = serve(lambda path: (307, {"Location": "/v1/a b"}, b"") if path == "/x" else (200, {}, OK))
    with pytest.raises(httpcall.RedirectRefused, match="cannot send"):
        httpcall.request("POST", s.url + "/x", BODY, PLAIN, 5, follow_redirects=True)
    assert [c.path for c in s.calls] == ["/x"]


# -- bounded responses --------------------------------------------------------------------
FRAMINGS = {
    "length": {},
    "chunked": {"Transfer-Encoding": "chunked"},
    "close": {"Connection": "close"},
}


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_body_over_the_limit_ends_the_call(serve: Callable[..., Server], framing: str) -> None:
    size = 1000
    s = serve(lambda _: (200, FRAMINGS[framing], b"y" * size))
    url = s.url + "/x"
    assert (
        httpcall.request("POST", url, BODY, PLAIN, 5, max_response_bytes=size).body == b"y" * size
    )
    with pytest.raises(httpcall.ResponseTooLarge, match=f"max_response_bytes \\({size - 1} "):
        httpcall.request("POST", url, BODY, PLAIN, 5, max_response_bytes=size - 1)
    out = send(url, BODY.decode(), PLAIN, 5, max_response_bytes=size - 1)
    assert (out.kind, out.category) == (Kind.FATAL, "TOO_LARGE")
    # the connection that held the cut-off body is gone; the next call opens a new one
    assert httpcall.request("POST", url, BODY, PLAIN, 5, max_response_bytes=size).status == 200


@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_an_endless_body_is_cut_off_at_the_limit(
    serve: Callable[..., Server], framing: str
) -> None:
    """A server that never stops sending ends the call at the limit, long before its
    deadline (60 s here)."""
    s = serve(lambda _: (200, FRAMINGS[framing], None))
    with pytest.raises(httpcall.ResponseTooLarge):
        httpcall.request("POST", s.url + "/x", BODY, PLAIN, 60, max_response_bytes=1 << 20)


def test_a_declared_length_over_the_limit_is_refused_before_reading(
    serve: Callable[..., Server],
) -> None:
    """``Content-Length: 10^12`` with a few bytes behind it: refused on the header, not
    after waiting out the deadline for bytes that never come."""
    s = serve(lambda _: (200, {"Content-Length": str(10**12)}, None))
    with pytest.raises(httpcall.ResponseTooLarge):
        httpcall.request("POST", s.url + "/x", BODY, PLAIN, 60, max_response_bytes=1 << 20)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"follow_redirects": "yes"}, "follow_redirects must be true or false"),
        ({"max_response_bytes": 0}, "max_response_bytes must be a positive int"),
        ({"max_response_bytes": "16MiB"}, "max_response_bytes must be a positive int"),
        ({"max_response_bytes": True}, "max_response_bytes must be a positive int"),
        ({"redirect_origins": ["https://gw-b"]}, "redirect_origins needs follow_redirects"),
        ({"follow_redirects": True, "redirect_origins": "https://gw-b"}, "redirect_origins"),
        ({"follow_redirects": True, "redirect_origins": [5]}, "redirect_origins"),
        ({"follow_redirects": True, "redirect_origins": ["gw-b:8443"]}, "not an origin"),
        ({"follow_redirects": True, "redirect_origins": ["ftp://gw-b"]}, "not an origin"),
        ({"follow_redirects": True, "redirect_origins": ["https://gw-b/v1"]}, "not an origin"),
        ({"follow_redirects": True, "redirect_origins": ["https://u:p@gw-b"]}, "not an origin"),
        ({"follow_redirects": True, "redirect_origins": ["https://gw-b:x"]}, "not an origin"),
    ],
)
def test_bad_fields_name_the_queue_and_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"\(gw\): .*{field}"):
        parse_queues([{"queue_name": "gw", "igw_base_url": "http://gw", **extra}], "q.json")


def test_the_fields_default_to_off_and_16_mib() -> None:
    (q,) = parse_queues([{"queue_name": "gw", "igw_base_url": "http://gw"}], "q.json").values()
    assert (q.follow_redirects, q.max_response_bytes) == (False, 16 * 1024 * 1024)
    assert q.redirect_origins == ()  # the queue's own origin only
    assert q.max_response_bytes == httpcall.MAX_RESPONSE_BYTES  # the call's own default


# -- through a worker node ----------------------------------------------------------------
def test_a_worker_follows_only_when_the_queue_says_and_never_leaks_its_key(
    env: dict[str, str],
    start_worker: Callable[..., WorkerProc],
    serve: Callable[..., Server],
    tmp_path: Path,
) -> None:
    target = serve()
    origin = serve(lambda path: (307, {"Location": target.url + path}, b"moved"))
    key = f"sk-{uuid.uuid4().hex}"
    iso = isolated(
        env,
        tmp_path,
        [
            {
                "queue_name": "stay",
                "igw_base_url": origin.url,
                "api_key_env": "REDIR_KEY",
                **local_limit(1),
            },
            {
                "queue_name": "follow",
                "igw_base_url": origin.url,
                "api_key_env": "REDIR_KEY",
                "follow_redirects": True,
                "redirect_origins": [target.url],
                **quota(1),
            },
            {  # follows, but only to its own origin
                "queue_name": "unlisted",
                "igw_base_url": origin.url,
                "follow_redirects": True,
                **local_limit(1),
            },
            {
                "queue_name": "small",
                "igw_base_url": target.url,
                "max_response_bytes": len(OK) - 1,
                **local_limit(1),
            },
        ],
        REDIR_KEY=key,
    )
    w, _ = start_node(start_worker, iso, concurrency=1)
    try:
        body = {"model": "m", "prompt": "hi"}
        stayed = iso.pl.submit(body, queue=iso.queue("stay")).result(timeout=20)
        assert (stayed.status_code, stayed.ok, stayed.payload) == (307, False, "moved")
        assert stayed.attempts == 1 and target.calls == []

        tenant = {"userid": "u1"}
        followed = iso.pl.submit(body, queue=iso.queue("follow"), metadata=tenant).result(20)
        assert followed.ok and followed.status_code == 200
        assert [c.headers["authorization"] for c in origin.calls] == [f"Bearer {key}"] * 2
        (call,) = target.calls
        assert "authorization" not in call.headers and json.loads(call.body)["prompt"] == "hi"

        refused = iso.pl.submit(body, queue=iso.queue("unlisted")).result(timeout=20)
        assert (refused.error_code, refused.attempts) == ("INFERENCE_ERROR", 1)
        assert "not in the queue's redirect_origins" in (refused.error_message or "")
        assert len(target.calls) == 1  # the followed one only

        cut = iso.pl.submit(body, queue=iso.queue("small")).result(timeout=20)
        assert not cut.ok and cut.attempts == 1
        assert "max_response_bytes" in (cut.error_message or "")
        assert key not in json.dumps(cut.to_dict()) + json.dumps(stayed.to_dict())
        assert_idle(iso.pl)  # no gate holds a reservation
    finally:
        w.stop()
