"""A benchmark's section of docs/BENCHMARKS.md: its heading, the command, the environment, its tables; written in
place of the section with the same heading so every other section is kept."""
from __future__ import annotations

from pathlib import Path


def docs_section(heading: str, command: str, env: dict, tables: list[str]) -> str:
    v = env["versions"]
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    head = [heading, "", f"Measured {env['date']} on {env['machine']} ({versions}); "
            f"1-minute load average {env['load_average'][0]:.2f} at the start, "
            f"{env['load_average_end'][0]:.2f} at the end (2 cores shared with other work: above ~1 the numbers "
            f"are not trustworthy).", "", "```bash", command, "```"]
    return "\n".join(head + [part for t in tables for part in ("", t)] + [""])


def replace_section(path: Path, section: str) -> None:
    """Write `section` into `path`: it replaces the section with the same heading (its first line, up
    to the next `## ` heading outside a code block) or is appended; every other section is kept."""
    heading = section.splitlines()[0].strip()
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end, fenced = len(lines), False
        for i in range(start + 1, len(lines)):
            if lines[i].lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and lines[i].startswith("## "):
                end = i
                break
        rest = "".join(lines[end:])
        new = "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
