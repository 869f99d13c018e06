"""Running daemons renew their certificates: a mesh left up past a certificate's end keeps talking.

Certificates here last half a minute (a month in use), so two real daemons run across the end of
the ones they started with: A, the authority, signs its own; B, a member without the CA key, asks
A's daemon for each of its new ones.
"""

import datetime

import pytest
from cryptography import x509

from kvmesh.daemon.control import control_status
from kvmesh.net.mesh.credentials import load_credentials
from kvmesh.net.mesh.enrolment import init_mesh, renew
from kvmesh.net.node_id import node_id
from kvmesh.paths import mesh_dir
from support.daemons import loopback_daemon
from support.membership import join
from support.waiting import wait_for

pytestmark = pytest.mark.slow

# Node certificates start 5 minutes in the past (clock skew), so 330 s leaves 30 s from now; the
# daemons renew when 20 s are left, checking every 5 s.
LIFETIME_DAYS = 330 / 86400
MARGIN_DAYS = 20 / 86400


def expiry(data_dir) -> datetime.datetime:
    creds = load_credentials(data_dir)
    assert creds is not None
    return x509.load_pem_x509_certificate(creds.cert_pem).not_valid_after_utc


def test_daemons_renew_their_certificates_while_running_and_stay_peers_past_the_first_ones_end(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    init_mesh(a, node_id(a))
    renew(a, node_id(a), days=LIFETIME_DAYS)
    short = ["--certificate-days", LIFETIME_DAYS, "--renew-before-days", MARGIN_DAYS]
    # A's daemon grants at most its certificate_days: B's certificate from the join is short too.
    daemon_a = loopback_daemon(a, *map(str, short), "--health-interval", "0.5")
    join(a, b)
    assert not (mesh_dir(b) / "ca.key").exists()
    first_end = max(expiry(a), expiry(b))
    daemon_b = loopback_daemon(b, *map(str, short), "--peer", daemon_a.address, "--health-interval", "0.5")
    try:

        def live() -> bool:
            return any(p.healthy for p in control_status(b).peers)

        wait_for(live, 20, 0.2, "B to find A live")
        wait_for(
            lambda: datetime.datetime.now(datetime.timezone.utc) > first_end + datetime.timedelta(seconds=3),
            60,
            0.5,
            "the first certificates to end",
        )
        # Health checks open a new TLS connection each time: both sides must show renewed certificates.
        wait_for(lambda: control_status(b).peers[0].failures == 0 and live(), 10, 0.2, "A live after the end")
        assert expiry(a) > first_end and expiry(b) > first_end
    finally:
        daemon_a.stop()
        daemon_b.stop()
    for daemon in (daemon_a, daemon_b):
        log = daemon.log.read_text()
        assert "renewed this node's certificate; it now runs to" in log
        assert "cannot renew" not in log
    assert "renewed the certificate of " + node_id(b) in daemon_a.log.read_text()  # A signed B's


def test_the_renewal_margin_must_fit_in_the_certificate(tmp_path):
    from kvmesh.daemon.config import DaemonConfig
    from kvmesh.errors import ConfigError

    with pytest.raises(ConfigError, match=r"renew_before_days \(40.0\) must be above 0 and below certificate_days"):
        DaemonConfig(certificate_days=30.0, renew_before_days=40.0)
