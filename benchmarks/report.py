"""Print the headline table of every result file (``python -m benchmarks.report``), as markdown.

BENCHMARKS.md's summary table is this output, pasted after a run, so that it stays true to the JSON.
"""

from __future__ import annotations

import json

from benchmarks._common import RESULTS


def main() -> None:
    print("| benchmark | headline | value | target | met | quick | load at start | when |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted(RESULTS.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
            h = doc["headline"]
        except (OSError, ValueError, KeyError):
            continue
        ok = h["value"] >= h["target"] if h["better"] == "higher" else h["value"] <= h["target"]
        sign = ">=" if h["better"] == "higher" else "<="
        load = doc.get("machine", {}).get("loadavg_at_start", ["?"])[0]
        print(f"| {path.stem} | {h['metric']} (vs {h['baseline']}) | {h['value']:.3g} {h['unit']} | {sign} {h['target']:g} | "
              f"{'yes' if ok else 'no'} | {'yes' if doc.get('quick') else 'no'} | {load} | {doc.get('time', '?')} |")


if __name__ == "__main__":
    main()
