"""Service definitions that run the daemon at login: a launchd agent (macOS), a systemd unit (Linux)."""

import plistlib
import sys
from pathlib import Path

LABEL = "dev.kvmesh.daemon"


def daemon_command() -> list[str]:
    """The daemon, run by this same interpreter (so its virtual environment), logging JSON."""
    return [sys.executable, "-m", "kvmesh", "daemon", "--log-format", "json"]


def launchd_plist() -> bytes:
    logs = Path.home() / "Library" / "Logs" / "kvmesh.log"
    return plistlib.dumps(
        {
            "Label": LABEL,
            "ProgramArguments": daemon_command(),
            "RunAtLoad": True,
            # Restart after a crash, not after a clean exit (SIGTERM from launchctl).
            "KeepAlive": {"SuccessfulExit": False},
            "ProcessType": "Background",
            "StandardOutPath": str(logs),
            "StandardErrorPath": str(logs),
        }
    )


def systemd_unit() -> bytes:
    return "\n".join(
        [
            "[Unit]",
            "Description=kvmesh daemon: share LLM KV caches on the local network",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            "ExecStart=" + " ".join(daemon_command()),
            "Restart=on-failure",
            "KillSignal=SIGTERM",
            "TimeoutStopSec=30",
            "",
            "[Install]",
            "WantedBy=default.target",
            "",
        ]
    ).encode()


def service_file(platform: str) -> tuple[Path, bytes, str]:
    """(where it goes, its content, how to turn it on) for "macos" or "linux"."""
    if platform == "macos":
        path = Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return path, launchd_plist(), f"launchctl bootstrap gui/$(id -u) {path}"
    if platform == "linux":
        path = Path.home() / ".config" / "systemd" / "user" / "kvmesh.service"
        return path, systemd_unit(), "systemctl --user daemon-reload && systemctl --user enable --now kvmesh"
    raise ValueError(f"unknown platform {platform!r}: macos or linux")
