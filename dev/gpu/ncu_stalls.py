"""Summarise ncu's per-SASS-instruction source page (--page source --csv --print-source sass):
the stall-sample columns summed, and the instructions that hold the most samples, with their
addresses (a warp-role kernel's roles occupy separate address ranges; EXIT lines mark the ends)."""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def main(path, top=45):
    with open(path, newline="") as f:
        lines = [line for line in f if line.count(",") > 2]
    rows = list(csv.DictReader(lines))
    if not rows:
        print("no rows in", path)
        return
    cols = list(rows[0])
    samples = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    stall_cols = [c for c in cols if c.lower().startswith("stall") or "stall_" in c.lower()]
    print(f"{len(rows)} instructions; columns: {', '.join(cols[:12])}{' ...' if len(cols) > 12 else ''}")
    if samples is None:
        return
    total = sum(number(r[samples]) for r in rows)
    print(f"all samples {total:.0f}")
    sums = sorted(((sum(number(r[c]) for r in rows), c) for c in stall_cols), reverse=True)
    for value, name in sums[:14]:
        if value:
            print(f"  {100 * value / max(total, 1):5.1f}%  {name}")
    source = "Source" if "Source" in cols else cols[1]
    address = "Address" if "Address" in cols else cols[0]
    exits = [r[address] for r in rows if "EXIT" in r[source]]
    print("EXIT at", " ".join(exits[:12]))
    print(f"top {top} instructions by samples (% of all, address, sass, top stall columns):")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:top]:
        why = sorted(((number(r[c]), c) for c in stall_cols), reverse=True)[:2]
        why_text = ", ".join(f"{c}={v:.0f}" for v, c in why if v)
        print(f"  {100 * number(r[samples]) / max(total, 1):5.2f}%  {r[address]:>8}  {r[source][:70]:70}  {why_text}")


if __name__ == "__main__":
    main(sys.argv[1])
