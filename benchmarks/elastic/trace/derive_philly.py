"""Derive the committed Philly subset from the public files it comes from (run once; the output is committed).

    python benchmarks/elastic/trace/derive_philly.py --jobs philly.csv --nodes philly_node_sequence.csv

Sources (both derived by their authors from Microsoft's Philly trace, github.com/msr-fiddle/philly-traces, whose own
``trace-data.tar.gz`` is a Git LFS file that is not stored in the repository snapshot available here):

- ``--jobs``: ``simulator/traces/philly.csv`` of github.com/petuum/adaptdl at commit de25dcc9 (the Pollux OSDI'21
  artifact): one row per Philly job (82,247 jobs, 2017-09-04 .. 2017-12-22): submission ``timestamp``, run
  ``duration`` (s), ``num_gpus``, ``gpu_time``, virtual cluster (``cluster``). It has no start times, so the
  recorded queueing of each job is not known.
- ``--nodes``: ``framework/CES Service/data/philly_node_sequence.csv`` of github.com/S-Lab-System-Group/HeliosArtifact
  at commit bdaae109 (the Helios SC'21 artifact): per minute, the Philly nodes that were ``active`` (running a job)
  out of ``total`` (2017-10-03 .. 2017-12-15).

Output (``--start``, ``--days``; default one week from 2017-11-01): ``philly-<start>-<days>d-jobs.csv`` (``submit_s``
from the window start, ``duration_s``, ``num_gpus``, ``vc``; every job submitted in the window, in submission
order) and ``philly-<start>-<days>d-nodes.csv`` (``minute`` from the window start, ``active``, ``total``).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=Path, required=True, help="petuum/adaptdl simulator/traces/philly.csv")
    parser.add_argument("--nodes", type=Path, required=True, help="HeliosArtifact philly_node_sequence.csv")
    parser.add_argument("--start", default="2017-11-01", help="first day of the window (YYYY-MM-DD)")
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    start = dt.datetime.fromisoformat(args.start)
    end = start + dt.timedelta(days=args.days)
    stem = args.out / f"philly-{args.start}-{args.days}d"

    jobs = []
    with open(args.jobs) as handle:
        for row in csv.DictReader(handle):
            submitted = dt.datetime.fromisoformat(row["timestamp"])
            if start <= submitted < end:
                jobs.append(((submitted - start).total_seconds(), float(row["duration"]), int(float(row["num_gpus"])),
                             row["cluster"]))
    jobs.sort()
    with open(f"{stem}-jobs.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submit_s", "duration_s", "num_gpus", "vc"])
        writer.writerows((f"{s:.0f}", f"{d:.0f}", g, vc) for s, d, g, vc in jobs)

    with open(args.nodes) as handle, open(f"{stem}-nodes.csv", "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["minute", "active", "total"])
        for row in csv.DictReader(handle):
            when = dt.datetime.fromisoformat(row["time"])
            if start <= when < end:
                writer.writerow([int((when - start).total_seconds() // 60), row["active"], row["total"]])
    print(f"wrote {stem}-jobs.csv ({len(jobs)} jobs) and {stem}-nodes.csv")


if __name__ == "__main__":
    main()
