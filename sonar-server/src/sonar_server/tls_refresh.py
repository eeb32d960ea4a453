"""``--enable-ssl-refresh``: the certificate, key and CA files are watched, and changed ones are
loaded into the server's live SSL context, so new connections get them without a restart (open
connections keep the certificate they began with).

The files are looked at every ``interval_s`` seconds (their size, modification time and inode,
so a file replaced by a rename or a symlink swap, as Kubernetes updates a secret, counts too).
Changed files are copied aside and loaded into a scratch context first: only a certificate and
key that load together reach the live one, so a half-written file or a certificate whose key is
not there yet leaves the server on its current certificate, with a warning, until the files
change again. CA certificates are added to the ones the server trusts; a CA taken out of the
file stays trusted until a restart (an SSL context has no way to forget one)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import tempfile

from sonar_server.settings import TlsSettings

logger = logging.getLogger("sonar_server")

FileStamp = tuple[int, int, int, int] | None  # (size, mtime ns, inode, device); None: missing


def file_stamp(path: str | None) -> FileStamp:
    if path is None:
        return None
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_size, info.st_mtime_ns, info.st_ino, info.st_dev)


class CertificateRefresher:
    """Reloads ``tls``'s files into ``context`` when they change.

    :param context: the SSL context the server accepts connections with.
    :param tls: the files it was loaded from.
    :param interval_s: seconds between looks at the files.
    """

    def __init__(self, context: ssl.SSLContext, tls: TlsSettings, interval_s: float = 1.0) -> None:
        self.context = context
        self.tls = tls
        self.interval_s = interval_s
        self.num_reloads = 0
        self._chain_stamp = self._stamps(tls.certfile, tls.keyfile)
        self._ca_stamp = file_stamp(tls.ca_certs)
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def _stamps(*paths: str | None) -> tuple[FileStamp, ...]:
        return tuple(file_stamp(path) for path in paths)

    def start(self) -> None:
        """Watch from a task of the running event loop (the loop that does the handshakes:
        the context is only ever changed between them)."""
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="sonar-ssl-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # the watch must outlive any surprise: the server keeps its certificate
                logger.exception("--enable-ssl-refresh: checking the certificate files failed")

    def check(self) -> bool:
        """Reload what changed since the last look; True when the live context changed."""
        tls = self.tls
        chain_stamp = self._stamps(tls.certfile, tls.keyfile)
        ca_stamp = file_stamp(tls.ca_certs)
        if chain_stamp == self._chain_stamp and ca_stamp == self._ca_stamp:
            return False
        self._chain_stamp, self._ca_stamp = chain_stamp, ca_stamp  # a bad file is reported once, not every second
        with tempfile.TemporaryDirectory(prefix="sonar-tls-") as folder:  # private (0700): the key rests there a moment
            try:
                certfile, keyfile, ca_certs = (_copy(path, folder, name) for path, name in ((tls.certfile, "cert.pem"), (tls.keyfile, "key.pem"), (tls.ca_certs, "ca.pem")))
            except OSError as exc:
                logger.warning("--enable-ssl-refresh: cannot read %s (%s); keeping the current certificate", exc.filename, exc.strerror)
                return False
            try:  # the files as copied must load together before the live context sees them
                _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), certfile, keyfile, ca_certs)
            except ssl.SSLError as exc:
                logger.warning(
                    "--enable-ssl-refresh: %s changed but do not load together (%s); keeping the current certificate until they change again",
                    _names(tls), exc,
                )
                return False
            _load(self.context, certfile, keyfile, ca_certs)
        self.num_reloads += 1
        logger.info("--enable-ssl-refresh: loaded the changed certificate files (%s); new connections use them", _names(tls))
        return True


def _load(context: ssl.SSLContext, certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    assert certfile is not None
    context.load_cert_chain(certfile, keyfile)
    if ca_certs is not None:
        context.load_verify_locations(ca_certs)


def _copy(path: str | None, folder: str, name: str) -> str | None:
    if path is None:
        return None
    target = os.path.join(folder, name)
    shutil.copyfile(path, target)
    return target


def _names(tls: TlsSettings) -> str:
    return ", ".join(path for path in (tls.certfile, tls.keyfile, tls.ca_certs) if path)
