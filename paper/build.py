"""Build the report PDF from results/ alone: `paper/report.typ` compiled by typst over `<results>/figures/`.

    python -m paper.build [--results DIR] [--output PATH]

Run `python -m paper.figures` first. The typst root is the results folder (the report reads nothing else); the PDF is
dated by the newest run, so the same results give the same PDF.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import typst

from paper.figures import SUMMARY_FILE
from paper.tables import results_dir

REPORT_SOURCE = Path(__file__).resolve().parent / "report.typ"


def build(results: Path, output: Path | None = None) -> Path:
    if not (results / SUMMARY_FILE).is_file():
        raise FileNotFoundError(f"{results / SUMMARY_FILE} not found: run `python -m paper.figures` first")
    newest = json.loads((results / SUMMARY_FILE).read_text())["newest_utc"]
    when = newest and dt.datetime.strptime(newest, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    pdf = typst.compile(REPORT_SOURCE.read_bytes(), root=str(results.resolve()), timestamp=int(when) if when else None,
                        sys_inputs={"summary": "/" + SUMMARY_FILE})  # fmt: skip
    (output := output or results / "report.pdf").parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(pdf)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paper.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results folder (default: $JEVLAB_RESULTS or results/)")
    parser.add_argument("--output", type=Path, help="PDF path (default: <results>/report.pdf)")
    args = parser.parse_args(argv)
    print(f"report: {build(results_dir(args.results), args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
