"""The one type of a progress report, for every long piece of work (a prefill's tokens, a fetch's
bytes, a calibration's texts): `progress(done, total)`, called as the work goes on, so that the CLI
draws its bars and serve writes its log lines from any of them alike."""

from collections.abc import Callable

Progress = Callable[[int, int], None]
