"""Draw the README's pictures of a run: the text report (docs/img/report_example.png) and memory.png.

    python examples/lightning_cpu.py --out runs
    python scripts/docs_pictures.py runs/example/version_0

The report is rendered as it prints (monospace); the plot is ``memcallbacks plot``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def render_text(text: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    lines = text.splitlines()
    width = max(len(line) for line in lines)
    fig = Figure(figsize=(0.075 * width + 0.4, 0.19 * len(lines) + 0.4), dpi=110)
    fig.patch.set_facecolor("#1e1e1e")
    head, _, rest = text.partition("\n")
    fig.text(0.01, 0.99, head, family="monospace", fontsize=9, va="top", ha="left", color="#9fe870", weight="bold")
    fig.text(0.01, 0.99, "\n" + rest, family="monospace", fontsize=9, va="top", ha="left", color="#e8e8e8")
    fig.savefig(path, facecolor=fig.get_facecolor(), bbox_inches="tight", pad_inches=0.15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_folder", help="a run folder holding memcallbacks/ (or the output folder itself)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args()
    from memcallbacks._files.report import find_output_dir, format_report, load_output_dir
    from memcallbacks.cli import main as cli

    folder = find_output_dir(args.run_folder)
    report, history = load_output_dir(folder)
    text = format_report(report, history)
    # the files' own paths depend on where the run was made: show them relative to the run folder
    text = text.replace(str(Path(args.run_folder).resolve().parent.parent.parent) + "/", "")
    out = Path(args.out)
    render_text(text, out / "report_example.png")
    if cli(["plot", str(folder), "-o", str(out / "memory_example.png"), "--title", "examples/lightning_cpu.py"]) != 0:
        return 1
    print(out / "report_example.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
