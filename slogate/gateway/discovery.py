"""DNS discovery: a `dns+` / `dnssrv+` backend entry becomes one replica per address.

One mechanism for docker compose (a service name resolves to every container of the service)
and Kubernetes (a headless Service resolves to every ready pod; its SRV records name each pod's
port), as Prometheus and Thanos discover targets. A resolution that fails keeps the replicas
found last: a DNS hiccup must not drain a healthy fleet.

With no nameserver configured, A/AAAA names go through the system resolver (`getaddrinfo`, in
the loop's thread pool: /etc/hosts and resolv.conf, as every other program on the host sees
them); SRV names and configured nameservers use dnspython's asyncio resolver.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.resolver

from slogate.gateway.config import BackendConfig, DiscoveryConfig

log = logging.getLogger("slogate.discovery")


class ResolveError(Exception):
    pass


class Resolver:
    def __init__(self, cfg: DiscoveryConfig) -> None:
        self.cfg = cfg
        self._dns: dns.asyncresolver.Resolver | None = None
        if cfg.nameservers:
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers = [ns.rpartition(":")[0] if ns.count(":") == 1 else ns for ns in cfg.nameservers]
            ports = {int(ns.rpartition(":")[2]) for ns in cfg.nameservers if ns.count(":") == 1}
            r.port = ports.pop() if len(ports) == 1 else 53  # dnspython has one port for all servers
            self._dns = r

    def _resolver(self) -> dns.asyncresolver.Resolver:
        if self._dns is None:
            self._dns = dns.asyncresolver.Resolver()  # /etc/resolv.conf
        self._dns.lifetime = self.cfg.timeout_s
        return self._dns

    async def addresses(self, host: str, port: int) -> list[tuple[str, int]]:
        """Every address `host` resolves to (A and AAAA), sorted."""
        try:
            if self.cfg.nameservers:
                found: set[str] = set()
                errors: list[str] = []
                for rdtype in ("A", "AAAA"):  # a name with only one of them is normal: one answer is enough
                    try:
                        ans = await self._resolver().resolve(host, rdtype, search=True)
                        found.update(r.to_text() for r in ans)
                    except dns.exception.DNSException as e:
                        errors.append(f"{rdtype}: {type(e).__name__}: {e}")
                if not found:
                    raise ResolveError(f"{host}: " + "; ".join(errors or ["no A or AAAA records"]))
                return sorted((a, port) for a in found)
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                           self.cfg.timeout_s)
            return sorted({(str(i[4][0]), port) for i in infos})
        except (OSError, TimeoutError, dns.exception.DNSException) as e:
            raise ResolveError(f"{host}: {type(e).__name__}: {e}") from None

    async def services(self, name: str) -> list[tuple[str, int]]:
        """Every (target address, port) of `name`'s SRV records."""
        try:
            ans = await self._resolver().resolve(name, "SRV", search=True)
        except dns.exception.DNSException as e:
            raise ResolveError(f"{name}: {type(e).__name__}: {e}") from None
        out: set[tuple[str, int]] = set()
        for r in ans:
            target = r.target.to_text().rstrip(".")
            out.update(await self.addresses(target, r.port))
        return sorted(out)

    async def expand(self, entry: BackendConfig) -> list[BackendConfig]:
        """The replicas a `dns+` / `dnssrv+` entry names now, each a plain backend entry."""
        srv = entry.url.startswith("dnssrv+")
        bare = entry.url.removeprefix("dnssrv+").removeprefix("dns+")
        u = urlsplit(bare)
        assert u.hostname is not None
        found = await (self.services(u.hostname) if srv else self.addresses(u.hostname, u.port or 0))
        label = entry.name or u.hostname
        return [entry.model_copy(update={"url": f"{u.scheme}://{_host(a)}:{p}", "name": f"{label}/{_host(a)}:{p}"})
                for a, p in found]


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


class Discovery:
    """The concrete replica list for a backend list: static entries as they are, discovered
    ones from their last successful resolution."""

    def __init__(self, cfg: DiscoveryConfig) -> None:
        self.resolver = Resolver(cfg)
        self.last: dict[str, list[BackendConfig]] = {}  # entry url → its replicas at the last good resolution
        self.failing: dict[str, str] = {}  # entry url → its last error (logged when it starts or changes)

    async def replicas(self, entries: list[BackendConfig]) -> list[BackendConfig]:
        dyn = [e for e in entries if e.discovered]
        results = await asyncio.gather(*(self.resolver.expand(e) for e in dyn), return_exceptions=True)
        for e, res in zip(dyn, results, strict=True):
            if isinstance(res, BaseException):
                if self.failing.get(e.url) != str(res):
                    log.warning("discovery of %s failed (%s); keeping the %d replica(s) found last", e.url, res, len(self.last.get(e.url, [])))
                self.failing[e.url] = str(res)
                continue
            if self.failing.pop(e.url, None) is not None:
                log.warning("discovery of %s works again", e.url)
            if [r.url for r in res] != [r.url for r in self.last.get(e.url, [])]:
                log.info("discovery: %s resolves to %d replica(s): %s", e.url, len(res), ", ".join(r.url for r in res) or "none")
            self.last[e.url] = res
        for url in set(self.last) - {e.url for e in dyn}:
            del self.last[url]  # an entry the config no longer has
        out: dict[str, BackendConfig] = {}
        for e in entries:
            for r in (self.last.get(e.url, []) if e.discovered else [e]):
                out.setdefault(r.url, r)  # the first entry naming a replica wins
        return list(out.values())
