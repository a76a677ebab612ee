"""Render the Slurm templates with cluster-specific #SBATCH headers.

    python -m launcher.slurm --nodes 4 --gpus-per-node 8 --partition gpu --account proj > job.sbatch
    sbatch job.sbatch conf/ppo_7b.yaml trainer.total_steps=500
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATES = {"multi": "ppo.sbatch", "single": "single_node.sbatch"}


def render(template: str = "multi", **headers: str | int | None) -> str:
    """The template text with `#SBATCH --key=value` lines set (added after the last one if absent)."""
    text = (Path(__file__).parent / "slurm" / TEMPLATES[template]).read_text()
    lines = text.splitlines()
    for key, value in headers.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        pattern = re.compile(rf"^#SBATCH {re.escape(flag)}(=.*)?$")
        new = f"#SBATCH {flag}={value}" if value is not True else f"#SBATCH {flag}"
        hits = [i for i, line in enumerate(lines) if pattern.match(line)]
        if hits:
            lines[hits[0]] = new
        else:
            last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
            lines.insert(last + 1, new)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.slurm", description=__doc__.splitlines()[0])
    ap.add_argument("--template", choices=sorted(TEMPLATES), default="multi")
    for flag in ("nodes", "gpus-per-node", "cpus-per-task", "time", "partition", "account", "job-name", "qos"):
        ap.add_argument(f"--{flag}")
    args = vars(ap.parse_args(argv))
    template = args.pop("template")
    if template == "single" and args.get("nodes") not in (None, "1"):
        print("error: the single-node template runs on one node; use --template multi", file=sys.stderr)
        return 2
    sys.stdout.write(render(template, **args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
