"""No request may make the server read its files, open its ports, serve a web page of
another origin, or lock other clients out (issue 44), on a real server on an ephemeral
loopback port serving stand-in engines (no model: each test takes seconds).

- An upload that is an FFmpeg concat list or an SDP description (a demuxer that opens
  what it names) is refused as "not a supported audio file", whatever it names: no file
  is read, no UDP port bound, and the message is the same for a file that exists, one
  that does not and a folder. Every allowed container still decodes.
- A cross-site request from a browser (multipart, JSON) gets 403 unless `cors_origins`
  allows its origin; clients without `Origin` / `Sec-Fetch-Site` are not affected.
- A page that reaches the loopback server by DNS rebinding (its browser sends its own
  name as `Host`, and calls itself same-origin) gets 403 unless `allowed_hosts` names it.
- 1,000 connections that never finish their headers lock nobody out; they get 408 after
  `header_timeout`; past `max_connections` the oldest half-open one makes room, or, all
  busy, the new one gets a readable 503; running out of file descriptors is logged
  once, not once per waiting connection.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import socket
import subprocess
import sys
import threading
import time
import wave

import httpx
import numpy as np
import pytest

from tests.support.polling import wait_for

CONCAT = b"ffconcat version 1.0\nfile %s\n"
# an RTP session description: FFmpeg's SDP demuxer binds 40000 and 40001 on all
# interfaces and waits 30 s for packets (the attack)
SDP = (b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 0.0.0.0\r\nt=0 0\r\n"
       b"m=audio 40000 RTP/AVP 0\r\n")


def tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes())
    return buf.getvalue()


class Ear:
    """A stand-in engine: `transcribe` decodes the upload as Whisper does and says how
    many samples it got; `embed` waits while `hold` is set (to keep requests busy)."""

    def __init__(self):
        self.hold = threading.Event()
        self.release = threading.Event()

    def transcribe(self, audio, max_seconds=None, **options):
        from workbench.engine.audio.pcm import load_audio

        return f"{len(load_audio(audio, max_seconds=max_seconds))} samples"

    def embed(self, text):
        if self.hold.is_set():
            self.release.wait(10)
        return np.ones(4, np.float32)


@pytest.fixture(scope="module")
def ear():
    return Ear()


@pytest.fixture(scope="module")
def server(ear):
    import workbench

    with workbench.serve({"ear": ear}, port=0) as s:  # keyless, no cors_origins
        yield s


def upload(server, data: bytes, *, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + "/audio/transcriptions", data={"model": "ear"},
                      files={"file": ("speech.wav", data)}, headers=headers, timeout=30)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param",
                                                             "code"}
    return body["error"]


# -- uploads are decoded as audio only ---------------------------------------------------------
def test_a_concat_list_reads_no_file(server, tmp_path, monkeypatch):
    """The attack: a concat list naming a WAV in the server's working folder was
    transcribed, and the error told which names exist. Now each is refused with one
    message, the file unread."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "audio").mkdir()
    (tmp_path / "audio" / "secret.wav").write_bytes(tone_wav())
    assert upload(server, tone_wav()).json() == {"text": "16000 samples"}  # audio is read
    messages = set()
    for name in ("audio/secret.wav", str(tmp_path / "audio" / "secret.wav"),
                 "audio/missing.wav", "audio", "/etc/passwd"):
        started = time.monotonic()
        e = error(upload(server, CONCAT % name.encode()), 400)
        assert time.monotonic() - started < 2
        assert "not a supported audio file" in e["message"], e
        assert "secret" not in e["message"] and "missing" not in e["message"]
        messages.add(e["message"])
    assert len(messages) == 1, messages  # nothing tells which names exist


def udp_ports() -> set[tuple[str, int]]:
    """This process's bound UDP addresses."""
    psutil = pytest.importorskip("psutil")
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="udp")}


def test_an_sdp_upload_binds_no_port(server):
    before = udp_ports()
    started = time.monotonic()
    e = error(upload(server, SDP), 400)
    assert "not a supported audio file" in e["message"]
    assert time.monotonic() - started < 2  # not FFmpeg's 30 s wait for RTP packets
    assert udp_ports() == before


def test_ffmpeg_opens_nothing_but_the_upload(tmp_path, monkeypatch):
    """Even a demuxer that follows references, were one chosen, could open nothing: the
    bytes reach FFmpeg through memory with no protocol allowed."""
    import av

    from workbench.engine.audio.pcm import _ffmpeg_input

    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.wav").write_bytes(tone_wav())
    with av.open(io.BytesIO(CONCAT % b"secret.wav"), format="concat") as unguarded:
        assert sum(f.samples for f in unguarded.decode(audio=0)) == 16000  # the attack
    playlist = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nsecret.wav\n#EXT-X-ENDLIST\n"
    for data, demuxer in ((CONCAT % b"secret.wav", "concat"), (playlist, "hls")):
        with pytest.raises(av.error.FFmpegError):
            with _ffmpeg_input(lambda data=data: io.BytesIO(data), demuxer) as input_:
                list(input_.decode(audio=0))


def encoded(kind: str) -> bytes:
    """One second of tone in the container `kind`, as libsndfile or FFmpeg write it."""
    import av
    import soundfile

    t = np.arange(48000) / 48000
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    by_soundfile = {"wav": ("WAV", "PCM_16"), "rf64": ("RF64", "PCM_16"),
                    "aiff": ("AIFF", "PCM_16"), "flac": ("FLAC", "PCM_16"),
                    "ogg-vorbis": ("OGG", "VORBIS"), "ogg-opus": ("OGG", "OPUS"),
                    "mp3": ("MP3", "MPEG_LAYER_III")}
    buf = io.BytesIO()
    if kind in by_soundfile:
        container, subtype = by_soundfile[kind]
        soundfile.write(buf, pcm, 48000, format=container, subtype=subtype)
        return buf.getvalue()
    container, codec = {"webm": ("webm", "libopus"), "mp4": ("mp4", "aac"),
                        "m4a": ("ipod", "aac"), "adts": ("adts", "aac")}[kind]
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=48000, layout="mono")
        for start in range(0, len(pcm), 960):
            frame = av.AudioFrame.from_ndarray(pcm[None, start : start + 960], format="flt",
                                               layout="mono")
            frame.sample_rate = 48000
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["wav", "rf64", "aiff", "flac", "ogg-vorbis", "ogg-opus",
                                  "mp3", "webm", "mp4", "m4a", "adts"])
def test_every_allowed_container_decodes(kind):
    from workbench.engine.audio.pcm import load_audio

    data = encoded(kind)
    assert abs(len(load_audio(data)) - 16000) < 1200, kind  # encoders pad a little
    tagged = b"ID3\x04\x00\x00\x00\x00\x00\x0a" + bytes(10) + data  # an ID3v2 tag first
    if kind in ("mp3", "flac"):
        assert abs(len(load_audio(tagged)) - 16000) < 1200, kind


@pytest.mark.parametrize("data", [b"hello", b"#EXTM3U\n", b"\x89PNG\r\n\x1a\n" + bytes(40),
                                  b"<?xml version='1.0'?><MPD/>", bytes(100)])
def test_anything_else_is_refused_before_decoding(data):
    from workbench.engine.audio.pcm import AudioError, load_audio

    with pytest.raises(AudioError, match="not a supported audio file: send WAV, FLAC"):
        load_audio(data)


# -- web pages of other origins ----------------------------------------------------------------
CROSS_SITE = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site",
              "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}


def test_a_cross_site_form_is_refused(server):
    """What an HTML form on another site posts (multipart, no preflight) gets 403 and is
    not transcribed; so do an older browser's (Origin only), a same-site page's (another
    port) and a JSON fetch. Same-origin pages, the user's own navigation and clients
    that are not browsers are answered."""
    audio = tone_wav()
    e = error(upload(server, audio, headers=CROSS_SITE), 403)
    assert e["code"] == "cross_site_request" and "cors_origins" in e["message"]
    error(upload(server, audio, headers={"Origin": "https://evil.example"}), 403)
    error(upload(server, audio, headers={"Origin": "http://127.0.0.1:3000",
                                         "Sec-Fetch-Site": "same-site"}), 403)
    error(upload(server, audio, headers={"Origin": "null", "Sec-Fetch-Site": "cross-site"}),
          403)
    r = httpx.post(server.base_url + "/embeddings", json={"model": "ear", "input": "hi"},
                   headers={"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site",
                            "Sec-Fetch-Mode": "cors"})
    error(r, 403)
    own = f"http://{server.host}:{server.port}"
    assert upload(server, audio, headers={"Origin": own}).status_code == 200
    assert upload(server, audio, headers={"Origin": own, "Sec-Fetch-Site": "same-origin"}
                  ).status_code == 200
    assert upload(server, audio).json() == {"text": "16000 samples"}
    assert httpx.get(server.url + "/docs", headers={
        "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}).status_code == 200


def test_the_openai_client_is_not_a_browser(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="-")
    text = client.audio.transcriptions.create(model="ear", file=("a.wav", tone_wav()))
    assert text.text == "16000 samples"


def test_cors_origins_lets_its_pages_in(ear):
    import workbench

    with workbench.serve({"ear": ear}, port=0, cors_origins=["https://good.example"]) as s:
        r = upload(s, tone_wav(), headers={"Origin": "https://good.example",
                                           "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://good.example"
        error(upload(s, tone_wav(), headers=CROSS_SITE), 403)
    with workbench.serve({"ear": ear}, port=0, cors_origins=["*"]) as s:
        assert upload(s, tone_wav(), headers=CROSS_SITE).status_code == 200


# -- DNS rebinding -------------------------------------------------------------------------------
def rebound(server, name: str) -> dict:
    """The headers a browser sends for a page at http://<name>:<port> whose name now
    resolves to this server's address: its own host, and same-origin."""
    return {"Host": f"{name}:{server.port}", "Origin": f"http://{name}:{server.port}",
            "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}


def test_a_page_rebound_to_loopback_is_refused(server):
    """A loopback server answers to loopback names only: a rebound page's requests (JSON,
    an upload, /health) get 403 and reach no engine, whatever else they say; localhost,
    127.0.0.1, [::1], *.localhost and a request without Host (HTTP/1.0) are answered."""
    for name in ("evil.example", "attacker.test.", "192.168.1.20", "localhost.evil.example"):
        e = error(upload(server, tone_wav(), headers=rebound(server, name)), 403)
        assert e["code"] == "host_not_allowed" and "allowed_hosts" in e["message"]
    r = httpx.post(server.base_url + "/embeddings", json={"model": "ear", "input": "hi"},
                   headers=rebound(server, "evil.example"))
    error(r, 403)
    error(httpx.get(server.url + "/health", headers={"Host": "evil.example"}), 403)
    for name in ("localhost", "127.0.0.1", "127.0.0.2", "[::1]", "app.localhost", "LOCALHOST."):
        r = upload(server, tone_wav(), headers={"Host": f"{name}:{server.port}"})
        assert r.json() == {"text": "16000 samples"}, name
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_allowed_hosts_names_the_hosts_a_server_answers_to(ear):
    """`allowed_hosts` adds names (a tunnel's, a proxy's); "*" allows any; a server
    listening on other interfaces answers to any name unless told otherwise."""
    import workbench
    from workbench.server.gatekeeper import allowed_hosts_for

    with workbench.serve({"ear": ear}, port=0, allowed_hosts=["wb.internal"]) as s:
        assert upload(s, tone_wav(), headers={"Host": "WB.internal"}).status_code == 200
        assert upload(s, tone_wav(), headers={"Host": "localhost"}).status_code == 200
        error(upload(s, tone_wav(), headers={"Host": "evil.example"}), 403)
    with workbench.serve({"ear": ear}, port=0, allowed_hosts=["*"]) as s:
        assert upload(s, tone_wav(), headers=rebound(s, "evil.example")).status_code == 200
    assert allowed_hosts_for("127.0.0.1", None) == frozenset()
    assert allowed_hosts_for("::1", None) == allowed_hosts_for("localhost", None) == frozenset()
    assert allowed_hosts_for("0.0.0.0", None) is None  # any: the user serves the network
    assert allowed_hosts_for("192.168.1.5", None) is None
    assert allowed_hosts_for("0.0.0.0", ["box.lan"]) == {"box.lan"}


def test_serve_takes_allowed_host_from_the_command_line():
    from workbench import cli

    args = cli._parser().parse_args(["serve", "--allowed-host", "a.lan", "--allowed-host",
                                     "b.lan"])
    assert args.allowed_host == ["a.lan", "b.lan"]
    assert cli._parser().parse_args(["serve"]).allowed_host is None


# -- connections that never finish their headers -------------------------------------------------
def half_open(server, n: int) -> list[socket.socket]:
    """`n` connections, each with half a request's headers sent."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection((server.host, server.port), timeout=10)
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Ty")
        socks.append(sock)
    return socks


def answered(server, timeout: float = 5.0) -> float:
    """Seconds a normal request takes; it must answer within `timeout`."""
    started = time.monotonic()
    r = httpx.post(server.base_url + "/embeddings", json={"model": "ear", "input": "hi"},
                   timeout=timeout)
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def test_half_open_connections_get_408(ear):
    import workbench

    with workbench.serve({"ear": ear}, port=0, header_timeout=0.5) as s:
        socks = half_open(s, 20) + [socket.create_connection((s.host, s.port), timeout=10)]
        started = time.monotonic()
        for sock in socks:
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 408 "), head
            body = json.loads(head.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_timeout"
            assert sock.recv(4096) == b""  # closed
            sock.close()
        assert time.monotonic() - started < 3
        answered(s)  # a request in time is answered; a kept-alive one gets a new clock
        with httpx.Client(base_url=s.base_url) as client:
            for _ in range(3):
                assert client.post("/embeddings", json={"model": "ear", "input": "x"}
                                   ).status_code == 200
                time.sleep(0.3)


def test_past_max_connections_the_oldest_half_open_one_makes_room(ear):
    import workbench

    with workbench.serve({"ear": ear}, port=0, max_connections=20) as s:
        socks = half_open(s, 60)
        try:
            for _ in range(3):
                assert answered(s) < 5
            assert wait_for(lambda: len(s._server.server_state.connections) <= 21, 5)
            head = socks[0].recv(4096)  # the oldest: refused to make room, readably
            assert head.startswith(b"HTTP/1.1 503 ")
            assert b'"too_many_connections"' in head
        finally:
            for sock in socks:
                sock.close()


def test_past_max_connections_all_busy_the_new_one_gets_503(ear):
    import workbench

    with workbench.serve({"ear": ear}, port=0, max_connections=2) as s:
        ear.hold.set()
        busy = [threading.Thread(target=answered, args=(s, 20)) for _ in range(2)]
        try:
            for thread in busy:
                thread.start()
            assert wait_for(lambda: s.running.peek() == 2, 5)
            r = httpx.post(s.base_url + "/embeddings", json={"model": "ear", "input": "x"},
                           timeout=5)
            e = error(r, 503)
            assert e["code"] == "too_many_connections" and "max_connections" in e["message"]
        finally:
            ear.hold.clear()
            ear.release.set()
            for thread in busy:
                thread.join(10)
            ear.release.clear()
        answered(s)


def test_max_connections_past_the_file_limit_is_refused(ear):
    import workbench

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no file-descriptor limit")
    with pytest.raises(ValueError, match=r"max_connections=.* needs more file descriptors"):
        workbench.serve({"ear": ear}, port=0, max_connections=soft)


SERVER = """
import os, resource, sys
import workbench
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))


class Ear:
    def embed(self, text):
        return [1.0]


server = workbench.serve({"ear": Ear()}, port=0)
print(server.port, server.max_connections, flush=True)
taken = []
for command in sys.stdin:
    if command == "fill\\n":  # the rest of the process takes every descriptor left
        try:
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    elif command == "free\\n":
        for fd in taken:
            os.close(fd)
        taken.clear()
    elif command == "stop\\n":
        server.stop()
        break
    print("done", flush=True)
"""


class ServerProcess:
    """A server in a child process whose soft RLIMIT_NOFILE is `max_files` (this
    process's clients must not share its descriptors); `.stderr` once stopped."""

    def __init__(self, max_files: int):
        self.child = subprocess.Popen([sys.executable, "-c", SERVER, str(max_files)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        port, max_connections = self.child.stdout.readline().split()
        self.host, self.port, self.max_connections = "127.0.0.1", int(port), int(max_connections)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.stderr = ""

    def tell(self, command: str) -> None:
        self.child.stdin.write(command + "\n")
        self.child.stdin.flush()
        assert self.child.stdout.readline() == "done\n"

    def stop(self) -> None:
        self.child.stdin.write("stop\n")
        self.child.stdin.flush()
        _, self.stderr = self.child.communicate(timeout=20)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.child.returncode is None:
            self.child.kill()
            self.child.communicate()


def accept_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "out of system resource" in line]


@contextlib.contextmanager
def file_descriptors(n: int):
    """At least `n` file descriptors for this process (its soft limit restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"needs {n} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow  # a server in a child process: 4-5 s
def test_a_thousand_half_open_connections_lock_nobody_out():
    """The attack: a server that may open 1,000 files, 1,000 connections that never finish
    their headers (before: every request timed out, 1.8 million log lines). Requests are
    answered at once; the server keeps `max_connections` (fitted under its file limit)
    open by closing the oldest half-open ones."""
    with file_descriptors(1200), ServerProcess(max_files=1000) as server:
        assert server.max_connections < 500
        socks = half_open(server, 1000)
        try:
            for _ in range(5):
                assert answered(server) < 5
            refused = 0
            for sock in socks[:100]:  # the oldest: closed to make room, readably
                sock.settimeout(5)
                refused += sock.recv(4096).startswith(b"HTTP/1.1 503 ")
            assert refused == 100
        finally:
            for sock in socks:
                sock.close()
        answered(server)
        server.stop()
    assert len(accept_errors(server.stderr)) <= 1, server.stderr[-3000:]


@pytest.mark.slow  # a server in a child process: 4-5 s
def test_running_out_of_file_descriptors_is_logged_once():
    """asyncio logged accept()'s EMFILE once per waiting connection per retry, and the
    server answered nothing even once descriptors were free; now one line per 10 s, and
    the server serves again at once."""
    with ServerProcess(max_files=256) as server:
        server.tell("fill")
        waiting = [socket.create_connection((server.host, server.port)) for _ in range(20)]
        time.sleep(2.5)  # asyncio retries accept() every second
        server.tell("free")
        assert answered(server) < 5
        for sock in waiting:
            sock.close()
        server.stop()
    lines = accept_errors(server.stderr)
    assert len(lines) == 1, server.stderr[-3000:]
    assert "file descriptors" in lines[0]
