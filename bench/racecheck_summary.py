"""Group a compute-sanitizer racecheck log by hazard site: kind, then the source line (or, without
line info, the kernel offset) and warp of each access. Run the kernels with line info
(CUTE_DSL_LINEINFO=1 for CuTe DSL) so that each access names its file and line:

    CUTE_DSL_LINEINFO=1 compute-sanitizer --tool racecheck --print-limit 100000 \\
        python bench/cute_sanitize_grid.py > racecheck.log 2>&1
    python bench/racecheck_summary.py racecheck.log

Prints one line per distinct group of sites with its count of reports, most frequent first.
"""
from __future__ import annotations

import collections
import re
import sys

# "--racecheck-report all" names each thread; the default report groups a write with its reads
ACCESS = re.compile(r"(Read|Write) Thread \((\d+),\d+,\d+\) at (\S+?)\+0x([0-9a-f]+) in (\S+)")
GROUPED = re.compile(r"(Read|Write) access at (\S+?)\+0x[0-9a-f]+ in (\S+?)(?: \[(\d+) hazards\])?$", re.M)


def _short(kernel: str) -> str:
    return re.sub(r"_object_at_.*", "", kernel)[-48:]


def sites(log: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for report in log.split("========= Error: ")[1:]:
        kind = report.split(" detected")[0].split(" reported")[0]
        accesses = []
        for access, thread, kernel, offset, where in ACCESS.findall(report):
            accesses.append(f"{access} warp {int(thread) // 32} {_short(kernel)}+0x{offset} {where}")
        if accesses:
            counts[(kind, *accesses)] += 1
            continue
        # grouped: one write site, several read offsets; counted by source lines
        lines = sorted({f"{access} {_short(kernel)} {where}" for access, kernel, where, _ in GROUPED.findall(report)})
        counts[(kind, *lines)] += 1
    return counts


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    log = open(sys.argv[1], errors="replace").read()
    summary = re.findall(r"RACECHECK SUMMARY: .*", log)
    counts = sites(log)
    print(summary[-1] if summary else "no RACECHECK SUMMARY line in the log")
    print(f"{sum(counts.values())} reports read, {len(counts)} distinct site pairs")
    for key, n in counts.most_common():
        print(f"{n:6d}  {key[0]}: " + " | ".join(key[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
