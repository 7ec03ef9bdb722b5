"""Build the report PDF from results/ alone: `paper/report.typ` compiled by typst over `<results>/figures/`.

    python -m paper.build [--results DIR] [--output PATH]

Run `python -m paper.figures` first: it writes `<results>/figures/summary.json` and the figures, which are all the
report reads. The typst root is the results folder, so the report cannot reach anything else. The PDF's date is the
newest run's UTC time (not the build time), so the same results give the same PDF.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import typst

from paper.tables import results_dir

REPORT_SOURCE = Path(__file__).resolve().parent / "report.typ"
SUMMARY = "figures/summary.json"


def build(results: Path, output: Path | None = None) -> Path:
    summary_path = results / SUMMARY
    if not summary_path.is_file():
        raise FileNotFoundError(f"{summary_path} not found: run `python -m paper.figures` first")
    newest = json.loads(summary_path.read_text())["newest_utc"]
    when = None if newest is None else dt.datetime.strptime(newest, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    pdf = typst.compile(REPORT_SOURCE.read_bytes(), root=str(results.resolve()), sys_inputs={"summary": "/" + SUMMARY},
                        timestamp=None if when is None else int(when.timestamp()))  # fmt: skip
    output = output or results / "report.pdf"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(pdf)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paper.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results folder (default: $JEVLAB_RESULTS or results/)")
    parser.add_argument("--output", help="PDF path (default: <results>/report.pdf)")
    args = parser.parse_args(argv)
    print(f"report: {build(results_dir(args.results), Path(args.output) if args.output else None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
