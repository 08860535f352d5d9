"""What every benchmark report carries (device, dtype, command line) and how it is written out."""

from __future__ import annotations

import json
import shlex


def device_name(device: str | None) -> str | None:
    """The GPU's name (torch.cuda.get_device_name), "cpu", or None when unknown (a remote server)."""
    if device is None:
        return None
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def command_line(argv: list[str]) -> str:
    return shlex.join(["pdserve", *argv])


def emit(report: dict, output_json: str | None) -> None:
    """The report as one JSON line on stdout (last line: machine-readable), and in a file when asked."""
    line = json.dumps(report, sort_keys=True)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A plain right-aligned text table."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [" | ".join(str(cell).rjust(w) for cell, w in zip(header, widths))]
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.append(" | ".join(str(cell).rjust(w) for cell, w in zip(row, widths)))
    return "\n".join(lines)
