"""Finding peers: mDNS adverts and browsing (python-zeroconf), static peers, and health checks.

mDNS says who is out there but not who is alive: a SIGKILLed peer's record lingers in browsers for
many minutes. So every known peer is health-checked over gRPC; one that fails a few checks in a row
is dropped from the live table within seconds and probed on, so it comes back when it answers
again (after a partition heals). The advert carries only ids and a port; what a peer holds is asked
over gRPC.

mDNS is unauthenticated: anyone on the LAN can advertise any node id at any address, or send a
goodbye in any node's name. So an advert is a hint only: a node id is bound to an address once the
peer there proves it, with the mesh certificate for that id in a mutual TLS handshake (on a
plaintext, loopback-only mesh: its Info over the real channel). A goodbye makes the daemon check the
peer at once, and only one that no longer answers leaves the table.

The modules, each importing only those before it: `interfaces` (what to advertise, how to dial what
was heard), `peers` (the live table), `proof` (who is at an address), `links` (which of a peer's
addresses is fastest), `health` (the checks), `verifier` (hints and goodbyes into the table), `mdns`
(the advert and the browser).
"""
