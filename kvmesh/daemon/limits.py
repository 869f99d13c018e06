"""The daemon's share of the machine: its descriptor limit raised to what the service files set."""

import logging
import resource

from kvmesh.daemon.service_files import OPEN_FILES

log = logging.getLogger(__name__)


def raise_descriptor_limit(wanted: int = OPEN_FILES) -> int:
    """Raise this process's soft descriptor limit to `wanted` (at most its hard limit); the limit now.

    A daemon started from a macOS terminal gets 256, which a few hundred connections use up; the
    service files ask launchd and systemd for OPEN_FILES, and this does the same for every other start.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # macOS refuses more than kern.maxfilesperproc
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, e)
    return soft
