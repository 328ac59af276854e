"""Fetch one image URL from the open web: address policy, limits, retries, checks.

The open web is hostile, so every fetch goes through the same gate:

- **Address policy** (:class:`AddressPolicy`). Each hop's host is resolved
  here and every address is checked; private, loopback, link-local (the
  cloud metadata service at 169.254.169.254 included), multicast, reserved
  and unspecified addresses are refused unless the policy allows them by
  address, ``address:port`` or network. The connection goes to the vetted
  address itself (``Host`` and TLS SNI carry the name), so DNS cannot answer
  differently between the check and the connect. Redirects are followed by
  hand, each hop checked the same way, at most ``max_redirects`` of them.
- **Body limits.** ``Content-Length`` over ``max_bytes`` is refused before
  reading; the cap holds while streaming (also for a body without a length,
  and after gzip decoding).
- **Deadlines.** ``total_timeout`` bounds one attempt as a whole: DNS,
  connect, TLS, headers and body, over every redirect hop (time spent queued
  for a per-host slot is not counted). A watchdog thread shuts the attempt's
  socket down at its deadline, so a server that trickles a byte every half
  second, or one just inside ``read_timeout`` (which bounds each read), cannot
  hold a fetch past it; the row records ``timeout``.
- **Checks.** The content type must be an image (or a generic binary type),
  the first bytes must be an image's magic, and the header is probed with
  the decompression-bomb guard on (:func:`prx_data.core.imaging.probe`).
- **Opt-out.** ``X-Robots-Tag`` directives ``noai`` / ``noimageai`` (for
  every agent or one naming ours) skip the image, as img2dataset does.
- **Retries.** Timeouts, connection resets, 408, 429 and 5xx are transient:
  retried with exponential backoff and jitter, waiting ``Retry-After`` when
  the server gives one (up to ``max_retry_after``). Everything else is
  permanent and returned at once with its reason.
- **Politeness.** Connections are pooled per (host, address) and reused; at
  most ``per_host`` requests run at once per host, started no faster than
  ``per_host_rate`` per second. These limits hold per :class:`Fetcher` (one
  per process); across the processes of a Ray cluster the fetch tasks lease
  per-host slots from one :class:`HostSlots` (:func:`fetch_with_slots`), so
  they hold cluster-wide for every URL's own host (a redirect to another host
  is held per process only).
"""

from __future__ import annotations

import email.utils
import heapq
import ipaddress
import itertools
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import quote, urljoin, urlsplit

from prx_data.core.errors import UsageError
from prx_data.core.flags import flag, mebibytes

#: Row statuses: the image is in the row; retries were exhausted; the server
#: (or the bytes) said no for good; our address/URL policy said no; the
#: server opted out; another row with the same URL holds (or will hold) it.
OK = "ok"
TRANSIENT = "transient"
PERMANENT = "permanent"
REFUSED = "refused"
OPTED_OUT = "opted_out"
DUPLICATE = "duplicate"
STATUSES = (OK, TRANSIENT, PERMANENT, REFUSED, OPTED_OUT, DUPLICATE)

DEFAULT_USER_AGENT = "prx-data-download/1 (+https://github.com/; image-text dataset builder)"
#: Content types accepted besides ``image/*`` (many CDNs serve images as these).
GENERIC_TYPES = ("application/octet-stream", "binary/octet-stream", "application/binary")
DEFAULT_OPT_OUT = ("noai", "noimageai")
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524})
_MAGIC: tuple[tuple[int, bytes], ...] = (
    (0, b"\xff\xd8\xff"),  # JPEG
    (0, b"\x89PNG\r\n\x1a\n"),
    (0, b"GIF87a"),
    (0, b"GIF89a"),
    (0, b"BM"),
    (0, b"II*\x00"),  # TIFF
    (0, b"MM\x00*"),
    (0, b"\x00\x00\x01\x00"),  # ICO
    (0, b"\xff\x0a"),  # JPEG XL codestream
    (0, b"\x00\x00\x00\x0cJXL \r\n\x87\n"),
)


def looks_like_image(head: bytes) -> bool:
    """Magic-byte check: JPEG, PNG, GIF, WebP, BMP, TIFF, ICO, JPEG XL, AVIF/HEIF."""
    if any(head[o : o + len(m)] == m for o, m in _MAGIC):
        return True
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return head[4:8] == b"ftyp" and head[8:12] in (b"avif", b"avis", b"heic", b"heix", b"mif1")


# --- address policy ---------------------------------------------------------------------


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """A globally routable unicast address (not private, loopback, link-local, metadata...)."""
    return ip.is_global and not (
        ip.is_multicast or ip.is_reserved or ip.is_unspecified or ip.is_link_local
    )


@dataclass(frozen=True)
class AddressPolicy:
    """Which resolved addresses may be connected to.

    ``allow`` entries make exceptions to the public-only rule: an address
    (``127.0.0.1``, any port), ``address:port`` (``127.0.0.1:8080``,
    ``[::1]:8080``) or a network (``10.0.0.0/8``). Nothing is allowed by
    default; tests and private mirrors name what they need.
    """

    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for entry in self.allow:
            self._parse(entry)

    @staticmethod
    def _parse(entry: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]:
        text, port = entry.strip(), None
        try:
            if "/" in text:
                return ipaddress.ip_network(text, strict=False), None
            if text.startswith("["):
                host, _, rest = text[1:].partition("]")
                text, port = host, int(rest[1:]) if rest.startswith(":") else None
            elif text.count(":") == 1:
                text, p = text.split(":")
                port = int(p)
            ip = _ip(text)
            return ipaddress.ip_network(ip), port
        except ValueError:
            raise UsageError(
                f"allowed address {entry!r} is not an IP, IP:port or network "
                "(e.g. 127.0.0.1, 127.0.0.1:8080, 10.0.0.0/8)"
            ) from None

    def permits(self, address: str, port: int) -> bool:
        ip = _ip(address)
        if is_public(ip):
            return True
        for entry in self.allow:
            net, p = self._parse(entry)
            if ip.version == net.version and ip in net and (p is None or p == port):
                return True
        return False


Resolver = Callable[[str, int], Sequence[str]]
#: Characters kept as they are when a URL's path and query are percent-encoded.
_SAFE = "/%:@!$&'()*+,;=?~-._"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP), in the resolver's order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in seen:
            seen.append(addr)
    return seen


# --- configuration and results -------------------------------------------------------


@dataclass(frozen=True)
class FetchConfig:
    """How one fetcher behaves (see the module docstring)."""

    # Politeness and limits (the flags' group of the same name).
    threads: int = flag(
        64,
        "--threads",
        type=int,
        help="requests in flight per fetch task; the global figure is this times the "
        "tasks running (Ray CPUs / --task-cpus) (default: %(default)s)",
    )
    per_host: int = flag(
        8,
        "--per-host",
        type=int,
        help="requests in flight per host, across every fetch task of the run (default: %(default)s)",
    )
    per_host_rate: float = flag(
        0.0,
        "--per-host-rate",
        type=float,
        help="requests started per second per host and task, 0 for no limit (default: %(default)s)",
    )
    user_agent: str = flag(
        DEFAULT_USER_AGENT, "--user-agent", help="User-Agent header (default: %(default)s)"
    )
    connect_timeout: float = flag(
        10.0, "--connect-timeout", type=float, help="seconds to connect (default: %(default)s)"
    )
    read_timeout: float = flag(
        20.0,
        "--read-timeout",
        type=float,
        help="seconds one read may wait: a stalled body fails after this (default: %(default)s)",
    )
    total_timeout: float = flag(
        60.0,
        "--timeout",
        type=float,
        help="seconds for one attempt overall: DNS, connect, TLS, headers and body, over "
        "every redirect; held even against a server that trickles bytes (default: %(default)s)",
    )
    max_bytes: int = flag(
        32 * 2**20,
        "--max-mb",
        type=mebibytes,
        metavar="MIB",
        help="largest body in MiB, enforced while streaming (default: 32)",
    )
    max_redirects: int = flag(
        5,
        "--max-redirects",
        type=int,
        help="redirects followed, each hop checked (default: %(default)s)",
    )
    retries: int = flag(
        2,
        "--retries",
        type=int,
        help="attempts after the first for timeouts, resets, 429 and 5xx (default: %(default)s)",
    )
    backoff: float = flag(
        1.0,
        "--backoff",
        type=float,
        help="first retry wait in seconds, doubled each time, with jitter (default: %(default)s)",
    )
    max_backoff: float = 30.0
    max_retry_after: float = flag(
        60.0,
        "--max-retry-after",
        type=float,
        help="longest Retry-After honoured; longer ends the row's retries, which stays "
        "retryable (default: %(default)s)",
    )
    # Safety.
    allow: tuple[str, ...] = flag(
        (),
        "--allow-private",
        append=True,
        metavar="ADDR",
        help="allow an otherwise refused address: IP, IP:PORT or network "
        "(127.0.0.1:8080, 10.0.0.0/8); for local mirrors and tests; repeatable",
    )
    #: ``X-Robots-Tag`` directives that mean "do not use" (empty: ignore the header).
    opt_out: tuple[str, ...] = flag(
        DEFAULT_OPT_OUT,
        "--ignore-x-robots-tag",
        const=(),
        help="fetch images whose server sends X-Robots-Tag noai/noimageai (honoured by default)",
    )
    verify_tls: bool = flag(True, "--insecure", negate=True, help="do not verify TLS certificates")
    ca_bundle: str | None = flag(
        None,
        "--ca-bundle",
        help="PEM file of certificate authorities to trust instead of the system's",
    )

    def __post_init__(self) -> None:
        AddressPolicy(self.allow)
        for name in ("connect_timeout", "read_timeout", "total_timeout"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be > 0")
        if self.max_bytes < 1 or self.threads < 1 or self.per_host < 1:
            raise UsageError("max_bytes, threads and per_host must be >= 1")
        if self.retries < 0 or self.max_redirects < 0 or self.per_host_rate < 0:
            raise UsageError("retries, max_redirects and per_host_rate must be >= 0")


@dataclass
class FetchResult:
    """What became of one URL: ``status`` (see :data:`STATUSES`), ``reason`` when not ok."""

    url: str
    status: str
    reason: str | None = None
    data: bytes | None = None
    width: int | None = None
    height: int | None = None
    format: str | None = None
    http_status: int | None = None
    attempts: int = 0
    #: Body bytes received over all attempts (also of failed ones).
    received: int = 0
    host: str | None = None
    retry_after: float | None = field(default=None, repr=False)


class _Fail(Exception):
    def __init__(self, status: str, reason: str, http: int | None = None, retry_after=None):
        super().__init__(reason)
        self.status, self.reason, self.http, self.retry_after = status, reason, http, retry_after


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def robots_opt_out(values: Sequence[str], directives: Sequence[str], agent: str) -> str | None:
    """The first opt-out directive in ``X-Robots-Tag`` values that applies to us, or None.

    ``X-Robots-Tag: noai`` applies to every agent; ``X-Robots-Tag: otherbot:
    noai`` only to the agent it names (our user agent's first word counts).
    """
    if not directives:
        return None
    ours = agent.split("/", 1)[0].strip().lower()
    wanted = {d.lower() for d in directives}
    for value in values:
        scope, _, rest = value.partition(":")
        tokens = value
        if rest and scope.strip() and " " not in scope.strip() and "," not in scope:
            if scope.strip().lower() not in (ours, "*"):
                continue
            tokens = rest
        for tok in tokens.split(","):
            if tok.strip().lower() in wanted:
                return tok.strip().lower()
    return None


class _Attempt:
    """One attempt's deadline, and the socket the watchdog cuts when it passes.

    The fetching thread binds each connection it uses (and each new socket,
    before TLS) here; the watchdog calls :meth:`expire` at the deadline, which
    shuts the socket down so a blocked ``recv`` returns at once. :meth:`finish`
    runs before a connection goes back to the pool: a later request on it is
    never cut for this one.
    """

    def __init__(self, total: float) -> None:
        self.deadline = time.monotonic() + total
        self.expired = False
        self.done = False
        self._lock = threading.Lock()
        self._conn = None
        self._sock: socket.socket | None = None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def bind(self, conn) -> None:
        with self._lock:
            self._conn = conn
            if self.expired:
                _cut(getattr(conn, "sock", None))

    def adopt(self, sock: socket.socket) -> bool:
        """Take a freshly connected socket; False when the deadline already passed."""
        with self._lock:
            if self.expired:
                return False
            self._sock = sock
            return True

    def expire(self) -> None:
        with self._lock:
            if self.done:
                return
            self.expired = True
            _cut(self._sock)
            _cut(getattr(self._conn, "sock", None))

    def finish(self) -> None:
        with self._lock:
            self.done = True
            self._conn = self._sock = None


def _cut(sock) -> None:
    """Shut a socket down (a TLS one at the socket level: no close_notify from this thread)."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError, TypeError):  # closed, detached by the TLS wrap, or never open
        pass


class _Watchdog:
    """One thread per fetcher: expires each armed attempt at its deadline."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, _Attempt]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, attempt: _Attempt) -> None:
        with self._cv:
            heapq.heappush(self._heap, (attempt.deadline, next(self._seq), attempt))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fetch-deadlines", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    _, _, attempt = heapq.heappop(self._heap)
                    if attempt.done:
                        continue
                    if attempt.deadline > now:  # moved on (time queued for a host slot)
                        heapq.heappush(self._heap, (attempt.deadline, next(self._seq), attempt))
                        continue
                    attempt.expire()
                wait = self._heap[0][0] - now if self._heap else None
                self._cv.wait(wait)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._closed = False


#: The attempt running on this thread (urllib3 connects and sends on the caller's thread).
_current = threading.local()


def _connection_classes(u):
    """urllib3 connection classes that bind their sockets to the thread's current attempt."""

    class _Bound:
        def _new_conn(self):
            sock = super()._new_conn()
            attempt = getattr(_current, "attempt", None)
            if attempt is not None and not attempt.adopt(sock):
                sock.close()
                raise u.exceptions.ConnectTimeoutError(self, "the attempt's deadline passed")
            return sock

        def connect(self):
            attempt = getattr(_current, "attempt", None)
            if attempt is not None:
                attempt.bind(self)
            super().connect()

        def request(self, *args, **kwargs):
            attempt = getattr(_current, "attempt", None)
            if attempt is not None:
                attempt.bind(self)
            return super().request(*args, **kwargs)

    class HTTP(_Bound, u.connection.HTTPConnection):
        pass

    class HTTPS(_Bound, u.connection.HTTPSConnection):
        pass

    return HTTP, HTTPS


class _HostGate:
    """Per-host concurrency (a semaphore) and start rate (a minimum interval)."""

    def __init__(self, per_host: int, rate: float):
        self.sem = threading.BoundedSemaphore(per_host)
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.lock = threading.Lock()
        self.next_start = 0.0

    def __enter__(self):
        self.sem.acquire()
        if self.interval:
            with self.lock:
                now = time.monotonic()
                wait = self.next_start - now
                self.next_start = max(now, self.next_start) + self.interval
            if wait > 0:
                time.sleep(wait)
        return self

    def __exit__(self, *exc):
        self.sem.release()


class Fetcher:
    """Fetches URLs under one :class:`FetchConfig`; thread-safe, pools connections."""

    def __init__(self, config: FetchConfig, resolver: Resolver | None = None):
        import urllib3

        self.config = config
        self.policy = AddressPolicy(config.allow)
        self.resolver = resolver or system_resolver
        self._urllib3 = urllib3
        self._pools: dict[tuple, object] = {}
        self._gates: dict[str, _HostGate] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._dns: ThreadPoolExecutor | None = None
        self._watchdog = _Watchdog()
        self._http_cls, self._https_cls = _connection_classes(urllib3)

    # -- plumbing
    def _gate(self, host: str) -> _HostGate:
        with self._lock:
            gate = self._gates.get(host)
            if gate is None:
                gate = self._gates[host] = _HostGate(
                    self.config.per_host, self.config.per_host_rate
                )
            return gate

    def _pool(self, scheme: str, address: str, port: int, host: str):
        key = (scheme, address, port, host)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                u = self._urllib3
                kw = dict(
                    maxsize=self.config.per_host,
                    block=False,
                    retries=False,
                    timeout=u.Timeout(
                        connect=self.config.connect_timeout, read=self.config.read_timeout
                    ),
                )
                if scheme == "https":
                    pool = u.HTTPSConnectionPool(
                        address,
                        port,
                        server_hostname=host,
                        assert_hostname=host if self.config.verify_tls else False,
                        cert_reqs="CERT_REQUIRED" if self.config.verify_tls else "CERT_NONE",
                        ca_certs=self.config.ca_bundle,
                        **kw,
                    )
                else:
                    pool = u.HTTPConnectionPool(address, port, **kw)
                pool.ConnectionCls = self._https_cls if scheme == "https" else self._http_cls
                if len(self._pools) > 4096:  # a long tail of hosts: drop idle pools
                    for old in self._pools.values():
                        old.close()
                    self._pools.clear()
                self._pools[key] = pool
            return pool

    def _resolve(self, host: str, port: int, attempt: _Attempt | None) -> list[str]:
        """The resolver's answer within the attempt's deadline (``getaddrinfo`` cannot be cut)."""
        if attempt is None:
            return list(self.resolver(host, port))
        with self._lock:
            if self._dns is None:
                self._dns = ThreadPoolExecutor(self.config.threads, thread_name_prefix="dns")
            fut = self._dns.submit(self.resolver, host, port)
        try:
            return list(fut.result(timeout=max(0.0, attempt.remaining())))
        except TimeoutError:
            fut.cancel()
            raise _Fail(TRANSIENT, "timeout") from None

    def _vet(self, url: str, attempt: _Attempt | None = None) -> tuple[str, str, int, str, str]:
        """(scheme, host, port, path, address) of ``url``, or raises ``_Fail``."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise _Fail(PERMANENT, "bad_url") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise _Fail(REFUSED, "bad_scheme")
        host = parts.hostname
        if not host:
            raise _Fail(PERMANENT, "bad_url")
        if not host.isascii():
            try:  # internationalised names go on the wire (DNS, Host, SNI) as IDNA
                host = host.encode("idna").decode("ascii")
            except UnicodeError:
                raise _Fail(PERMANENT, "bad_url") from None
        if parts.username or parts.password:
            raise _Fail(REFUSED, "credentials_in_url")
        port = port or (443 if scheme == "https" else 80)
        try:
            addresses = [host] if _is_ip(host) else self._resolve(host, port, attempt)
        except socket.gaierror as e:
            transient = e.errno in (socket.EAI_AGAIN,)
            raise _Fail(TRANSIENT if transient else PERMANENT, "dns_error") from None
        except OSError:
            raise _Fail(TRANSIENT, "dns_error") from None
        if not addresses:
            raise _Fail(PERMANENT, "dns_error")
        allowed = [a for a in addresses if self.policy.permits(a, port)]
        if not allowed:
            raise _Fail(REFUSED, "refused_address")
        # Spaces and non-ASCII (common in URL lists) are percent-encoded; escapes stay.
        path = quote(parts.path or "/", safe=_SAFE)
        if parts.query:
            path += "?" + quote(parts.query, safe=_SAFE)
        return scheme, host, port, path, allowed[0]

    # -- one URL
    def fetch(self, url: str) -> FetchResult:
        """Fetch ``url`` with retries; never raises (failures come back with a reason)."""
        cfg = self.config
        result = FetchResult(url=url, status=TRANSIENT)
        try:
            result.host = (urlsplit(url).hostname or "").lower() or None
        except ValueError:
            result.host = None
        for attempt in range(cfg.retries + 1):
            result.attempts = attempt + 1
            try:
                self._attempt(url, result)
                return result
            except _Fail as f:
                result.status, result.reason, result.http_status = f.status, f.reason, f.http
                if f.status != TRANSIENT or attempt == cfg.retries:
                    return result
                wait = min(cfg.max_backoff, cfg.backoff * 2**attempt) * random.uniform(0.5, 1.5)
                if f.retry_after is not None:
                    if f.retry_after > cfg.max_retry_after:
                        return result
                    wait = max(wait, f.retry_after)
                time.sleep(wait)
            except Exception as e:  # a bug in a parser must not stop the job
                result.status, result.reason = PERMANENT, f"fetch_failed:{type(e).__name__}"
                return result
        return result

    def _attempt(self, url: str, result: FetchResult) -> None:
        """One attempt under one deadline (see the module docstring): armed on the watchdog."""
        attempt = _Attempt(self.config.total_timeout)
        _current.attempt = attempt
        self._watchdog.arm(attempt)
        try:
            self._hops(url, result, attempt)
        except _Fail as f:
            if attempt.expired and f.status != OK:  # the cut made it fail, whatever it looks like
                raise _Fail(TRANSIENT, "timeout", f.http) from None
            raise
        finally:
            attempt.finish()
            _current.attempt = None
        if attempt.expired and result.status != OK:
            raise _Fail(TRANSIENT, "timeout")

    def _hops(self, url: str, result: FetchResult, attempt: _Attempt) -> None:
        cfg = self.config
        u = self._urllib3
        seen: set[str] = set()
        for _hop in range(cfg.max_redirects + 1):
            if url in seen:
                raise _Fail(PERMANENT, "redirect_loop")
            seen.add(url)
            scheme, host, port, path, address = self._vet(url, attempt)
            default_port = port == (443 if scheme == "https" else 80)
            headers = {
                "Host": host if default_port else f"{host}:{port}",
                "User-Agent": cfg.user_agent,
                "Accept": "image/avif,image/webp,image/*;q=0.9,*/*;q=0.5",
                "Accept-Encoding": "gzip, deflate",
            }
            pool = self._pool(scheme, address, port, host)
            queued = time.monotonic()
            with self._gate(host):
                attempt.deadline += (
                    time.monotonic() - queued
                )  # waiting for a slot is no network time
                left = attempt.remaining()
                if left <= 0 or attempt.expired:
                    raise _Fail(TRANSIENT, "timeout")
                timeout = u.Timeout(
                    connect=min(cfg.connect_timeout, left), read=min(cfg.read_timeout, left)
                )
                try:
                    r = pool.urlopen(
                        "GET",
                        path,
                        headers=headers,
                        redirect=False,
                        retries=False,
                        preload_content=False,
                        decode_content=True,
                        assert_same_host=False,
                        timeout=timeout,
                    )
                except u.exceptions.TimeoutError:
                    raise _Fail(TRANSIENT, "timeout") from None
                except u.exceptions.SSLError:
                    raise _Fail(PERMANENT, "tls_error") from None
                except (u.exceptions.HTTPError, OSError):
                    raise _Fail(TRANSIENT, "connection_error") from None
                keep = False
                try:
                    if 300 <= r.status < 400 and r.status != 304:
                        location = r.headers.get("Location")
                        if not location:
                            raise _Fail(PERMANENT, f"http_{r.status}", r.status)
                        url = urljoin(url, location.strip())
                        continue
                    self._body(r, result, attempt)
                    keep = r.status == 200 and result.status == OK and not attempt.expired
                    return
                finally:
                    attempt.finish() if keep else None  # before the pool can hand it out again
                    r.release_conn() if keep else r.close()
        raise _Fail(PERMANENT, "too_many_redirects")

    def _body(self, r, result: FetchResult, attempt: _Attempt) -> None:
        cfg = self.config
        u = self._urllib3
        result.http_status = r.status
        if r.status != 200:
            if r.status in TRANSIENT_HTTP:
                raise _Fail(
                    TRANSIENT,
                    f"http_{r.status}",
                    r.status,
                    _retry_after(r.headers.get("Retry-After")),
                )
            raise _Fail(PERMANENT, f"http_{r.status}", r.status)
        directive = robots_opt_out(r.headers.getlist("X-Robots-Tag"), cfg.opt_out, cfg.user_agent)
        if directive:
            raise _Fail(OPTED_OUT, f"x_robots_tag:{directive}", 200)
        ctype = (r.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype and not ctype.startswith("image/") and ctype not in GENERIC_TYPES:
            raise _Fail(PERMANENT, "wrong_content_type", 200)
        length = r.headers.get("Content-Length")
        if length and length.strip().isdigit() and int(length) > cfg.max_bytes:
            raise _Fail(PERMANENT, "too_large", 200)
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = r.read(64 * 1024)
                if not chunk:
                    break
                size += len(chunk)
                result.received += len(chunk)
                if size > cfg.max_bytes:
                    raise _Fail(PERMANENT, "too_large", 200)
                if attempt.expired or attempt.remaining() <= 0:
                    raise _Fail(TRANSIENT, "timeout", 200)
                if not chunks and not looks_like_image(chunk[:16]) and len(chunk) >= 16:
                    raise _Fail(PERMANENT, "not_an_image", 200)
                chunks.append(chunk)
        except u.exceptions.TimeoutError:
            raise _Fail(TRANSIENT, "timeout", 200) from None
        except u.exceptions.DecodeError:
            raise _Fail(PERMANENT, "bad_encoding", 200) from None
        except (u.exceptions.HTTPError, OSError):
            raise _Fail(TRANSIENT, "connection_error", 200) from None
        if attempt.expired:  # cut at the deadline: what arrived may look complete, it is not
            raise _Fail(TRANSIENT, "timeout", 200)
        data = b"".join(chunks)
        if not data:
            raise _Fail(PERMANENT, "empty_file", 200)
        if not looks_like_image(data[:16]):
            raise _Fail(PERMANENT, "not_an_image", 200)
        from prx_data.core.imaging import ImageError, probe

        try:
            info = probe(data)
        except ImageError as e:
            raise _Fail(PERMANENT, e.reason, 200) from None
        result.status, result.reason = OK, None
        result.data, result.width, result.height, result.format = (
            data,
            info.width,
            info.height,
            info.format,
        )

    # -- many URLs
    def fetch_many(self, urls: Sequence[str]) -> list[FetchResult]:
        """Fetch ``urls`` on ``threads`` threads; results in input order."""
        return list(self.executor().map(self.fetch, urls))

    def executor(self) -> ThreadPoolExecutor:
        """The fetcher's ``threads`` threads (made on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.config.threads, thread_name_prefix="fetch")
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._dns is not None:  # a resolver call past its deadline is not waited for
            self._dns.shutdown(wait=False, cancel_futures=True)
            self._dns = None
        self._watchdog.close()
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


# --- cluster-wide per-host slots ----------------------------------------------------------


class HostSlots:
    """At most ``per_host`` requests in flight per host across every fetcher leasing here.

    One instance serves a run (a Ray actor on a cluster; its methods are quick
    and called once per fetch round, not per request). A holder asks for slots
    of the hosts it has rows for and gets what is free; it gives them back when
    its round ends. A holder that stops renewing for ``ttl`` seconds (a killed
    task) loses its slots, so a lost task cannot stall a host for the run.
    """

    def __init__(self, per_host: int, ttl: float = 60.0):
        self.per_host = per_host
        self.ttl = ttl
        self._held: dict[str, tuple[dict[str, int], float]] = {}
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, holder: str, wants: Mapping[str, int]) -> dict[str, int]:
        """More slots for ``holder``: per host of ``wants``, at most what is free; returns
        the slots granted by this call (hosts with none left out)."""
        with self._lock:
            self._expire()
            mine, _ = self._held.get(holder, ({}, 0.0))
            granted = {}
            for host, n in wants.items():
                take = min(n, self.per_host - self._in_use.get(host, 0))
                if take > 0:
                    granted[host] = take
                    mine[host] = mine.get(host, 0) + take
                    self._in_use[host] = self._in_use.get(host, 0) + take
            if mine:
                self._held[holder] = (mine, time.monotonic() + self.ttl)
            return granted

    def renew(self, holder: str) -> None:
        with self._lock:
            if holder in self._held:
                self._held[holder] = (self._held[holder][0], time.monotonic() + self.ttl)

    def give_back(self, holder: str, host: str, n: int = 1) -> None:
        """Return ``n`` of ``holder``'s slots for ``host`` (its rows there are done)."""
        with self._lock:
            mine = self._held.get(holder, ({}, 0.0))[0]
            n = min(n, mine.get(host, 0))
            if n > 0:
                mine[host] -= n
                self._in_use[host] -= n
                if not mine[host]:
                    del mine[host]

    def release(self, holder: str) -> None:
        with self._lock:
            self._drop(holder)

    def in_use(self) -> dict[str, int]:
        """Slots held per host now."""
        with self._lock:
            self._expire()
            return {h: n for h, n in self._in_use.items() if n}

    def _expire(self) -> None:
        now = time.monotonic()
        for holder in [h for h, (_, until) in self._held.items() if until < now]:
            self._drop(holder)

    def _drop(self, holder: str) -> None:
        mine, _ = self._held.pop(holder, ({}, 0.0))
        for host, n in mine.items():
            self._in_use[host] -= n


def fetch_with_slots(
    fetcher: Fetcher, urls: Sequence[str], slots, *, poll: float = 0.05, max_poll: float = 1.0
) -> list[FetchResult]:
    """:meth:`Fetcher.fetch_many` under cluster-wide per-host slots.

    ``slots`` has :class:`HostSlots`' methods (the instance itself, or a client
    of the run's Ray actor). Each slot granted for a host runs one loop on the
    fetcher's threads that fetches that host's rows one after another (starting
    no faster than its share of ``per_host_rate``) and gives the slot back as
    soon as the host has no row left to start, so a slow row holds only its own
    slot. Hosts without a free slot are asked for again while the others run;
    no more slots are held than the fetcher has threads.
    """
    import collections
    import uuid

    cfg = fetcher.config
    holder = uuid.uuid4().hex
    results: list[FetchResult | None] = [None] * len(urls)
    pending: dict[str, collections.deque] = {}
    hostless: list[int] = []
    for i, u in enumerate(urls):
        try:
            host = (urlsplit(u).hostname or "").lower()
        except ValueError:
            host = ""
        if host:
            pending.setdefault(host, collections.deque()).append(i)
        else:
            hostless.append(i)
    for i, r in zip(hostless, fetcher.fetch_many([urls[i] for i in hostless]), strict=True):
        results[i] = r  # refused before any request: no slot needed
    lock = threading.Lock()
    running: collections.Counter = collections.Counter()  # slot loops per host
    interval = cfg.per_host / cfg.per_host_rate if cfg.per_host_rate > 0 else 0.0

    def slot_loop(host: str) -> None:
        try:
            while True:
                with lock:
                    if not pending.get(host):
                        break
                    i = pending[host].popleft()
                started = time.monotonic()
                results[i] = fetcher.fetch(urls[i])
                if interval:
                    time.sleep(max(0.0, started + interval - time.monotonic()))
        finally:
            try:
                slots.give_back(holder, host)
            finally:
                with lock:
                    running[host] -= 1

    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(getattr(slots, "ttl", 60.0) / 4):
            slots.renew(holder)

    threading.Thread(target=keep_alive, daemon=True).start()
    loops = []
    wait = poll
    try:
        while True:
            with lock:
                if not any(pending.values()) and not sum(running.values()):
                    break
                free = cfg.threads - sum(running.values())
                wants = {}
                for h, q in pending.items():  # rows no loop of this call will reach soon
                    need = min(len(q) - running[h], free)
                    if need > 0:
                        wants[h], free = need, free - need
            grants = slots.acquire(holder, wants) if wants else {}
            for host, g in grants.items():  # one loop per slot, which gives it back
                with lock:
                    running[host] += g
                loops += [fetcher.executor().submit(slot_loop, host) for _ in range(g)]
            for f in [f for f in loops if f.done()]:
                loops.remove(f)
                if f.exception() is not None:
                    raise f.exception()  # a bug in a loop: stop, do not wait for its rows
            wait = poll if grants else min(max_poll, wait * 2)
            time.sleep(wait * random.uniform(0.5, 1.5))
        for f in loops:
            f.result()  # a loop that raised is a bug: let it show
    finally:
        stop.set()
        slots.release(holder)
    return results  # type: ignore[return-value]


def _is_ip(host: str) -> bool:
    try:
        _ip(host)
        return True
    except ValueError:
        return False


# --- expected content hashes (DataComp's sha256, other lists' md5) ---------------------

#: Hash algorithm by the length of its hex digest.
HASH_BY_LENGTH = {32: "md5", 40: "sha1", 64: "sha256"}
HASH_MISMATCH = "hash_mismatch"
BAD_EXPECTED_HASH = "bad_expected_hash"


def check_hash(result: FetchResult, expected: str | None) -> FetchResult:
    """Drop the bytes of an ``ok`` result that do not hash to ``expected`` (a hex digest).

    The algorithm follows from the digest's length (md5, sha1, sha256). A
    mismatch, or an expected value that is no such digest, makes the result
    ``permanent`` with reason ``hash_mismatch`` / ``bad_expected_hash`` and no
    data, so the bytes are never stored. No ``expected``: unchanged.
    """
    import hashlib

    if result.status != OK or expected is None or not str(expected).strip():
        return result
    want = str(expected).strip().lower()
    algo = HASH_BY_LENGTH.get(len(want))
    reason = None
    if algo is None or any(c not in "0123456789abcdef" for c in want):
        reason = BAD_EXPECTED_HASH
    elif hashlib.new(algo, result.data or b"").hexdigest() != want:
        reason = HASH_MISMATCH
    if reason is not None:
        result.status, result.reason = PERMANENT, reason
        result.data = result.width = result.height = result.format = None
    return result
