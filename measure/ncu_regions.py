"""Where one kernel's warps wait, by code region: the stall samples of an Nsight Compute source export.

    python -m measure.ncu_regions results/gpu/<stem>-ncu-drone-source.csv.gz _gdn_chunk_fwd_kernel

Input: the SASS source page of an `ncu --set full --import-source yes` report as CSV (`ncu --import R --page source
--csv --print-source sass`, gzipped; the campaign's `.device/ncu.sh` writes them to results/gpu/), one section per
profiled launch; the first section whose kernel name contains the given name is read. The kernel's code is split at
its widest loop (the backward branch that spans the most instructions): the prologue before the loop's first
instruction, the loop, and what follows it. Per region: the warp stall samples (a sample is one warp seen at one
instruction: samples are proportional to warp time, not to kernel time) and the warp instructions executed. Also the
share of the samples at instructions every warp executes once (their executed count is the kernel's first
instruction's: code that every program runs, whatever its work), the stall reasons over the whole kernel, and the
instructions with the most samples. The loop is also cut into stages at each `WARPGROUP.ARRIVE` (where a Hopper
warpgroup starts an asynchronous tensor-core dot, the HGMMA instructions that follow): per stage its instructions,
samples, the dot shapes it issues and its largest stall reason, so the work between two dots (loads, gates, rounding,
shared-memory staging) shows beside the dots. Reads only what ncu measured; prints, writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys

TOP_INSTRUCTIONS = 12


def kernel_rows(path: str, kernel: str) -> list[dict[str, str]]:
    """The rows (one per SASS instruction) of the first section of `path` whose kernel name contains `kernel`."""
    text = gzip.open(path, "rt").read() if path.endswith(".gz") else open(path).read()
    for section in text.split('"Kernel Name",')[1:]:
        name, body = section.split("\n", 1)
        if kernel in name:
            rows = list(csv.DictReader(io.StringIO(body)))
            return [row for row in rows if row.get("Address", "").startswith("0x")]
    raise SystemExit(f"ncu_regions: no section of {path} profiles a kernel named like {kernel!r}")


def widest_loop(rows: list[dict[str, str]]) -> tuple[int, int]:
    """(first, last) instruction index of the widest loop: the backward branch spanning the most instructions."""
    index = {int(row["Address"], 16): i for i, row in enumerate(rows)}
    best = (len(rows), -1)
    for i, row in enumerate(rows):
        words = row["Source"].split()
        if "BRA" not in " ".join(words[:2]) or not words[-1].rstrip(";").startswith("0x"):
            continue
        target = index.get(int(words[-1].rstrip(";"), 16))
        if target is not None and target < i and i - target > best[1] - best[0]:
            best = (target, i)
    if best[1] < 0:
        raise SystemExit("ncu_regions: the kernel has no loop (no backward branch)")
    return best


def summary(rows: list[dict[str, str]]) -> dict:
    """Samples and executed warp instructions per region, the every-warp share, the stall reasons, the top lines."""
    samples = [int(row["Warp Stall Sampling (All Samples)"] or 0) for row in rows]
    executed = [int(row["Instructions Executed"] or 0) for row in rows]
    first, last = widest_loop(rows)
    regions = {"prologue": range(0, first), "loop": range(first, last + 1), "after": range(last + 1, len(rows))}
    total = sum(samples)
    out = {"samples": total, "warp_instructions": sum(executed), "regions": {}}
    for name, span in regions.items():
        out["regions"][name] = {
            "samples_share": sum(samples[i] for i in span) / total,
            "warp_instructions": sum(executed[i] for i in span),
            "instructions": len(span),
        }
    every = executed[0]  # the first instruction runs once in every warp
    out["every_warp_samples_share"] = sum(s for s, e in zip(samples, executed) if e == every) / total
    out["reasons"] = {reason: count / total for reason, count in stall_reasons(rows).most_common()}
    out["loop_stages"] = loop_stages(rows[first : last + 1], total)
    ranked = sorted(range(len(rows)), key=lambda i: -samples[i])[:TOP_INSTRUCTIONS]
    out["top"] = [(rows[i]["Source"].strip(), samples[i] / total, executed[i]) for i in ranked]
    return out


def stall_reasons(rows: list[dict[str, str]]) -> collections.Counter:
    """Stall samples by reason (the `stall_*` columns, not-issued ones excluded) over `rows`."""
    reasons = collections.Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("stall_") and "Not Issued" not in key and value:
                reasons[key[len("stall_") :]] += int(value)
    return reasons


def loop_stages(loop: list[dict[str, str]], total: int) -> list[dict]:
    """The loop's instructions cut before each WARPGROUP.ARRIVE: per stage the instruction count, its share of all
    `total` samples, the distinct HGMMA shapes it issues, and its largest stall reason with that reason's share."""
    stages: list[list[dict[str, str]]] = [[]]
    for row in loop:
        if row["Source"].split()[0] == "WARPGROUP.ARRIVE" and stages[-1]:
            stages.append([])
        stages[-1].append(row)
    out = []
    for stage in stages:
        reasons = stall_reasons(stage)
        opcodes = [words[1] if words[0].startswith("@") else words[0] for words in (r["Source"].split() for r in stage)]
        dots = sorted({opcode for opcode in opcodes if opcode.startswith("HGMMA")})
        top = reasons.most_common(1)
        out.append({
            "instructions": len(stage),
            "samples_share": sum(int(row["Warp Stall Sampling (All Samples)"] or 0) for row in stage) / total,
            "dots": dots,
            "top_reason": (top[0][0], top[0][1] / sum(reasons.values())) if top else None,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.ncu_regions", description=__doc__.split("\n\n")[0])
    parser.add_argument("source_csv", help="an ncu source-page export (.csv or .csv.gz)")
    parser.add_argument("kernel", help="a substring of the kernel's name")
    args = parser.parse_args(argv)
    out = summary(kernel_rows(args.source_csv, args.kernel))
    print(f"{args.kernel}: {out['samples']} stall samples, {out['warp_instructions']:,} warp instructions executed")
    for name, region in out["regions"].items():
        print(f"  {name:<9} {100 * region['samples_share']:5.1f} % of samples, {region['warp_instructions']:>12,} warp "
              f"instructions executed, {region['instructions']:>5} instructions")  # fmt: skip
    for i, stage in enumerate(out["loop_stages"]):
        reason = (
            f", mostly {stage['top_reason'][0]} ({100 * stage['top_reason'][1]:.0f} %)" if stage["top_reason"] else ""
        )
        print(f"    loop stage {i}: {stage['instructions']:>5} instructions, {100 * stage['samples_share']:5.1f} % of "
              f"samples, dots {', '.join(stage['dots']) or 'none'}{reason}")  # fmt: skip
    print(f"  at instructions every warp executes once: {100 * out['every_warp_samples_share']:.1f} % of samples")
    print("  reasons: " + ", ".join(f"{r} {100 * s:.1f} %" for r, s in list(out["reasons"].items())[:8]))
    for source, share, executed in out["top"]:
        print(f"  {100 * share:5.1f} %  {executed:>8}  {source[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
