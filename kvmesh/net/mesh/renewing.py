"""This node's credentials in a process that runs for months (the daemon), renewed as they run.

`RenewingCredentials.renew_if_due`, called now and then, renews the certificate before it ends
(kvmesh.net.mesh.enrolment), and from then on every new TLS handshake, served or dialled, uses the
new one; connections already open keep theirs (TLS checks a certificate's dates only at the
handshake).
"""

import datetime
import threading
from pathlib import Path
from typing import Any

import grpc

from kvmesh.errors import CredentialsError
from kvmesh.net.mesh.credentials import MeshCredentials, load_credentials, renewal_due
from kvmesh.net.mesh.enrolment import renew


class RenewingCredentials:
    """This node's credentials, renewed before they end; a Membership (kvmesh.net.mesh.credentials)."""

    def __init__(
        self, data_dir: Path, node_id: str, current: MeshCredentials, *, days: float, renew_before_days: float
    ):
        self.data_dir, self.node_id = data_dir, node_id
        self.days, self.renew_before_days = days, renew_before_days
        self.current = current
        self._lock = threading.Lock()
        self._served: bytes | None = None  # the certificate the server last took

    @property
    def expires(self) -> datetime.datetime:
        return self.current.expires

    def renew_if_due(self) -> bool:
        """Renew the certificate if it ends within `renew_before_days`; True when it changed (renewed
        here, or by `kvmesh mesh renew` meanwhile). CredentialsError when it is due and the
        authority cannot renew it (the caller logs it and tries again later; the old one holds)."""
        with self._lock:
            try:
                on_disk = load_credentials(self.data_dir)
            except CredentialsError:
                on_disk = None
            if on_disk is not None and not renewal_due(on_disk, renew_before_days=self.renew_before_days):
                renewed = on_disk
            else:
                renewed = renew(self.data_dir, self.node_id, days=self.days)
            if renewed.cert_pem == self.current.cert_pem:
                return False
            self.current = renewed
            return True

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return self.current.channel_credentials()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate gRPC asks for again at each new handshake (`_fetch`)."""
        self._served = self.current.cert_pem
        return grpc.dynamic_ssl_server_credentials(
            _server_configuration(self.current), self._fetch, require_client_authentication=True
        )

    def _fetch(self) -> Any:
        """gRPC's certificate fetcher: the renewed certificate once, then None (no change)."""
        current = self.current
        if current.cert_pem == self._served:
            return None
        self._served = current.cert_pem
        return _server_configuration(current)


def _server_configuration(creds: MeshCredentials) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(creds.key_pem, creds.cert_pem)], root_certificates=creds.trust_pem
    )
