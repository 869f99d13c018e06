"""Every time limit of kvmesh's calls, streams and daemons, in one place, each with why it is what it is.

gRPC has no per-message timeout and a sleeping Mac's TCP stack may keep a connection open for
minutes, so each limit here is what keeps one stalled party from holding another: a request from
waiting on a peer that went away, a transfer slot from a peer that stopped reading. Needs nothing
but the standard library: every layer from the network up reads it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """Seconds (and the one rate) the network and the daemon allow; `TIMEOUTS` holds the defaults."""

    # A unary call to a peer (Info, Lookup, Probe): a LAN peer answers in milliseconds, and a busy
    # one still keeps threads for these (kvmesh.net.server RESERVED_WORKERS): after this, it is gone.
    call: float = 10.0
    # A lookup on the way to a prompt's first token: a person waits on it, and a peer that slow
    # would cost more than the prefill its cache could save.
    lookup: float = 5.0
    # A receiver's stream that brings no message for this long is cut (a frozen or sleeping peer);
    # the request then goes on without that peer. Short: a request, and a person, wait on it.
    stream_idle: float = 10.0
    # A sender's stream that brings no message (a decision, a chunk) for this long is cut, so a peer
    # that stopped reading frees its transfer slot (the daemon's policy, `idle_timeout`). Longer
    # than the receiver's: a receiver may take its time to decide (its store, its disk) and decode.
    peer_stream_idle: float = 30.0
    # A basis fetched while the sender's Fetch waits for the decision must arrive within that wait
    # (`peer_stream_idle`), with room to spare: 25 s is 130 MB (an 8B model's) at 5 MB/s.
    artifact: float = 25.0
    # A whole transfer may take this long plus its bytes at `min_transfer_rate` (bytes per second):
    # generous for setting up and for a slow link, yet a crawling transfer ends.
    transfer_grace: float = 30.0
    min_transfer_rate: int = 1 << 20
    # A receiver cuts a stream that brings less than `min_receive_rate` bytes a second over any
    # `rate_window` seconds it spent waiting for the sender (its own decoding does not count): a
    # sender trickling a frame every few seconds never trips `stream_idle`, yet holds a request far
    # past the prefill it was meant to save. 256 KiB/s is below any link worth fetching over.
    min_receive_rate: int = 256 << 10
    rate_window: float = 4.0
    # A sender codes a stored cache on request (kvmesh.net.on_request) only when it expects to be done
    # within this: the receiver waits for the manifest, which comes after, for `stream_idle`.
    code_on_request: float = 5.0
    # A fetch's open (and a publish's manifest) goes with the call itself, so it arrives within a
    # round trip: a caller that sends none by then is cut before it holds a thread for long.
    open_message: float = 3.0
    # The whole mesh part of a request (lookups, probes, fetches) may take this long when no prefill
    # of the model was timed here (else: what prefilling the prompt would take); after it the request
    # prefills. A person waits on it.
    mesh_budget: float = 60.0
    # Proving an advertised address (a TLS handshake, or Info on a plaintext mesh): a LAN peer
    # answers in milliseconds; one that does not within this is tried again later.
    prove: float = 3.0
    # A connection without a call for this long is closed by the server (the client reconnects when
    # it needs to): idle connections held by many clients would use up the daemon's descriptors.
    connection_idle: float = 120.0
    # A connection is asked to go (GOAWAY; its calls finish) after this long, so renewed certificates
    # and changed addresses take effect on connections that would otherwise live for months.
    connection_age: float = 3600.0
    # HTTP/2 pings this often during a call, and a ping unanswered this long cuts it: a peer that
    # went to sleep (its TCP stack may still answer) is found within 15 s even when no message is due.
    keepalive: float = 10.0
    keepalive_ack: float = 5.0
    # A peer that opens a connection and never finishes the TLS handshake is dropped after this: a
    # LAN handshake takes milliseconds, and a stranger's half-open connections hold descriptors.
    handshake: float = 5.0
    # Resolving an mDNS advert's addresses: multicast answers come within a second on a LAN; a
    # peer that does not answer by then is heard again at its next advert.
    mdns_resolve: float = 3.0
    # A call to the local daemon's Control service on loopback: it answers at once or is stuck.
    control: float = 5.0
    # Transfers in flight get this long to finish when a daemon or server stops.
    shutdown_grace: float = 10.0
    # A new daemon serves within seconds; a loaded machine (imports, key generation) may take tens.
    daemon_start: float = 60.0
    # A stopping daemon says goodbye to the mesh and lets transfers finish (`shutdown_grace`) first.
    daemon_stop: float = 30.0

    def transfer_deadline(self, encoded_bytes: int) -> float:
        """Seconds a transfer of `encoded_bytes` may take in all."""
        return self.transfer_grace + encoded_bytes / self.min_transfer_rate


TIMEOUTS = Timeouts()
